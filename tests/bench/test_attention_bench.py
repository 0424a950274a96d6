"""``make bench-attention --quick`` runs end to end: both layouts timed in one process,
each one's peak memory measured in a fresh process, and their log-probabilities agree."""

from hieragent.bench.attention import LAYOUTS, main


def test_quick_bench_attention_times_both_layouts_and_they_agree(capsys):
    result = main(["--quick", "--precision", "32-true"])
    assert set(result["seconds"]) == set(LAYOUTS)
    assert all(len(s) == 2 and min(s) > 0 for s in result["seconds"].values())
    assert all(peak is None or peak >= 0 for peak in result["peak_mb"].values())
    assert 0 <= result["gap"] < 1e-5  # same numbers in fp32: a wrong mask or layout would differ by far more
    out = capsys.readouterr().out
    assert "vs sdpa" in out and "hieragent grouped" in out and "precision 32-true (given)" in out
