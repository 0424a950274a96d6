"""``make ablation-memory``: what does the skill bank add on the tiny task?

The RL sanity run (``configs/tiny_learn.yaml``: tiny random Llama, planner + executor,
BabyAI GoToObjS4, 15 updates) is repeated, for each of ``--seeds``, with:

  * no bank: ``model.memory.enabled: false`` (the planner prompt shows no skills);
  * a fixed bank: the seed skills of ``data/skills.jsonl``, plain top-k retrieval, nothing
    added (``model.memory.add_skills/add_lessons: false``, ``model.rollout.learn_retrieval: false``);
  * a trained, evolving bank (the config as is): retrieval sampled and its query adapter
    trained by the planner's advantage, skills added from successful episodes and lessons
    from failed ones, merged and evicted;
  * the same with the contrastive auxiliary loss on the query adapter
    (``model.memory.contrastive_coef: 0.5``).

The table gives held-out success before and after (64 episodes each; after as mean ± std
over the seeds), and the bank's size, lessons and add/merge counts at the end; below it,
which differences are inside the noise. Each run is a real ``hieragent fit`` subprocess.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hieragent.bench.objective import fmt_mean_std, interval_verdicts, read_metrics, run_all, summary

VARIANTS = [
    ("no bank", ["--model.memory.enabled", "false"]),
    ("fixed bank, top-k", ["--model.memory.add_skills", "false", "--model.memory.add_lessons", "false",
                           "--model.rollout.learn_retrieval", "false"]),
    ("trained + evolving bank", []),
    ("trained + evolving + contrastive", ["--model.memory.contrastive_coef", "0.5"]),
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batches", type=int, default=15, help="rollout batches (updates) per run")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    a = p.parse_args(argv)
    work = a.out or Path(tempfile.mkdtemp(prefix="hieragent-ablation-memory-"))
    results: dict[str, list[tuple[dict, dict]]] = {name: [] for name, _ in VARIANTS}
    specs = [(name, args, seed) for seed in a.seeds for name, args in VARIANTS]
    for (name, _, _), run_dir in zip(specs, run_all(specs, a.batches, 1, work, a.jobs, "ablation-memory")):
        results[name].append((summary(run_dir, float("inf")), read_metrics(run_dir)))
    table = Table(title=f"ablation-memory: tiny_learn, {a.batches} updates, seeds {a.seeds}")
    for col in ("bank", "success before", "success after (per seed)", "after, mean ± std",
                "bank size", "lessons", "entries added", "merged"):
        table.add_column(col, justify="left" if col == "bank" else "right")
    for name, rows in results.items():
        after = [s["after"] for s, _ in rows]
        size = [m.get("bank/size", [0.0])[-1] for _, m in rows]
        lessons = [m.get("bank/size_lesson", [0.0])[-1] for _, m in rows]
        added = [sum(m.get("bank/added", [])) for _, m in rows]
        merged = [sum(m.get("bank/merged", [])) for _, m in rows]
        table.add_row(name, " ".join(f"{s['before']:.3f}" for s, _ in rows),
                      " ".join(f"{x:.3f}" for x in after), fmt_mean_std(after),
                      " ".join(f"{x:.0f}" for x in size) if any(size) else "-",
                      " ".join(f"{x:.0f}" for x in lessons) if any(size) else "-",
                      " ".join(f"{x:.0f}" for x in added), " ".join(f"{x:.0f}" for x in merged))
    Console(width=max(Console().width, 140)).print(table)
    for line in interval_verdicts({name: [s["after"] for s, _ in rows] for name, rows in results.items()}):
        print(line)
    print(f"runs kept in {work}")


if __name__ == "__main__":
    main()
