"""The bank's cost per training update at 10k, 100k and 1M entries, and the step stall when
its index retrains (part of ``make bench-memory``).

**Per-update cost.** A full bank of clustered keys under the default index, built and saved
by a child process and loaded here with its index, as a resumed run has it (``saved_bank``),
then ``UPDATES`` updates, each what the trainer does around one rollout batch: the planner
turns' retrieval (``sample_retrievals`` for ``TURNS`` query vectors, ``retrieval_candidates``
8, ``retrieval_k`` 2, with a query adapter), the evolution (credit the entries used by
``EPISODES`` episodes, add a skill or lesson per episode, with merges and evictions, the bank
being full) and the metrics (``bank.stats()``). Query and entry vectors are given, drawn
before each update's clock starts, so the encoder (MiniLM, about 4 ms a text here, the same
at any bank size) is not in these figures.

**Stall.** A bank of ``n`` entries whose index is about to retrain (or, for a graph index,
to compact), and a loop of training steps: each a fixed CPU workload (a torch matmul loop of
about ``STEP_MS`` on every core, as a CPU training step is) and one bank update as above.
Three ways to rebuild (``MODES``): ``inline``, inside ``add`` (``background_from`` above the
bank size: the old behaviour); ``thread``, in a background thread at ``build_nice`` while the
old index serves (``build_loan`` 0); ``lent``, in a stopped child process that runs only on the
update's loans (``build_loan``, the default). Reported: the median and the longest step, the
swap step, and how long the rebuild took. Each step is also split into its parts: the fixed
workload, the retrieval, the evolution, the loan to the build (``lend_index``), the metrics,
each net of Python's garbage collection, which is its own part (``gc.callbacks``). A step
above twice the median is put down to the part that exceeded its own median the most (the
parts' medians over the steps with no rebuild), so that the verdict says whether the bank
made a step long or the fixed workload itself ran slow (a busy shared machine). As a trainer
does (``callbacks.FrozenHeap``), the loop freezes what is alive before its first step
(``hieragent/heap.py``), unless ``freeze`` is off: runs before 2026-12-07 (later) did not.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from rich.table import Table

from hieragent import heap
from hieragent.memory.adapter import QueryAdapter
from hieragent.memory.bank import FORMAT_VERSION, MemoryBank
from hieragent.memory.structures import IndexSpec, trains
from hieragent.memory.retrieval import sample_retrievals

TURNS = 128  # planner turns per rollout batch (32 episodes of about 4 planner turns)
EPISODES = 32
UPDATES = 20
STEP_MS = 150.0
BASELINE = 20  # steps before the retrain starts, and after it is swapped in (the median's steps)
PARTS = ("work", "retrieval", "evolution", "loan", "metrics", "gc")
MODES = {"inline": "inline (in add)", "thread": "thread", "lent": "lent (process on loans)"}


def bank_state(keys: np.ndarray, seed: int) -> dict:
    """A saved bank of ``len(keys)`` entries with varied utilities, uses and steps."""
    rng = np.random.default_rng(seed)
    n = len(keys)
    uses = rng.integers(0, 4, n)
    return {"format_version": FORMAT_VERSION, "embedder": "minilm", "dim": keys.shape[1], "capacity": n,
            "merge_threshold": 0.95, "next_id": n, "ids": torch.arange(n), "keys": torch.from_numpy(keys),
            "kinds": ["skill"] * n, "texts": [f"entry {i}" for i in range(n)], "sources": ["bench"] * n,
            "created_steps": rng.integers(0, 1000, n).tolist(), "uses": uses.tolist(),
            "utilities": np.where(uses > 0, rng.random(n), 0.0).tolist(), "merges": [0] * n,
            "events": {}, "index": {}, "index_state": {}}


class GcPauses:
    """Milliseconds this process has spent in Python's garbage collector while installed
    (``gc.callbacks``), so that a timed span can be split into GC and the rest."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += 1e3 * (time.perf_counter() - self._t0)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


NO_GC = GcPauses()  # never installed: reads 0 ms


@dataclass
class Update:
    """Milliseconds per update, by part; with a ``GcPauses`` the parts are net of GC, which is
    then a part of its own."""
    retrieval_ms: list[float] = field(default_factory=list)
    evolution_ms: list[float] = field(default_factory=list)
    loan_ms: list[float] = field(default_factory=list)  # the rebuild's loan (``lend_index``)
    metrics_ms: list[float] = field(default_factory=list)
    gc_ms: list[float] = field(default_factory=list)

    def totals(self) -> list[float]:
        return [sum(parts) for parts in zip(self.retrieval_ms, self.evolution_ms, self.loan_ms, self.metrics_ms,
                                            self.gc_ms)]


class Updater:
    """One trainer update's worth of bank work, on fresh vectors near the bank's keys."""

    def __init__(self, bank: MemoryBank, draw: Callable[[int], np.ndarray], seed: int,
                 pauses: GcPauses = NO_GC) -> None:
        self.bank, self.draw, self.pauses = bank, draw, pauses
        self.adapter = QueryAdapter(bank.dim)
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.step = 0

    def __call__(self, out: Update) -> None:
        self.step += 1
        queries, keys = self.draw(TURNS), self.draw(EPISODES)  # the encoder's part: not the bank's cost
        marks = [(time.perf_counter(), self.pauses.ms)]
        got = sample_retrievals(self.bank, self.adapter, queries, n=8, k=2, temperature=1.0, generator=self.gen)
        marks.append((time.perf_counter(), self.pauses.ms))
        per_episode = TURNS // EPISODES
        for e in range(EPISODES):
            used = [r.entry_ids[c] for _, r in got[e * per_episode:(e + 1) * per_episode] if r for c in r.chosen]
            self.bank.record_use(used, float(self.rng.random()))
        half = EPISODES // 2
        self.bank.add([f"skill {self.step}.{j}" for j in range(half)], kind="skill", step=self.step, keys=keys[:half])
        self.bank.add([f"lesson {self.step}.{j}" for j in range(half)], kind="lesson", step=self.step,
                      keys=keys[half:])
        self.bank.drain_changes()
        marks.append((time.perf_counter(), self.pauses.ms))
        self.bank.lend_index()
        marks.append((time.perf_counter(), self.pauses.ms))
        self.bank.stats()
        marks.append((time.perf_counter(), self.pauses.ms))
        spans = [(1e3 * (t1 - t0), g1 - g0) for (t0, g0), (t1, g1) in zip(marks, marks[1:])]
        for parts, (ms, gc_ms) in zip((out.retrieval_ms, out.evolution_ms, out.loan_ms, out.metrics_ms), spans):
            parts.append(ms - gc_ms)
        out.gc_ms.append(sum(gc_ms for _, gc_ms in spans))


def _build_and_save(keys_file: str, seed: int, spec: IndexSpec, folder: str) -> None:
    """In a child process: a bank over the saved keys, its index built (``auto`` measures
    here), saved into ``folder``."""
    keys = np.load(keys_file)
    bank = MemoryBank(capacity=len(keys), index=spec)
    bank.load_state_dict(bank_state(keys, seed))
    bank._index.wait()
    bank.save(folder)


def saved_bank(keys: np.ndarray, seed: int, spec: IndexSpec) -> MemoryBank:
    """A full bank over ``keys`` as a resumed run has it: built and saved by a child process,
    loaded here with its index. With the default ``build_loan``, a training run does not build
    a large index in its own process (a build runs in a lent process, or the index came with
    the checkpoint; ``build_loan`` 0 builds in a thread of it). A loaded IVF index's lists are
    given room to grow at load (``rebuild.give_room``, which says what their lack of it cost).
    Runs of this bench before 2026-12-07 imported FAISS before torch, so their updates ran on
    two OpenMP runtimes, slower than training's one (``memory/openmp.py``)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "bank")
        build_saved(keys, seed, spec, folder)
        return MemoryBank.load(folder)


def build_saved(keys: np.ndarray, seed: int, spec: IndexSpec, folder: str) -> None:
    """A full bank over ``keys`` with its index, built by a child process and saved into ``folder``."""
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = os.path.join(tmp, "keys.npy")
        np.save(keys_file, keys)
        child = multiprocessing.get_context("spawn").Process(target=_build_and_save,
                                                            args=(keys_file, seed, spec, folder))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"bench-memory: the process building the {len(keys):,}-entry bank failed "
                               f"(exit code {child.exitcode}; its error is above)")


def upkeep(keys: np.ndarray, draw: Callable[[int], np.ndarray], seed: int, spec: IndexSpec | None = None,
           updates: int = UPDATES) -> tuple[MemoryBank, Update, float]:
    """A full bank over ``keys`` (``saved_bank``) and ``UPDATES`` timed updates: ``(bank, timings,
    seconds to build, save and load it)``."""
    t0 = time.perf_counter()
    bank = saved_bank(keys, seed, spec or IndexSpec())
    load_s = time.perf_counter() - t0
    return bank, timed_updates(bank, draw, seed, updates), load_s


def timed_updates(bank: MemoryBank, draw: Callable[[int], np.ndarray], seed: int, updates: int) -> Update:
    """One warm-up update of ``bank``, then ``updates`` timed ones."""
    update, timings = Updater(bank, draw, seed), Update()
    update(Update())  # warm-up
    for _ in range(updates):
        update(timings)
    return timings


def workload(ms: float) -> Callable[[], None]:
    """A fixed CPU step of about ``ms`` (matmuls on torch's threads), calibrated now."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    reps = max(1, round(ms / (1e3 * (time.perf_counter() - t0) / 10)))

    def step() -> None:
        for _ in range(reps):
            a @ b

    return step


def beside_spinner(nices: tuple[int, ...] = (10, 19), step_ms: float = STEP_MS,
                   steps: int = 40) -> list[tuple[str, float, float]]:
    """The fixed step alone, then beside a process spinning in pure Python at each niceness:
    ``(label, median ms, longest ms)`` each. What any build running beside a step that keeps
    every core busy costs it, whatever the build does (why builds run on loans, ``lent.py``)."""
    step = workload(step_ms)

    def timed() -> tuple[float, float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times), max(times)

    rows = [("alone", *timed())]
    for nice in nices:
        spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.nice({nice})\nwhile True: pass"])
        try:
            time.sleep(0.5)  # started and spinning
            rows.append((f"beside a process spinning at niceness {nice}", *timed()))
        finally:
            spinner.kill()
            spinner.wait()
    return rows


@dataclass
class Stall:
    mode: str
    n: int
    steps: list[float]
    rebuilding: list[bool]  # per step: a rebuild ran during it
    rebuild_s: float
    cpu_s: float = float("nan")  # CPU seconds of the background build's thread
    swap_ms: float = float("nan")  # the caller's share of the swap, inside one step
    swap_step_ms: float = float("nan")  # the step that swapped the new index in
    parts: dict[str, list[float]] = field(default_factory=dict)  # per step, by part (``PARTS``)
    slices: dict[str, float] = field(default_factory=dict)  # a lent build's longest slice per stage (ms)

    @property
    def during(self) -> int:
        return sum(self.rebuilding)

    @property
    def median(self) -> float:
        """The median step with no rebuild running: the baseline a stall is measured against."""
        return statistics.median(t for t, r in zip(self.steps, self.rebuilding) if not r)

    @property
    def ratio(self) -> float:
        return max(self.steps) / self.median

    @property
    def over(self) -> int:
        """Steps longer than twice the median: how often, not only how far (the longest alone
        can be one hiccup of a shared machine)."""
        return sum(t > 2 * self.median for t in self.steps)

    def quiet_median(self, part: str) -> float:
        return statistics.median(v for v, r in zip(self.parts[part], self.rebuilding) if not r)

    @property
    def bank_over(self) -> int:
        """Steps above twice the median even with the fixed workload at its median time: long
        because of the bank's parts (its GC pauses included), not because the workload ran slow.
        A build in a thread slows the workload itself, which this does not count; a lent one
        is stopped outside its loans."""
        work = self.quiet_median("work")
        return sum(t - max(0.0, w - work) > 2 * self.median for t, w in zip(self.steps, self.parts["work"]))

    def causes(self) -> Counter[str]:
        """Each step above twice the median, put down to the part that exceeded its own median
        (over the steps with no rebuild) the most."""
        med = {p: self.quiet_median(p) for p in PARTS}
        return Counter(max(PARTS, key=lambda p: self.parts[p][i] - med[p])
                       for i, t in enumerate(self.steps) if t > 2 * self.median)


def stall(state: dict, draw: Callable[[int], np.ndarray], mode: str, seed: int,
          spec: IndexSpec | None = None, baseline: int = BASELINE, step_ms: float = STEP_MS,
          max_steps: int = 20_000, freeze: bool = True) -> Stall:
    """Training steps across one retrain of the index of the bank saved in ``state``, rebuilt
    as ``mode`` says (one of ``MODES``), at most ``max_steps`` (a rebuild beside a busy step
    can take many). The retrain starts in update ``baseline`` and ``baseline`` steps follow
    its swap: the steps with no rebuild that the median is taken over. ``freeze``: what is alive
    before the first step is frozen out of the collector's walks, as in training."""
    if mode not in MODES:
        raise ValueError(f"stall mode '{mode}' is unknown; expected one of {', '.join(MODES)}")
    n = len(state["ids"])
    base = spec or IndexSpec()
    # retrain once the bank has grown by ``baseline`` updates of adds; the capacity leaves it room to grow
    spec = dataclasses.replace(base, retrain_growth=1 + baseline * EPISODES / n,
                               background_from=10**12 if mode == "inline" else 0,
                               build_loan=0.0 if mode == "thread" else base.build_loan or IndexSpec.build_loan)
    bank = MemoryBank(capacity=n + (baseline + 100) * EPISODES, index=spec)
    bank.load_state_dict(state)
    index = bank._index
    if not trains(index.active, index.spec, index.dim, index.tuned):
        # nothing to retrain (a graph of full keys): measure its rebuild, a compaction, once ``baseline``
        # updates of evictions from the full bank have left that many dead rows
        bank.capacity = n
        spec = dataclasses.replace(spec, compact_fraction=baseline * EPISODES / n)
        index.spec = spec
    pauses = GcPauses()
    step, update = workload(step_ms), Updater(bank, draw, seed, pauses)
    times: list[float] = []
    work: list[float] = []
    parts = Update()
    rebuilding: list[bool] = []
    started = ended = None
    after = 0
    rebuilds = index.ops["rebuilds"]
    with pauses, heap.frozen(freeze):
        while after <= baseline and len(times) < max_steps:  # the swap step, then ``baseline``
            was = bool(index.building)
            t0, g0 = time.perf_counter(), pauses.ms
            step()
            tw, gw = time.perf_counter(), pauses.ms
            update(parts)
            t1 = time.perf_counter()
            times.append(1e3 * (t1 - t0))
            work.append(1e3 * (tw - t0) - (gw - g0))
            parts.gc_ms[-1] += gw - g0
            done = index.ops["rebuilds"] > rebuilds
            # the measured rebuild only (a buffer-growth rebuild may start in the settling steps)
            rebuilding.append(ended is None and (was or bool(index.building) or done))
            if started is None and (index.building or done):
                started = t0  # one rebuild is the measurement: none after it
                index.spec = dataclasses.replace(spec, retrain_growth=4.0, compact_fraction=0.5)
            if ended is None and done:
                ended = t1
            after += ended is not None
    rebuild_s = (ended - started) if started is not None and ended is not None else float("nan")
    cpu_s = index.last_build[1] if mode != "inline" and index.last_build is not None else float("nan")
    swap_step = times[rebuilding.index(True) + sum(rebuilding) - 1] if any(rebuilding) else float("nan")
    by_part = dict(zip(PARTS, (work, parts.retrieval_ms, parts.evolution_ms, parts.loan_ms, parts.metrics_ms,
                               parts.gc_ms)))
    label = MODES[mode] + ("" if freeze else ", heap live")
    slices = {stage: 1e3 * sec for stage, sec in index.last_slices.items()}  # empty unless lent
    return Stall(label, n, times, rebuilding, rebuild_s, cpu_s, 1e3 * index.last_swap_s, swap_step, by_part, slices)


def upkeep_table(rows: list[tuple[int, str, Update, float]], goal_ms: float = 50.0) -> Table:
    table = Table(title=f"bank upkeep per training update ({TURNS} planner-turn retrievals, {EPISODES} episodes "
                        f"credited and distilled into a full bank, metrics), median over "
                        f"{len(rows[0][2].retrieval_ms)} updates")
    for col in ("n", "index", "build+load s", "retrieval ms", "evolution ms", "metrics ms", "total ms", "max ms",
                f"<= {goal_ms:.0f} ms"):
        table.add_column(col, justify="left" if col == "index" else "right")
    for n, kind, u, load_s in rows:
        med = statistics.median
        total = u.totals()
        table.add_row(f"{n:,}", kind, f"{load_s:.1f}", f"{med(u.retrieval_ms):.1f}", f"{med(u.evolution_ms):.1f}",
                      f"{med(u.metrics_ms):.2f}", f"{med(total):.1f}", f"{max(total):.1f}",
                      "yes" if med(total) <= goal_ms else "no")
    return table


def stall_table(rows: list[Stall]) -> Table:
    table = Table(title="training step across an index retrain (a fixed CPU step + one bank update)")
    for col in ("n", "retrain", "steps", "median step ms (no rebuild)", "median step ms (rebuilding)",
                "longest step ms", "longest / median", "steps > 2x median", "of them with the workload at its median",
                "longest before the swap ms",
                "swap step ms (swap)", "rebuild s", "its CPU s", "steps during rebuild"):
        table.add_column(col, justify="left" if col == "retrain" else "right")
    for r in rows:
        busy = [t for t, b in zip(r.steps, r.rebuilding) if b]
        table.add_row(f"{r.n:,}", r.mode, str(len(r.steps)), f"{r.median:.0f}", f"{statistics.median(busy):.0f}",
                      f"{max(r.steps):.0f}", f"{r.ratio:.1f}x", str(r.over), str(r.bank_over),
                      f"{max(busy[:-1], default=math.nan):.0f}",
                      f"{r.swap_step_ms:.0f} ({r.swap_ms:.0f})", f"{r.rebuild_s:.1f}",
                      "-" if math.isnan(r.cpu_s) else f"{r.cpu_s:.1f}", str(r.during))
    return table


def longest_table(rows: list[Stall], k: int = 5) -> Table:
    """The ``k`` longest steps of each stall run, split into their parts (ms), beside the
    parts' medians over the steps with no rebuild."""
    table = Table(title=f"the {k} longest steps of each stall run, by part (ms; the first row of each run: the "
                        f"medians with no rebuild)")
    for col in ("n", "retrain", "step", "ms", "x median", "rebuilding", *PARTS):
        table.add_column(col, justify="left" if col == "retrain" else "right")
    for r in rows:
        table.add_row(f"{r.n:,}", r.mode, "median", f"{r.median:.0f}", "1.0x", "no",
                      *(f"{r.quiet_median(p):.1f}" for p in PARTS))
        for i in sorted(range(len(r.steps)), key=lambda i: -r.steps[i])[:k]:
            table.add_row("", "", str(i), f"{r.steps[i]:.0f}", f"{r.steps[i] / r.median:.1f}x",
                          "yes" if r.rebuilding[i] else "no", *(f"{r.parts[p][i]:.1f}" for p in PARTS))
    return table


def verdicts(upkeep: list[tuple[int, str, Update, float]], stalls: list[Stall], goal_ms: float = 50.0) -> list[str]:
    """The issue's goals, said plainly: per-update cost at the largest size, and the stall."""
    lines = []
    if upkeep:
        n, kind, u, _ = max(upkeep, key=lambda r: r[0])
        total = statistics.median(u.totals())
        lines.append(f"goal (upkeep n={n:,}, {kind}): median bank cost per update {total:.1f} ms "
                     f"({'met' if total <= goal_ms else 'not met'}: <= {goal_ms:.0f} ms)")
    for r in stalls:
        if math.isnan(r.rebuild_s):  # the swap, the step most likely to stall, did not happen
            verdict = f"not shown: the rebuild had not finished after {len(r.steps)} steps"
        else:
            verdict = "met" if r.ratio <= 2 else "not met"
        own = "met" if r.bank_over == 0 and not math.isnan(r.rebuild_s) else "not met"
        causes = ", ".join(f"{part} {count}" for part, count in r.causes().most_common()) or "none"
        lines.append(f"stall (n={r.n:,}, retrain {r.mode}): longest step {r.ratio:.1f}x the median step without "
                     f"a rebuild ({verdict}: <= 2x), {r.over} of {len(r.steps)} steps above 2x (the part most over "
                     f"its median: {causes}), {r.bank_over} still above 2x with the workload at its median time "
                     f"(the bank's own parts: {own}), rebuild "
                     f"{r.rebuild_s:.1f} s over {r.during} steps")
        if r.slices:
            lines.append("  its build's longest slice in the training thread, by stage (ms; lent.LentBuild): " +
                         ", ".join(f"{stage} {ms:.1f}" for stage, ms in r.slices.items()))
    return lines
