"""``make bench-objective``: which objective survives stale, off-policy data?

The same seeded training on the tiny setting (``configs/tiny_learn.yaml``: tiny random
Llama, planner + executor + bank, BabyAI GoToObjS4) is run as:

  * an on-policy reference: one update per batch, rollouts with the current weights;
  * three stale off-policy runs, each batch used for ``--updates`` optimizer steps and
    rolled out by the weights of ``--lag`` training steps earlier (an asynchronous actor),
    with the objective as
      - token-level PPO ratios,
      - turn-level IS (ST-PPO's Turn-PPO),
      - turn-level IS plus clipping-triggered normalization (ST-PPO).

Every run sees the same number of rollout batches. The table gives held-out success
before and after, gradient-norm spikes (updates whose pre-clip norm exceeds ``--spike``
times the median of the on-policy reference, measured in this same invocation), the mean
clip fraction, how often the normalization triggered, skipped (non-finite) steps, and
whether the run collapsed (final success below its starting success). Each run is a real
``hieragent fit`` in a subprocess; figures depend on the machine only through timing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_learn.yaml"


def variants(updates: int, lag: int) -> list[tuple[str, list[str]]]:
    stale = ["--model.replay.updates_per_batch", str(updates), "--model.replay.rollout_lag", str(lag),
             "--model.replay.max_staleness", str(updates * lag)]
    return [
        ("on-policy, turn IS (reference)", ["--model.objective.level", "turn"]),
        ("stale, token PPO", [*stale, "--model.objective.level", "token"]),
        ("stale, turn IS", [*stale, "--model.objective.level", "turn"]),
        ("stale, turn IS + clip norm.", [*stale, "--model.objective.level", "turn",
                                          "--model.objective.clip_normalization", "true"]),
    ]


def run(index: int, name: str, args: list[str], batches: int, updates: int, work: Path,
        seed: int) -> Path:
    steps = batches * (updates if "--model.replay.updates_per_batch" in args else 1)
    out = work / f"run{index}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hieragent.cli", "fit", "--config", str(CONFIG),
           "--seed_everything", str(seed), "--trainer.max_steps", str(steps), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run '{name}' failed:\n{proc.stderr[-3000:]}")
    return sorted(out.glob("lightning_logs/tiny_learn/version_*"))[-1]


def read_metrics(run_dir: Path) -> dict[str, list[float]]:
    columns: dict[str, list[float]] = {}
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None):
                    columns.setdefault(key, []).append(float(value))
    return columns


def summary(run_dir: Path, spike_level: float) -> dict[str, float]:
    m = read_metrics(run_dir)
    evals = json.loads((run_dir / "eval_summary.json").read_text())
    grad = [g for g in m.get("train/grad_norm", []) if math.isfinite(g)]
    clip = m.get("executor/clip_frac", []) + m.get("planner/clip_frac", [])
    triggered = m.get("executor/clip_norm_triggered", []) + m.get("planner/clip_norm_triggered", [])
    return {
        "before": evals["before"]["success"], "after": evals["after"]["success"],
        "updates": evals["updates"], "spikes": sum(g > spike_level for g in grad),
        "grad_median": statistics.median(grad) if grad else math.nan,
        "clip_frac": statistics.fmean(clip) if clip else 0.0,
        "norm_triggered": statistics.fmean(triggered) if triggered else math.nan,
        "skipped": sum(m.get("train/skipped_step", [])),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=15, help="rollout batches per run")
    p.add_argument("--updates", type=int, default=4, help="optimizer steps per batch (stale runs)")
    p.add_argument("--lag", type=int, default=2, help="rollout weights this many training steps old")
    p.add_argument("--spike", type=float, default=5.0, help="spike = grad norm above this x reference median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    a = p.parse_args(argv)
    work = a.out or Path(tempfile.mkdtemp(prefix="hieragent-bench-objective-"))
    rows = []
    with Progress() as progress:
        task = progress.add_task("bench-objective", total=4)
        runs = []
        for i, (name, args) in enumerate(variants(a.updates, a.lag)):
            runs.append((name, run(i, name, args, a.batches, a.updates, work, a.seed)))
            progress.advance(task)
    reference = summary(runs[0][1], math.inf)
    level = a.spike * reference["grad_median"]
    for name, run_dir in runs:
        rows.append((name, summary(run_dir, level)))
    table = Table(title=f"bench-objective: tiny_learn, seed {a.seed}, {a.batches} rollout batches; "
                        f"stale = {a.updates} updates/batch, rollout lag {a.lag}")
    for col in ("run", "updates", "success before", "success after", f"spikes >{a.spike:g}x",
                "grad median / ref", "clip frac", "norm. triggered", "skipped", "collapsed"):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=col == "run")
    for name, s in rows:
        collapsed = s["after"] < s["before"] or s["skipped"] > 0
        table.add_row(name, str(s["updates"]), f"{s['before']:.3f}", f"{s['after']:.3f}", str(s["spikes"]),
                      f"{s['grad_median'] / reference['grad_median']:.2f}", f"{s['clip_frac']:.3f}",
                      "-" if math.isnan(s["norm_triggered"]) else f"{s['norm_triggered']:.2f}",
                      f"{s['skipped']:.0f}", "yes" if collapsed else "no")
    Console(width=max(Console().width, 160)).print(table)
    print(f"runs kept in {work}")


if __name__ == "__main__":
    main()
