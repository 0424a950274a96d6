"""``make repro-offpolicy``: does turn-level IS keep stale training stable where token-level
PPO does not, under the conditions the ST-PPO paper is about?

    python -m hieragent.repro.offpolicy [--quick] [--out DIR] [--seeds 0 1 2] [--only GLOB]

The setting (``configs/repro_offpolicy.yaml``) is the one that fits 2 CPU cores: the tiny
random Llama, planner and executor both in ``generate`` mode (every turn is several
tokens), bank on, on BabyAI GoToObjS4. Its LoRA also adapts the output head: without it a
32-wide random model cannot put its mass on the few tokens an action is written with (its
warm-start NLL stays near 5.3 nats a token). Jobs:

  * the bot's demonstrations, and a short supervised warm start on them, stopped early so
    that RL has room above it;
  * from the warm start, for each seed: an on-policy reference (one update per rollout
    batch, turn IS), and four stale runs, each batch used for ``updates`` optimizer steps
    and rolled out by the weights of ``lag`` training steps earlier, with the ratio at the
    token (PPO), turn (ST-PPO's Turn-PPO) or sequence (GSPO) level, or turn level plus
    clipping-triggered normalization. Every run sees the same rollout batches' count.

Each RL row reports its held-out success at the end (and per seed), its gradient-norm
spikes (updates whose pre-clip norm is above ``SPIKE`` times the median of the same seed's
on-policy run), the clip fraction, the range of the importance ratios, and whether the run
collapsed (final success below half the warm start's, or a skipped non-finite step).
``results.json`` keeps each run's per-update series for the plots of
``notebooks/results.ipynb``. ``--quick`` runs the same jobs at a toy size (``make test``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from functools import partial
from pathlib import Path
from typing import Any

from hieragent.bench import objective
from hieragent.io import atomic_write_text
from hieragent.repro.recipe import callbacks
from hieragent.repro.runner import Column, Job, Plan, Row, eval_after, eval_before, log_dir, logger_args, run_plan

CONFIG = "configs/repro_offpolicy.yaml"
LEVEL = "BabyAI-GoToObjS4-v0"
SPIKE = 5.0  # a spike: a pre-clip gradient norm above this many times the reference median
FULL = {"demos": 64, "sft_steps": 30, "lr_sft": 1e-2, "batches": 15, "updates": 4, "lag": 2, "val_every": 8, "eval": []}
QUICK = {"demos": 8, "sft_steps": 2, "lr_sft": 1e-2, "batches": 2, "updates": 2, "lag": 1, "val_every": 2,
         "eval": ["--data.eval_episodes", "4", "--data.eval_batch", "4"]}
REFERENCE = "onpolicy"


def variants(updates: int, lag: int) -> dict[str, tuple[str, list[str]]]:
    """Job name -> (row label, the run's flags): ``make bench-objective``'s runs and GSPO."""
    names = (REFERENCE, "token", "turn", "sequence", "turn_norm")
    return dict(zip(names, objective.variants(updates, lag, sequence=True), strict=True))


COLUMNS = (Column("success", "success"), Column("success", "success per seed", "seeds"),
           Column("invalid", "invalid / episode", digits=2), Column("updates", "updates", digits=0),
           Column("spikes", f"spikes >{SPIKE:g}x", digits=1), Column("clip_frac", "clip frac"),
           Column("ratio_max", "max ratio", digits=2),
           Column("collapsed", "collapsed", "count"))


def plan(out: Path, quick: bool = False, seeds: list[int] | None = None) -> Plan:
    s = QUICK if quick else FULL
    seeds = seeds if seeds is not None else ([0] if quick else [0, 1, 2])
    base = ["hieragent.cli", "fit", "--config", CONFIG, "--data.env", LEVEL, *s["eval"]]
    demos = out / "demos" / "demos.jsonl"
    jobs = [Job("demos", ["hieragent.rollout.demos", "--env", LEVEL, "--episodes", str(s["demos"]),
                          "--out", str(demos)], "demos.jsonl"),
            Job("sft", [*base, *logger_args(out / "sft"), "--data.demos", str(demos),
                        "--trainer.max_steps", str(s["sft_steps"]), "--model.lr_planner", str(s["lr_sft"]),
                        "--model.lr_executor", str(s["lr_sft"]), *callbacks()],
                "run/version_0/eval_summary.json", resume=True)]
    warm = log_dir(out / "sft") / "checkpoints" / "last.ckpt"
    rows = [Row(LEVEL, "untrained", {0: "sft"}, eval_before), Row(LEVEL, "warm start", {0: "sft"}, eval_after)]
    for name, (label, flags) in variants(s["updates"], s["lag"]).items():
        steps = s["batches"] * (1 if name == REFERENCE else s["updates"])
        runs = {}
        for seed in seeds:
            job = f"{name}/seed{seed}"
            every = min(s["val_every"] * (1 if name == REFERENCE else s["updates"]), steps)
            jobs.append(Job(job, [*base, *logger_args(out / job), *flags, "--model.init_from", str(warm),
                                  "--seed_everything", str(seed), "--data.train_seed", str(1000 * (seed + 1)),
                                  "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(every),
                                  "--trainer.check_val_every_n_epoch", "null",
                                  *callbacks({"class_path": "hieragent.lightning.callbacks.LearningCurve"},
                                             before=False)],
                            "run/version_0/eval_summary.json", resume=True))
            runs[seed] = job
        rows.append(Row(LEVEL, label, runs, partial(stability, start=out / "sft"),
                        note=f"{s['batches']} rollout batches, {steps} updates"))
    settings = {"quick": quick, "config": CONFIG, "level": LEVEL, "seeds": seeds, "spike": SPIKE, **s}
    return Plan("repro-offpolicy" + (" --quick" if quick else ""), jobs, rows, settings, COLUMNS)


def updates(folder: Path) -> list[dict[str, float]]:
    """One entry per optimizer update of a run (``metrics.csv``): the pre-clip gradient
    norm, the clip fraction over both roles' tokens and the range of their ratios."""
    points = []
    with open(log_dir(folder) / "metrics.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if not row.get("train/grad_norm"):
                continue
            value = lambda key: float(row[key]) if row.get(key) else None  # noqa: E731
            roles = [r for r in ("planner", "executor") if value(f"{r}/clip_frac") is not None]
            points.append({
                "step": int(float(row["step"])), "grad_norm": value("train/grad_norm"),
                "skipped": bool(value("train/skipped_step")),
                "clip_frac": statistics.fmean(value(f"{r}/clip_frac") for r in roles) if roles else 0.0,
                "ratio_max": max((value(f"{r}/ratio_max") for r in roles), default=1.0),
                "ratio_min": min((value(f"{r}/ratio_min") for r in roles), default=1.0)})
    return points


def spike_level(folder: Path) -> float | None:
    """``SPIKE`` times the median gradient norm of the same seed's on-policy run (``None``
    until that run is done)."""
    reference = folder.parent.parent / REFERENCE / folder.name
    if not (log_dir(reference) / "eval_summary.json").is_file():
        return None
    norms = [u["grad_norm"] for u in updates(reference) if math.isfinite(u["grad_norm"])]
    return SPIKE * statistics.median(norms) if norms else None


def stability(folder: Path, start: Path) -> dict[str, Any]:
    """One RL run's row entry: its end result and curve (``eval_after``), and how its
    updates went: spikes, clip fraction, ratio range, collapse, and the series."""
    result = eval_after(folder, start=start)
    series = updates(folder)
    level = spike_level(folder)
    finite = [u["grad_norm"] for u in series if math.isfinite(u["grad_norm"])]
    warm = eval_after(start)["success"]
    skipped = sum(u["skipped"] for u in series)
    after = json.loads((log_dir(folder) / "eval_summary.json").read_text(encoding="utf-8"))["after"]
    return {**result, "invalid": after.get("invalid"),
            "spikes": None if level is None else sum(g > level for g in finite),
            "clip_frac": statistics.fmean(u["clip_frac"] for u in series) if series else None,
            "ratio_max": max((u["ratio_max"] for u in series), default=None),
            "ratio_min": min((u["ratio_min"] for u in series), default=None),
            "skipped": skipped,
            "collapsed": skipped > 0 or result["success"] < 0.5 * warm,
            "series": series}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="make repro-offpolicy", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the same jobs at a toy size: a smoke run")
    p.add_argument("--out", type=Path, default=None, help="default: lightning_logs/repro_offpolicy[_quick]")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="RL seeds (default 0 1 2; quick: 0)")
    p.add_argument("--only", default=None, help="run only the jobs whose name matches this glob, e.g. 'token/*'")
    a = p.parse_args(argv)
    out = a.out or Path("lightning_logs") / ("repro_offpolicy_quick" if a.quick else "repro_offpolicy")
    try:
        results = run_plan(plan(out, a.quick, a.seeds), out, only=a.only)
    except (ValueError, RuntimeError) as err:
        raise SystemExit(f"repro-offpolicy: {err}") from None
    lines = verdicts(results)
    print("\n".join(lines))
    table = (out / "results.md").read_text(encoding="utf-8")
    atomic_write_text(out / "results.md", table + "\n" + "\n".join(lines) + "\n")


def verdicts(results: dict[str, Any]) -> list[str]:
    """Which RL rows' final success differ beyond the noise (disjoint mean ± std intervals
    over seeds), one line per pair of rows run with two or more seeds."""
    rl = {r["row"]: [v["success"] for v in r["per_seed"].values()] for r in results["rows"]
          if "series" in next(iter(r["per_seed"].values()), {})}
    if any(len(v) < 2 for v in rl.values()):
        return ["(one seed per row: no interval to compare)"]
    return objective.interval_verdicts(rl)


if __name__ == "__main__":
    main()
