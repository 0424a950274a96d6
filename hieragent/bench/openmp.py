"""The bank's update with torch and FAISS on two OpenMP runtimes and on one (``make bench-openmp``).

Which runtime FAISS's threads come from depends on the import order (``memory/openmp.py``).
A full bank of ``--size`` clustered keys (IVF-Flat with ``auto_nlist`` lists and nprobe 2,
what ``auto`` chose at 1M on the 2-core EPYC) is built and saved once by a child process.
Fresh processes then load it in turn, each importing the two libraries in one order: FAISS
first (two runtimes) or torch first (one, as hieragent's CLI and benches import them). The
orders alternate over ``--rounds`` rounds (ABBA), so that a shared machine's drift falls on
both. Each process runs one warm-up and ``--updates`` updates of ``bank_upkeep.Updater``
(retrieval for 128 planner turns, the evolution of 32 episodes, the metrics) and reports its
medians. Printed: each process's medians, the two orders' medians over their processes, their
ratio, and whether every process of one order was faster than every process of the other.
Nothing but the standard library is imported at the top, so that a child chooses the order.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

from hieragent.bench import at_least_one
from hieragent.bench.noise import OVERLAP, separation  # imports neither torch nor FAISS: the order stays the child's

ORDERS = {"faiss": "FAISS first", "torch": "torch first"}
RUNTIMES = {"faiss": "two runtimes", "torch": "one runtime"}
PARTS = ("retrieval_ms", "evolution_ms", "metrics_ms")


def child(order: str, folder: str, size: int, updates: int, seed: int) -> dict:
    """In a fresh process: import in ``order``, load the saved bank, time its updates."""
    for name in ("faiss", "torch") if order == "faiss" else ("torch", "faiss"):
        importlib.import_module(name)
    from hieragent.bench import bank_upkeep
    from hieragent.bench.memory import cluster_source
    from hieragent.memory.bank import MemoryBank
    from hieragent.memory.openmp import one_runtime

    timings = bank_upkeep.timed_updates(MemoryBank.load(folder), cluster_source(size, seed), seed + 1, updates)
    return {"order": order, "one_runtime": one_runtime(), "total_ms": statistics.median(timings.totals()),
            "max_ms": max(timings.totals()), **{p: statistics.median(getattr(timings, p)) for p in PARTS}}


def run_child(order: str, folder: str, size: int, updates: int, seed: int) -> dict:
    argv = [sys.executable, "-m", "hieragent.bench.openmp", "--child", order, folder,
            "--size", str(size), "--updates", str(updates), "--seed", str(seed)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench-openmp: the {ORDERS[order]} process failed (exit code {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(results: list[dict]) -> list[str]:
    """Each order's median over its processes, their ratio, and whether the orders separate."""
    by = {o: [r["total_ms"] for r in results if r["order"] == o] for o in ORDERS}
    two, one = statistics.median(by["faiss"]), statistics.median(by["torch"])
    lines = [f"{ORDERS[o]} ({RUNTIMES[o]}): median {statistics.median(v):.1f} ms over {len(v)} processes "
             f"({min(v):.1f}-{max(v):.1f})" for o, v in by.items()]
    lines.append(f"two runtimes / one: {two / one:.2f}x")
    side = separation(by["torch"], by["faiss"])
    if side < 0:
        lines.append("every process with one runtime was faster than every process with two")
    elif side > 0:
        lines.append("every process with two runtimes was faster than every process with one")
    else:
        lines.append(f"the two orders: {OVERLAP}")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=1_000_000, help="bank entries (clustered keys)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one process per order")
    p.add_argument("--updates", type=int, default=60, help="timed updates per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a 2,000-entry bank, one round of 3 updates (for the test)")
    p.add_argument("--child", nargs=2, metavar=("ORDER", "FOLDER"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.size, a.updates, a.seed)))
        return []
    if a.quick:
        a.size, a.rounds, a.updates = 2000, 1, 3
    at_least_one(p, a, "size", "rounds", "updates")

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from hieragent.bench import bank_upkeep
    from hieragent.bench.memory import cluster_source, machine_line
    from hieragent.memory.structures import IndexSpec, auto_nlist

    console = Console(width=max(Console().width, 100))  # the table on one line per process, piped or not
    console.print(machine_line())
    spec = IndexSpec(kind="ivf_flat", nlist=auto_nlist(a.size), nprobe=2)
    results = []
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console) as progress:
        folder = os.path.join(tmp, "bank")
        task = progress.add_task(f"building a {a.size:,}-entry bank (ivf_flat, {spec.nlist} lists)", total=None)
        bank_upkeep.build_saved(cluster_source(a.size, a.seed)(a.size), a.seed, spec, folder)
        progress.update(task, total=1, completed=1)
        task = progress.add_task("one process per order and round", total=2 * a.rounds)
        for r in range(a.rounds):
            for order in (list(ORDERS) if r % 2 == 0 else list(ORDERS)[::-1]):
                results.append({"round": r, **run_child(order, folder, a.size, a.updates, a.seed)})
                progress.advance(task)
    table = Table(title=f"bank update, {a.size:,} entries, median of {a.updates} (ms)")
    for col in ("round", "imports", "runtimes", "total", "retrieval", "evolution", "metrics", "max"):
        table.add_column(col, justify="right" if col not in ("imports", "runtimes") else "left")
    for r in results:
        table.add_row(str(r["round"]), ORDERS[r["order"]], "one" if r["one_runtime"] else "two",
                      *(f"{r[k]:.1f}" for k in ("total_ms", *PARTS, "max_ms")))
    console.print(table)
    for line in summary(results):
        console.print(line)
    return results


if __name__ == "__main__":
    main()
