"""``make bench-objective`` runs end to end (at a toy budget) and prints its whole table."""

import json
import math

from hieragent.bench.objective import interval_verdicts, main, read_metrics, separated


def test_bench_runs_every_variant_and_its_stale_runs_are_really_off_policy(tmp_path, capsys):
    # the reference and one stale row (repro-offpolicy's --quick test runs every objective level)
    results = main(["--seeds", "0", "--batches", "1", "--updates", "2", "--lag", "1", "--out", str(tmp_path),
                    "--only", "clip norm."])
    out = capsys.readouterr().out
    for name in ("on-policy", "turn IS + clip norm.", "mean ± std"):
        assert name in out
    assert "token PPO" not in out
    # one verdict for the one pair (one seed each: disjoint unless the two values are equal)
    verdicts = [line for line in out.splitlines() if "inside the noise" in line or "intervals are disjoint" in line]
    assert len(verdicts) == 1 and "on-policy" in verdicts[0] and "clip norm." in verdicts[0]
    runs = sorted(tmp_path.glob("run*/lightning_logs/tiny_learn/version_0"))
    assert len(runs) == len(results) == 2
    # the stale run really took two optimizer steps per rollout batch
    assert [json.loads((r / "eval_summary.json").read_text())["updates"] for r in runs] == [1, 2]
    for run, (name, (summary,)) in zip(runs, results):
        m = read_metrics(run)
        assert summary["after"] == json.loads((run / "eval_summary.json").read_text())["after"]["success"]
        ratios = m["executor/ratio_max"] + m["executor/ratio_min"]
        if name.startswith("on-policy"):  # one update per fresh batch: every ratio is 1, up to
            # float32 rounding (the engine's prefix cache runs the same numbers in another layout)
            assert max(abs(r - 1.0) for r in ratios) < 1e-5 and summary["clip_frac"] == 0.0
        else:  # the second update of a batch rolled out one step earlier is off-policy
            assert max(abs(r - 1.0) for r in ratios) > 1e-4
        assert math.isnan(summary["norm_triggered"]) == ("clip norm" not in name)


def test_interval_verdicts_separate_only_disjoint_mean_std_intervals():
    assert separated([0.9, 0.92, 0.94], [0.5, 0.52, 0.54])
    assert not separated([0.9, 0.5, 0.7], [0.6, 0.62, 0.64])
    lines = interval_verdicts({"a": [0.9, 0.92, 0.94], "b": [0.5, 0.52, 0.54], "c": [0.9, 0.5, 0.7]})
    assert lines[0] == "'a' > 'b': the mean ± std intervals are disjoint"
    assert "inside the noise" in lines[1] and "inside the noise" in lines[2]
