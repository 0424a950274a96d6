"""Evictions from a full bank's entry table: the pool refilled by scans ahead of need (the
default, ``memory/entries.py``) against one full pass whenever it runs dry (as before
2026-12-08), in one run.

    make bench-evictions [BENCH_ARGS='--size 1000000 --updates 400 --rounds 2']

Each update credits 128 random entries with a return, adds 64 new ones and evicts the 64 first
in eviction order (``EntryTable.lowest``), as a full bank's update does. The two ways alternate
over ``--rounds`` rounds (ABBA), each on a fresh table of ``--size`` entries (a fifth of them
used) whose pool, of ``entries.POOL`` both ways, is filled first, as a loaded bank's is.
Printed: per way and round, the median update, its 99th percentile and longest, how many took
over 20 ms, and the full passes over the table (the first fill's included); whether every round
of one way had a shorter longest update than every round of the other.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from hieragent.bench import at_least_one
from hieragent.bench.noise import OVERLAP, separation
from hieragent.memory.entries import EntryTable

CREDITS, ADDS = 128, 64  # per update: a batch of planner turns' retrievals, the episodes' new entries
WAYS = {"scan": "scans ahead", "pass": "a full pass when dry"}
SLOW_MS = 20.0


class FullPass(EntryTable):
    """The table as it was: no scan ahead, so a pool run dry refills in one O(N) pass."""

    def _advance(self, count: int) -> None:
        pass


def table(way: str, size: int, seed: int) -> tuple[EntryTable, np.random.Generator]:
    """A full table of ``size`` entries, a fifth credited, its pool filled."""
    rng = np.random.default_rng(seed)
    t = (EntryTable if way == "scan" else FullPass)()
    for i in range(size):
        t.add(i, "skill", "", "", i // 1000)
    for _ in range(size // (5 * CREDITS)):
        t.credit(rng.integers(0, size, CREDITS).tolist(), float(rng.integers(-2, 3)) / 2)
    t.fill_pool()
    return t, rng


def run(way: str, size: int, updates: int, seed: int, tick: Callable[[], None] = lambda: None) -> dict:
    """Time ``updates`` updates of a fresh table (``tick`` after each, the progress bar's):
    their median, 99th percentile and longest in ms, the count over ``SLOW_MS``, the full passes."""
    t, rng = table(way, size, seed)
    next_id, times = size, []
    for u in range(updates):
        t0 = time.perf_counter()
        t.credit(rng.integers(0, next_id, CREDITS).tolist(), float(rng.integers(-2, 3)) / 2)
        for _ in range(ADDS):
            t.add(next_id, "episodic", "", "", size // 1000 + u)
            next_id += 1
        for i in t.lowest(ADDS):
            t.remove(i)
        times.append(1e3 * (time.perf_counter() - t0))
        tick()
    times.sort()
    return {"way": way, "median_ms": statistics.median(times), "p99_ms": times[int(0.99 * (len(times) - 1))],
            "longest_ms": times[-1], "slow": sum(x > SLOW_MS for x in times), "passes": t.passes}


def verdict(results: list[dict]) -> str:
    longest = {w: [r["longest_ms"] for r in results if r["way"] == w] for w in WAYS}
    side = separation(longest["scan"], longest["pass"])
    if side == 0:
        return f"longest update: {OVERLAP}"
    short, long = ("scan", "pass") if side < 0 else ("pass", "scan")
    ratio = statistics.median(longest[long]) / statistics.median(longest[short])
    return (f"longest update: every round of {WAYS[short]} shorter than every round of {WAYS[long]} "
            f"(medians {ratio:.1f}x apart)")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=1_000_000, help="entries in the full table")
    p.add_argument("--updates", type=int, default=400, help="timed updates per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each way (ABBA order)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20,000 entries, 300 updates, one round (for the test)")
    a = p.parse_args(argv)
    if a.quick:
        a.size, a.updates, a.rounds = 20_000, 300, 1
    at_least_one(p, a, "size", "updates", "rounds")

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from hieragent.bench.memory import machine_line

    console = Console(width=max(Console().width, 100))
    console.print(machine_line())
    order = [w for r in range(a.rounds) for w in (("scan", "pass") if r % 2 == 0 else ("pass", "scan"))]
    results = []
    with Progress(console=console) as progress:
        task = progress.add_task("evictions", total=len(order) * a.updates)
        for k, way in enumerate(order):
            progress.update(task, description=f"{WAYS[way]}, round {k // 2 + 1}")
            results.append(run(way, a.size, a.updates, a.seed + k // 2, lambda: progress.advance(task)))
    out = Table(title=f"evictions from a full table of {a.size:,} entries ({CREDITS} credits, {ADDS} adds and "
                      f"{ADDS} evictions an update, {a.updates} updates a round)")
    for col in ("refill", "median ms", "p99 ms", "longest ms", f"> {SLOW_MS:.0f} ms", "full passes"):
        out.add_column(col, justify="left" if col == "refill" else "right")
    for r in results:
        out.add_row(WAYS[r["way"]], f"{r['median_ms']:.2f}", f"{r['p99_ms']:.1f}", f"{r['longest_ms']:.1f}",
                    str(r["slow"]), str(r["passes"]))
    console.print(out)
    console.print(verdict(results))
    return results


if __name__ == "__main__":
    main()
