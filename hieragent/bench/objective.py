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

Every run sees the same number of rollout batches, for each of ``--seeds``. The table gives
held-out success before and after as mean ± std over the seeds (and per seed),
gradient-norm spikes per seed (updates whose pre-clip norm exceeds ``--spike`` times the
median of the same seed's on-policy reference, measured in this same invocation), the clip
fraction, how often the normalization triggered, skipped (non-finite) steps, and how many
seeds collapsed (final success below the starting one). Below it, one line per pair of
runs says whether their mean ± std intervals separate or the difference is inside the
noise. Each run is a real ``hieragent fit`` in a subprocess; figures depend on the machine
only through timing.
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
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hieragent.repro.runner import mean_std

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_learn.yaml"


def variants(updates: int, lag: int, sequence: bool = False) -> list[tuple[str, list[str]]]:
    """(label, flags) of each run: the on-policy reference, then the stale objectives; with
    ``sequence`` also GSPO's sequence-level ratio (``make repro-offpolicy`` runs it)."""
    stale = ["--model.replay.updates_per_batch", str(updates), "--model.replay.rollout_lag", str(lag),
             "--model.replay.max_staleness", str(updates * lag)]
    gspo = [("stale, sequence (GSPO)", [*stale, "--model.objective.level", "sequence"])] if sequence else []
    return [
        ("on-policy, turn IS (reference)", ["--model.objective.level", "turn"]),
        ("stale, token PPO", [*stale, "--model.objective.level", "token"]),
        ("stale, turn IS", [*stale, "--model.objective.level", "turn"]),
        *gspo,
        ("stale, turn IS + clip norm.", [*stale, "--model.objective.level", "turn",
                                          "--model.objective.clip_normalization", "true"]),
    ]


def run(index: int, name: str, args: list[str], batches: int, updates: int, work: Path,
        seed: int, threads: int | None = None) -> Path:
    """One ``hieragent fit`` subprocess in ``work/run<index>``; returns its log folder."""
    steps = batches * (updates if "--model.replay.updates_per_batch" in args else 1)
    out = work / f"run{index}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hieragent.cli", "fit", "--config", str(CONFIG),
           "--seed_everything", str(seed), "--trainer.max_steps", str(steps), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run '{name}' failed:\n{proc.stderr[-3000:]}")
    return sorted(out.glob("lightning_logs/tiny_learn/version_*"))[-1]


def run_all(specs: list[tuple[str, list[str], int]], batches: int, updates: int, work: Path, jobs: int,
            label: str) -> list[Path]:
    """Every ``(name, args, seed)`` as a ``run``, ``jobs`` at a time, each on cores / jobs
    threads (the tiny model gains little from more), with a progress bar; in spec order."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with Progress() as progress, ThreadPoolExecutor(max_workers=jobs) as pool:
        task = progress.add_task(label, total=len(specs))
        futures = [pool.submit(run, i, name, args, batches, updates, work, seed, threads)
                   for i, (name, args, seed) in enumerate(specs)]
        for f in as_completed(futures):
            f.result()
            progress.advance(task)
        return [f.result() for f in futures]


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


def fmt_mean_std(values: list[float], digits: int = 3) -> str:
    m, sd = mean_std(values)
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def separated(a: list[float], b: list[float]) -> bool:
    """Whether the mean ± std intervals of two samples are disjoint."""
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    return ma - sa > mb + sb or mb - sb > ma + sa


def interval_verdicts(after: dict[str, list[float]]) -> list[str]:
    """One line per pair of variants: which is higher, or that the difference is inside the noise."""
    names, lines = list(after), []
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            if separated(after[x], after[y]):
                hi, lo = (x, y) if statistics.fmean(after[x]) > statistics.fmean(after[y]) else (y, x)
                lines.append(f"'{hi}' > '{lo}': the mean ± std intervals are disjoint")
            else:
                lines.append(f"'{x}' vs '{y}': inside the noise (the mean ± std intervals overlap)")
    return lines


def main(argv: list[str] | None = None) -> list[tuple[str, list[dict[str, float]]]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=15, help="rollout batches per run")
    p.add_argument("--updates", type=int, default=4, help="optimizer steps per batch (stale runs)")
    p.add_argument("--lag", type=int, default=2, help="rollout weights this many training steps old")
    p.add_argument("--spike", type=float, default=5.0, help="spike = grad norm above this x reference median")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    p.add_argument("--only", nargs="+", default=None, metavar="LABEL",
                   help="run only the stale rows whose label contains one of these (the on-policy "
                        "reference always runs: spikes are measured against it)")
    a = p.parse_args(argv)
    work = a.out or Path(tempfile.mkdtemp(prefix="hieragent-bench-objective-"))
    rows = variants(a.updates, a.lag)
    rows = [rows[0], *(r for r in rows[1:] if a.only is None or any(o in r[0] for o in a.only))]
    if len(rows) == 1 and a.only:
        p.error(f"--only {a.only} matches no row; the rows are: {', '.join(name for name, _ in variants(1, 1))}")
    names = [name for name, _ in rows]
    specs = [(name, args, seed) for seed in a.seeds for name, args in rows]
    dirs: dict[str, list[Path]] = {name: [] for name in names}
    for (name, _, _), run_dir in zip(specs, run_all(specs, a.batches, a.updates, work, a.jobs, "bench-objective")):
        dirs[name].append(run_dir)
    # the spike level comes from the on-policy reference of the same seed, in this invocation
    levels = [a.spike * summary(d, math.inf)["grad_median"] for d in dirs[names[0]]]
    results = [(name, [summary(d, level) for d, level in zip(dirs[name], levels)]) for name in names]
    table = Table(title=f"bench-objective: tiny_learn, seeds {a.seeds}, {a.batches} rollout batches; "
                        f"stale = {a.updates} updates/batch, rollout lag {a.lag}; mean ± std over seeds")
    for col in ("run", "updates", "success before", "success after", "after per seed", f"spikes >{a.spike:g}x",
                "clip frac", "norm. triggered", "skipped", "collapsed"):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=col == "run")
    for name, rows in results:
        collapsed = sum(s["after"] < s["before"] or s["skipped"] > 0 for s in rows)
        triggered = [s["norm_triggered"] for s in rows if not math.isnan(s["norm_triggered"])]
        table.add_row(name, str(rows[0]["updates"]), fmt_mean_std([s["before"] for s in rows]),
                      fmt_mean_std([s["after"] for s in rows]), " ".join(f"{s['after']:.3f}" for s in rows),
                      " ".join(str(s["spikes"]) for s in rows), fmt_mean_std([s["clip_frac"] for s in rows]),
                      fmt_mean_std(triggered, 2) if triggered else "-",
                      f"{sum(s['skipped'] for s in rows):.0f}", f"{collapsed}/{len(rows)}")
    Console(width=max(Console().width, 180)).print(table)
    for line in interval_verdicts({name: [s["after"] for s in rows] for name, rows in results}):
        print(line)
    print(f"runs kept in {work}")
    return results


if __name__ == "__main__":
    main()
