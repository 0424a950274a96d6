"""Training steps around the release of a replaced index: freed in the step, on the loans of
the updates after it, by the release thread, or kept (``make bench-freeing``;
``memory/freeing.py``).

A full bank of ``--size`` clustered keys (IVF-Flat with ``auto_nlist`` lists and nprobe 2, what
``auto`` chose at 1M on the 2-core EPYC) is built and saved once by a child process, then loaded
here. Each round restores a second copy of its index from the saved state (``KeyIndex.restore``,
as a resumed run has it) and hands what a swap would replace (``KeyIndex.held``) over inside one
training step: a fixed CPU step on every core (``bank_upkeep.workload``) and one bank update. The
ways (``--ways``) alternate over ``--rounds`` rounds (forwards, then backwards), so that a shared
machine's drift falls on each: **in the step** drops the references there, as a swap did where
builds run on loans; **on loans** hands them to the bank's index (``KeyIndex.freeing``), whose
loans in the next updates free a slice at a time, as a swap does where builds run on loans;
**release thread** hands them to ``freeing.release``, as a swap does where builds run in a
thread; **none** keeps them until the round is over, the baseline: the bank's own updates have
slow ones too (its eviction pool's refill, a collection). Steps go on until everything is
freed, and at least ``AFTER`` of them. Printed per round: the median step before the hand-over,
the hand-over step, the longest step from it on (and which step it was, 0 the hand-over's) and
its ratio to that median, the time steps took beyond that median from the hand-over on, and how
long the freeing took (in steps); then each way's median ratio, and whether each freeing way's
rounds separate from those freeing in the step, and from those with no hand-over.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time

from hieragent.bench import at_least_one, bank_upkeep
from hieragent.bench.memory import cluster_source, machine_line
from hieragent.bench.noise import OVERLAP, separation
from hieragent.memory import freeing
from hieragent.memory.bank import MemoryBank, saved_index_state
from hieragent.memory.index import KeyIndex
from hieragent.memory.structures import IndexSpec, auto_nlist

WAYS = {"step": "in the step", "loans": "on loans", "thread": "release thread", "none": "none (kept)"}
BEFORE = 8  # steps before the hand-over: the median's
AFTER = 12  # steps after it, at least


def restored(bank: MemoryBank, state: dict) -> list:
    """A second copy of ``bank``'s index from its ``state_dict``: what a swap would replace."""
    index = KeyIndex.restore(int(state["dim"]), bank.index_spec, state["ids"].numpy(), state["keys"].numpy(),
                             saved_index_state(state))
    return index.held()


def one_round(way: str, bank: MemoryBank, state: dict, step, update) -> dict:
    """The steps around one hand-over, ``way`` one of ``WAYS``."""
    held = restored(bank, state)
    done = threading.Event()
    times: list[float] = []
    handed_at = freed_s = None
    freeing_steps = 0  # steps from the hand-over on until it was all freed (kept: none)
    while handed_at is None or len(times) < BEFORE + AFTER or freed_s is None:
        t0 = time.perf_counter()
        step()
        update(bank_upkeep.Update())
        if len(times) == BEFORE:  # the hand-over, at the end of this step
            handed_at = time.perf_counter()
            if way == "step":
                held.clear()
                freed_s = time.perf_counter() - handed_at
            elif way == "loans":
                bank._index.freeing.add(held)  # the next updates' ``lend_index`` frees it
            elif way == "thread":
                freeing.release(held)
                freeing.release([done])
            else:
                freed_s = math.nan  # dropped after the round
        t1 = time.perf_counter()
        times.append(1e3 * (t1 - t0))
        freeing_done = done.is_set() if way == "thread" else not bank._index.freeing
        if handed_at is not None and freed_s is None and freeing_done:
            freed_s = t1 - handed_at  # at most this
            freeing_steps = len(times) - BEFORE
    held.clear()
    median = statistics.median(times[:BEFORE])
    after = times[BEFORE:]
    return {"way": way, "median_ms": median, "handover_ms": after[0], "longest_ms": max(after),
            "longest_at": after.index(max(after)), "freeing_steps": freeing_steps,
            "ratio": max(after) / median, "excess_ms": sum(after) - median * len(after), "freed_s": freed_s,
            "steps": len(after)}


def summary(results: list[dict]) -> list[str]:
    """Each way's median ratio over its rounds, and whether each freeing way's range separates
    from freeing in the step's, and from no hand-over's."""
    by = {w: [r["ratio"] for r in results if r["way"] == w] for w in WAYS}
    lines = [f"{WAYS[w]}: longest step from the hand-over on, median {statistics.median(v):.2f}x the median step "
             f"over {len(v)} rounds ({min(v):.2f}-{max(v):.2f}x)" for w, v in by.items() if v]
    for a, b in (("loans", "step"), ("none", "loans"), ("thread", "step"), ("none", "thread")):
        if not by[a] or not by[b]:
            continue
        side = separation(by[a], by[b])
        if side:
            short, long = (a, b) if side < 0 else (b, a)
            lines.append(f"{WAYS[short]}: every round's longest step was shorter than every round's of {WAYS[long]}")
        else:
            lines.append(f"{WAYS[a]} and {WAYS[b]}: {OVERLAP}")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=1_000_000, help="bank entries (clustered keys)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each way")
    p.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS), help="the ways to compare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a 20,000-entry bank (IVF), one round each (for the test)")
    a = p.parse_args(argv)
    if a.quick:
        a.size, a.rounds = 20_000, 1
    at_least_one(p, a, "size", "rounds")

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(width=max(Console().width, 100))
    console.print(machine_line())
    spec = IndexSpec(kind="ivf_flat", nlist=auto_nlist(a.size), nprobe=2)
    draw = cluster_source(a.size, a.seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console) as progress:
        folder = os.path.join(tmp, "bank")
        task = progress.add_task(f"building a {a.size:,}-entry bank (ivf_flat, {spec.nlist} lists)", total=None)
        bank_upkeep.build_saved(draw(a.size), a.seed, spec, folder)
        bank = MemoryBank.load(folder)
        state = bank.state_dict()
        progress.update(task, total=1, completed=1)
        step = bank_upkeep.workload(20.0 if a.quick else bank_upkeep.STEP_MS)
        update = bank_upkeep.Updater(bank, draw, a.seed + 1)
        update(bank_upkeep.Update())  # warm-up
        task = progress.add_task("rounds", total=len(a.ways) * a.rounds)
        for r in range(a.rounds):
            for way in (a.ways if r % 2 == 0 else a.ways[::-1]):
                results.append({"round": r, **one_round(way, bank, state, step, update)})
                progress.advance(task)
    table = Table(title=f"training steps around the release of a {a.size:,}-key index and its rows (ms)")
    for col in ("round", "freed", "median step before", "hand-over step", "longest from it", "at step",
                "longest / median", "beyond the median", "steps", "freed after s (steps)"):
        table.add_column(col, justify="left" if col == "freed" else "right")
    for r in results:
        table.add_row(str(r["round"]), WAYS[r["way"]], f"{r['median_ms']:.0f}", f"{r['handover_ms']:.0f}",
                      f"{r['longest_ms']:.0f}", str(r["longest_at"]), f"{r['ratio']:.2f}x", f"{r['excess_ms']:.0f}",
                      str(r["steps"]),
                      "-" if math.isnan(r["freed_s"]) else f"{r['freed_s']:.2f} ({r['freeing_steps']})")
    console.print(table)
    for line in summary(results):
        console.print(line, soft_wrap=True)
    return results


if __name__ == "__main__":
    main()
