"""``make bench-objective`` runs end to end (at a toy budget) and prints its whole table."""

from hieragent.bench.objective import main


def test_bench_runs_every_variant_and_prints_the_table(tmp_path, capsys):
    main(["--batches", "1", "--updates", "2", "--lag", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for name in ("on-policy", "token PPO", "turn IS + clip norm."):
        assert name in out
    # the stale runs really took two optimizer steps per rollout batch
    summaries = sorted(tmp_path.glob("run*/lightning_logs/tiny_learn/version_0/eval_summary.json"))
    assert len(summaries) == 4
    assert [s.read_text().count('"updates": 2') for s in summaries] == [0, 1, 1, 1]
