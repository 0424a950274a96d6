"""The warm start + RL recipe as a reproduction plan, for any env family with an expert.

Rows, per level, all on the same held-out seeds (``data.eval_episodes`` of them, greedy):
  * **expert**: the family's expert (``hieragent.repro.expert``: success and length).
  * **untrained**: the model with fresh adapters (the warm-start runs' evaluation before
    training), flat (executor only, no bank) and hierarchical + bank.
  * **warm start**: supervised on the expert's demonstrations from the training seeds
    (GLIDER's stage 1), for each variant.
  * **warm start + RL**: RL from the matching warm start, one run per seed, each stopped at
    the same number of training env steps (``EnvStepBudget``), with a learning curve
    (held-out success at a few points on the way, ``LearningCurve``).

``quick`` runs the same jobs on the tiny random Llama with a handful of episodes: the path
is the same, the figures mean nothing (``make test`` runs it). A rerun skips finished jobs
and resumes an interrupted fit (``repro/runner.py``). ``make repro-babyai`` and
``make repro-games`` are this plan on their levels (``babyai.py``, ``games.py``).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from hieragent.repro.runner import Job, Plan, Row, eval_after, eval_before, log_dir, logger_args, run_plan

# the full run (SmolLM2-135M); sized for the budget, see the README's table notes
FULL = {"model": [], "demos": 256, "sft_steps": 30, "lr_sft": 5e-4, "env_steps": 1600,
        "val_every": 10, "eval": []}
# the same jobs on the tiny random Llama, a few episodes each: minutes, for make test
QUICK = {"model": ["--model.model", "tiny", "--model.lora.r", "4", "--model.lora.alpha", "8",
                   "--trainer.precision", "32-true", "--data.seeds_per_batch", "2",
                   "--data.group_size", "2", "--data.max_episode_steps", "8"],
         "demos": 8, "sft_steps": 2, "lr_sft": 1e-2, "env_steps": 40, "val_every": 2,
         "eval": ["--data.eval_episodes", "4", "--data.eval_batch", "4"]}
FLAT = ["--model.rollout.hierarchical", "false", "--model.memory.enabled", "false"]
VARIANTS = {"flat": ("flat (executor only)", FLAT), "hier": ("hierarchical + trained, evolving bank", [])}


def callbacks(*extra: dict[str, Any], before: bool = True) -> list[str]:
    """The job's whole callback list (it replaces the config's), as one CLI value."""
    items = [{"class_path": "hieragent.lightning.callbacks.BeforeAfterEval", "init_args": {"before": before}},
             {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
              "init_args": {"save_last": True, "every_n_train_steps": 1}},
             {"class_path": "hieragent.lightning.callbacks.UpdateProgressBar"},
             *extra]
    return ["--trainer.callbacks", json.dumps(items)]


def plan(title: str, config: str, levels: list[str], out: Path, quick: bool = False,
         seeds: list[int] | None = None, variants: tuple[str, ...] = ("flat", "hier"),
         expert: str = "expert") -> Plan:
    """The recipe's jobs and rows on ``levels`` with ``config``; ``expert`` names the expert row."""
    s = QUICK if quick else FULL
    seeds = seeds if seeds is not None else ([0] if quick else [0, 1, 2])
    jobs: list[Job] = []
    rows: list[Row] = []
    for level in levels:
        short = level.removeprefix("BabyAI-").removesuffix("-v0")
        base = ["hieragent.cli", "--config", config, "--data.env", level, *s["model"], *s["eval"]]
        episodes = eval_episodes(config, s["eval"])

        def fit(name: str, *args: str) -> list[str]:
            return [base[0], "fit", *base[1:], *logger_args(out / name), *args]

        jobs.append(Job(f"{short}/expert", ["hieragent.repro.expert", "--env", level, "--episodes", str(episodes),
                                            "--out", str(out / short / "expert" / "result.json")], "result.json"))
        level_rows = [Row(level, expert, {0: f"{short}/expert"}, _expert)]
        demos = out / short / "demos" / "demos.jsonl"
        jobs.append(Job(f"{short}/demos", ["hieragent.rollout.demos", "--env", level, "--episodes",
                                           str(s["demos"]), "--out", str(demos)], "demos.jsonl"))
        for variant in variants:
            label, extra = VARIANTS[variant]
            sft = f"{short}/sft_{variant}"
            lr = str(s["lr_sft"])
            jobs.append(Job(sft, fit(sft, *extra, "--data.demos", str(demos), "--trainer.max_steps",
                                     str(s["sft_steps"]), "--model.lr_planner", lr, "--model.lr_executor", lr,
                                     *callbacks()), "run/version_0/eval_summary.json", resume=True))
            warm = log_dir(out / sft) / "checkpoints" / "last.ckpt"
            runs = {}
            for seed in seeds:
                name = f"{short}/rl_{variant}/seed{seed}"
                budget = {"class_path": "hieragent.lightning.callbacks.EnvStepBudget",
                          "init_args": {"max_env_steps": s["env_steps"]}}
                curve = {"class_path": "hieragent.lightning.callbacks.LearningCurve"}
                jobs.append(Job(name, fit(name, *extra, "--model.init_from", str(warm), "--seed_everything",
                                          str(seed), "--data.train_seed", str(1000 * (seed + 1)),
                                          "--trainer.val_check_interval", str(s["val_every"]),
                                          "--trainer.check_val_every_n_epoch", "null",
                                          *callbacks(budget, curve, before=False)),
                                "run/version_0/eval_summary.json", resume=True))
                runs[seed] = name
            level_rows += [Row(level, f"untrained, {label}", {0: sft}, eval_before),
                           Row(level, f"warm start, {label}", {0: sft}, eval_after),
                           Row(level, f"warm start + RL, {label}", runs, partial(eval_after, start=out / sft),
                               note=f"{s['env_steps']} training env steps per seed")]
        rows += level_rows
    settings = {"quick": quick, "config": config, "seeds": seeds, **s}
    return Plan(title + (" --quick" if quick else ""), jobs, rows, settings)


def eval_episodes(config: str, args: list[str]) -> int:
    """``data.eval_episodes`` as the jobs will run it: the flag if given, else the config's."""
    for key, value in zip(args, args[1:]):
        if key == "--data.eval_episodes":
            return int(value)
    return int(yaml.safe_load(Path(config).read_text(encoding="utf-8"))["data"]["eval_episodes"])


def _expert(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "result.json").read_text(encoding="utf-8"))


def main(name: str, config: str, levels: list[str], argv: list[str] | None,
         variants: tuple[str, ...] = ("flat", "hier"), expert: str = "expert") -> None:
    """The command line of ``make <name>``: the plan on ``levels`` (or ``--levels``)."""
    p = argparse.ArgumentParser(prog=f"make {name}", description=f"{name}: the warm start + RL recipe.")
    p.add_argument("--quick", action="store_true", help="the tiny model, a few episodes: a smoke run")
    folder = name.replace("-", "_")
    p.add_argument("--out", type=Path, default=None, help=f"default: lightning_logs/{folder}[_quick]")
    p.add_argument("--levels", nargs="+", default=None, help=f"default: {' '.join(levels)}")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="RL seeds (default 0 1 2; quick: 0)")
    p.add_argument("--only", default=None, help="run only the jobs whose name matches this glob, "
                   "e.g. 'GoToLocal/*' or '*/sft_*'; the table shows what is done")
    a = p.parse_args(argv)
    out = a.out or Path("lightning_logs") / (f"{folder}_quick" if a.quick else folder)
    try:
        run_plan(plan(name, config, a.levels or levels, out, a.quick, a.seeds, variants, expert), out,
                 only=a.only)
    except (ValueError, RuntimeError) as err:  # a changed command, a failed job: one message
        raise SystemExit(f"{name}: {err}") from None
