"""``make bench-attention --quick`` runs end to end: every variant timed in one process,
each one's peak memory measured in a fresh process, and their log-probabilities agree."""

from hieragent.bench.attention import VARIANTS, main


def test_quick_bench_attention_times_every_variant_and_they_agree(capsys):
    result = main(["--quick", "--precision", "32-true"])
    assert list(result["seconds"]) == list(VARIANTS) == ["sdpa", "grouped", "trainer"]
    assert all(len(s) == 2 and min(s) > 0 for s in result["seconds"].values())
    assert all(peak is None or peak >= 0 for peak in result["peak_mb"].values())
    assert result["gap"]["sdpa"] == 0
    # same numbers in fp32: a wrong mask, layout or head would differ by far more
    assert all(0 <= result["gap"][v] < 1e-5 for v in ("grouped", "trainer"))
    out = capsys.readouterr().out
    assert "vs sdpa" in out and "grouped, blocked head (trainer)" in out and "precision 32-true (given)" in out
