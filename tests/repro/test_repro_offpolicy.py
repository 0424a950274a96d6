"""``make repro-offpolicy --quick``: the stale runs are off-policy with multi-token turns,
and every reported figure is what the runs' own files say (real subprocess runs of the tiny
model)."""

import csv
import json
import statistics

import numpy as np
import pytest
import yaml

from hieragent.repro import offpolicy

LABELS = {name: label for name, (label, _) in offpolicy.variants(1, 1).items()}


def read_json(path):
    return json.loads(path.read_text())


def run_dir(out, job):
    return out / job / "run" / "version_0"


def column(out, job, key):
    with open(run_dir(out, job) / "metrics.csv", newline="") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key) not in (None, "")]


def rows_of(out):
    return {r["row"]: r for r in read_json(out / "results.json")["rows"]}


def test_every_row_comes_from_its_runs_files(offpolicy_quick):
    _, out, done = offpolicy_quick
    rows = rows_of(out)
    assert list(rows) == ["untrained", "warm start", *LABELS.values()]
    sft = read_json(run_dir(out, "sft") / "eval_summary.json")
    assert rows["untrained"]["per_seed"]["0"]["success"] == sft["before"]["success"]
    assert rows["warm start"]["per_seed"]["0"]["success"] == sft["after"]["success"]
    q = offpolicy.QUICK
    for name, label in LABELS.items():
        got = rows[label]["per_seed"]["0"]
        summary = read_json(run_dir(out, f"{name}/seed0") / "eval_summary.json")
        assert got["success"] == summary["after"]["success"] and got["invalid"] == summary["after"]["invalid"]
        # the same rollout batches for every run: one update each on-policy, `updates` stale
        assert summary["updates"] == q["batches"] * (1 if name == offpolicy.REFERENCE else q["updates"])
        series = got["series"]
        assert [u["grad_norm"] for u in series] == column(out, f"{name}/seed0", "train/grad_norm")
        assert len(series) == summary["updates"]
        assert got["collapsed"] == (got["skipped"] > 0 or got["success"] < 0.5 * sft["after"]["success"])
        assert got["curve"][0]["success"] == sft["after"]["success"]  # it starts from the warm start
    md = (out / "results.md").read_text()
    assert "| row | seeds | success | success per seed | invalid / episode | updates |" in md
    assert "(one seed per row: no interval to compare)" in done.stdout


def test_each_run_has_its_objective_and_only_the_stale_ones_are_off_policy(offpolicy_quick):
    _, out, _ = offpolicy_quick
    levels = {"onpolicy": "turn", "token": "token", "turn": "turn", "sequence": "sequence", "turn_norm": "turn"}
    for name, level in levels.items():
        config = yaml.safe_load((run_dir(out, f"{name}/seed0") / "config.yaml").read_text())["model"]
        assert config["objective"]["level"] == level
        assert config["objective"]["clip_normalization"] == (name == "turn_norm")
        assert config["planner_mode"] == config["executor_mode"] == "generate"
        stale = column(out, f"{name}/seed0", "executor/staleness_max")
        assert (max(stale) > 0) == (name != offpolicy.REFERENCE)


def test_turns_are_several_tokens_so_the_levels_train_differently(offpolicy_quick):
    """With one token per turn (score mode) the token and turn ratios are the same and so
    are the runs, bit for bit; here they must part once an update is off-policy."""
    _, out, _ = offpolicy_quick
    token = column(out, "token/seed0", "train/grad_norm")
    turn = column(out, "turn/seed0", "train/grad_norm")
    sequence = column(out, "sequence/seed0", "train/grad_norm")
    assert token != turn and turn != sequence
    assert column(out, "token/seed0", "executor/ratio_max") != column(out, "turn/seed0", "executor/ratio_max")


def test_spikes_clip_fraction_and_ratio_range_match_a_float64_recount(offpolicy_quick):
    _, out, _ = offpolicy_quick
    rows = rows_of(out)
    level = offpolicy.SPIKE * float(np.median(np.float64(column(out, "onpolicy/seed0", "train/grad_norm"))))
    for name, label in LABELS.items():
        got = rows[label]["per_seed"]["0"]
        norms = np.float64(column(out, f"{name}/seed0", "train/grad_norm"))
        assert got["spikes"] == int((norms > level).sum())
        clip = [statistics.fmean([p, e]) for p, e in zip(column(out, f"{name}/seed0", "planner/clip_frac"),
                                                         column(out, f"{name}/seed0", "executor/clip_frac"))]
        assert got["clip_frac"] == pytest.approx(float(np.mean(np.float64(clip))), abs=1e-12)
        highs = column(out, f"{name}/seed0", "planner/ratio_max") + column(out, f"{name}/seed0", "executor/ratio_max")
        assert got["ratio_max"] == max(highs)
        assert rows[label]["clip_frac"][0] == got["clip_frac"]  # one seed: the mean is the seed's
    assert rows[LABELS["token"]]["ratio_max"][0] > 1.0  # stale ratios are not all 1
