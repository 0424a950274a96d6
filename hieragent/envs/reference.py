"""The experts' success per level: the reference row of every results table.

    python -m hieragent.envs.reference --seeds 20          (make expert-table)

Each family's expert plays held-out seeds (``EVAL_SEED_OFFSET`` on, as evaluation does):
minigrid's BabyAI bot, TextWorld's walkthrough, shortest-path search for FrozenLake
and Sokoban, ScienceWorld's gold action sequences (on the first test variations), and
search or constraint solvers for TextArena's puzzles. Crafter has no expert: its row is a
scripted baseline (``hieragent.envs.crafter_scripted``), whose success is the env's default
``success_achievement`` (a wood pickaxe) within 500 steps. Prints success rate and mean
length per level, and which reference played it.
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hieragent.envs.base import EVAL_SEED_OFFSET, family, load

LEVELS = [
    "BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0", "BabyAI-OpenDoor-v0", "BabyAI-UnlockLocal-v0",
    "BabyAI-PutNextLocal-v0", "BabyAI-GoTo-v0", "TextWorld-Easy-v0", "TextWorld-Medium-v0",
    "FrozenLake-4x4-v0", "FrozenLake-8x8-v0", "Sokoban-6x6-1box-v0", "Sokoban-7x7-2box-v0",
    "ScienceWorld-find-plant-v0", "ScienceWorld-boil-v0", "ScienceWorld-test-conductivity-v0",
    "ScienceWorld-chemistry-mix-paint-secondary-color-v0", "Crafter-v0",
    "TextArena-TowerOfHanoi-v0", "TextArena-TowerOfHanoi-v0-medium", "TextArena-FifteenPuzzle-v0",
    "TextArena-Sudoku-v0-very-easy", "TextArena-Sudoku-v0",
]


def expert_episode(level: str, seed: int) -> tuple[bool, int]:
    """``(success, length)`` of the level's expert on ``seed``."""
    return load(f"{family(level).expert}:expert_episode")(level, seed)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Success rate of each level's expert.")
    p.add_argument("--seeds", type=int, default=20, help="held-out seeds per level")
    p.add_argument("--levels", nargs="*", default=LEVELS)
    a = p.parse_args(argv)
    rows = []
    with Progress() as progress:
        task = progress.add_task("experts", total=len(a.levels) * a.seeds)
        for level in a.levels:
            outcomes = []
            for seed in range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + a.seeds):
                outcomes.append(expert_episode(level, seed))
                progress.advance(task)
            wins = [n for ok, n in outcomes if ok]
            rows.append((level, family(level).source, sum(ok for ok, _ in outcomes) / len(outcomes),
                         statistics.fmean(wins) if wins else float("nan")))
    table = Table(title=f"expert success, {a.seeds} held-out seeds per level")
    for col in ("level", "reference", "success rate", "mean length (successes)"):
        table.add_column(col, justify="left" if col in ("level", "reference") else "right")
    for level, source, rate, length in rows:
        table.add_row(level, source, f"{rate:.2f}", f"{length:.1f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
