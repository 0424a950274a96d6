"""``make bench-memory``: which index should a large skill bank use, and what does its upkeep cost?

The bank (``hieragent/memory/index.py``, ``structures.py``) searches what ``memory.index`` asks for, by default
exact ``IndexFlatIP`` with BLAS batches below 50k keys and above it the approximate kind this
machine measured best (``memory/autotune.py``; the run measures afresh for each data set, in a
temporary cache);
the ``bank KeyIndex (auto)`` row is that default, measured like the others. The machine's fp32
and bf16 matmul peaks are measured first, in the same run. This script measures, at bank sizes
of 10k, 100k and (default) 1M keys of dimension 384, exact search against approximate
indexes, on three kinds of data:

  * clustered: unit vectors around n/100 random centroids (Gaussian noise, renormalised),
    the neighbourhood structure of embeddings; the clusters barely overlap, so this set is
    easier for IVF than real embeddings, and the recommended nprobe also has to hold on MiniLM;
  * minilm: real MiniLM embeddings of generated BabyAI-style mission/observation texts
    (10k and 100k by default: encoding runs at the rate printed below, see ``--minilm-sizes``);
  * uniform: random unit vectors, a worst case only; with no neighbourhood structure an
    approximate index cannot find the neighbours.

Indexes: exact numpy (matmul + ``argpartition``) and FAISS ``IndexFlatIP`` (as shipped, with
one OpenMP thread, and with its BLAS path forced); IVF-Flat (nlist = 4*sqrt(n) rounded to a
power of two, nprobe sweep); IVF with 4-bit fast-scan PQ (the bank's ``ivf_fastscan``: 48 or 192 x 4
bits at d=384, the top 100 re-scored with the exact keys); HNSW (M=32, efSearch sweep) and the bank's
projected graph (HNSW16 over the keys' 96 top principal directions, each result re-scored), built only
up to ``--hnsw-max`` (default 100k: building HNSW at 1M takes ~12 minutes on 2 cores); IVF-PQ with ``--ivfpq``.
Measured: build (train + add) time, latency of 1 query and of a batch of 256, recall@10
against the numpy exact result, and the speed-up of the batch over the fastest exact path
measured in the same run on the same data. Then the bank's upkeep per training update at each
clustered size, and the training-step stall across an index retrain: inside ``add``, in a
thread, and in a process on loans (``bank_upkeep.py``, ``--stall-modes``). The IVF rows search
as FAISS ships (the coarse quantizer on its per-query path below 128000 queries); the bank's
row searches as the bank does, every batch of 16 or more on BLAS, the quantizer included.

Why FAISS flat is slower than numpy at batch 256 (2 shared cores, faiss-cpu 1.15.1, 1M
clustered keys: FlatIP as shipped 11.3 s, with 1 OpenMP thread 17.8 s, with the BLAS path
forced 1.4 s; numpy 6.9 s): ``IndexFlatIP.search`` uses BLAS (sgemm on blocks of queries and
keys, then a top-k pass) only when the number of queries reaches
``faiss.cvar.distance_compute_blas_threshold``, which is 128000 in this build. A batch of 256
therefore takes the per-query SIMD dot-product + heap path, which streams all keys once per
query. Threads are not the cause: one thread is slower, not faster, so there is no
oversubscription on batches; nor is the heap: at 100k keys the non-BLAS path takes about
1.1 s for k = 1, 10 and 100 alike, the BLAS path 0.15-0.19 s. Lowering the threshold
(``faiss.cvar.distance_compute_blas_threshold = 20``) makes FAISS flat the fastest exact path,
faster than numpy, whose ``argpartition`` over [256, N] scores costs more than its matmul.
Single queries are another matter: there FAISS's 2 OpenMP threads are slower than 1 (161 vs
67 ms at 1M), and numpy's own OpenBLAS is faster with 1 thread than with 2 (0.52 vs
1.17 s at 100k) on this shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch  # before faiss, so FAISS runs on torch's OpenMP threads as in training (memory/openmp.py)

import faiss
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hieragent.bench import bank_upkeep
from hieragent.isa import ISA_CAPS, cap_label, isa_cap, run_capped
from hieragent.memory.index import KeyIndex
from hieragent.memory.structures import IndexSpec, auto_nlist
from hieragent.precision import matmul_peak

try:  # threadpoolctl arrives with scikit-learn (via sentence-transformers), not as our own dependency
    from threadpoolctl import threadpool_info, threadpool_limits
except ImportError:
    threadpool_info = threadpool_limits = None

DIM = 384
K = 10
BATCH = 256
BLAS_THRESHOLD = 20  # FAISS's old default: batches of >= 20 queries use sgemm
EXACT = ("numpy matmul+argpartition", "faiss FlatIP", "faiss FlatIP, 1 OMP thread",
         "faiss FlatIP, BLAS path")


@dataclass
class Row:
    data: str
    n: int
    index: str
    params: str = ""
    build_s: float = math.nan
    one_ms: float = math.nan   # latency of a single query
    batch_ms: float = math.nan  # latency of a batch of BATCH queries
    recall: float = math.nan   # recall@10 against the numpy exact result
    note: str = ""

    @property
    def exact(self) -> bool:
        return self.index in EXACT


# ---------------------------------------------------------------- data

def normalise(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def cluster_source(n: int, seed: int, noise: float = 0.04) -> Callable[[int], np.ndarray]:
    """``draw(m)``: m unit vectors around n/100 random centroids; noise per dim (norm ~0.8 at d=384)."""
    rng = np.random.default_rng(seed)
    centroids = normalise(rng.standard_normal((max(n // 100, 1), DIM), dtype=np.float32))

    def draw(m: int) -> np.ndarray:
        out = np.empty((m, DIM), dtype=np.float32)
        for s in range(0, m, 100_000):  # chunks keep the temporaries small at 1M
            e = min(s + 100_000, m)
            out[s:e] = centroids[rng.integers(len(centroids), size=e - s)]
            out[s:e] += noise * rng.standard_normal((e - s, DIM), dtype=np.float32)
        return normalise(out)

    return draw


def clustered(n: int, nq: int, seed: int, noise: float = 0.04) -> tuple[np.ndarray, np.ndarray]:
    """n keys and nq queries around n/100 centroids."""
    draw = cluster_source(n, seed, noise)
    return draw(n), draw(nq)


def uniform(n: int, nq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (normalise(rng.standard_normal((n, DIM), dtype=np.float32)),
            normalise(rng.standard_normal((nq, DIM), dtype=np.float32)))


COLOURS = ("red", "green", "blue", "purple", "yellow", "grey")
OBJECTS = ("ball", "box", "key", "door")
VERBS = ("go to", "pick up", "open", "put down", "drop", "toggle", "find", "fetch")
SIDES = ("to your left", "to your right", "ahead", "behind you")


def mission_texts(n: int, seed: int) -> list[str]:
    """n distinct BabyAI-style 'mission. observation' strings, drawn from a seeded rng."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    texts: list[str] = []
    while len(texts) < n:
        c, o, v = rng.integers(len(COLOURS)), rng.integers(len(OBJECTS)), rng.integers(len(VERBS))
        parts = []
        for _ in range(rng.integers(1, 4)):
            parts.append(f"a {COLOURS[rng.integers(len(COLOURS))]} {OBJECTS[rng.integers(len(OBJECTS))]} "
                         f"{rng.integers(1, 7)} steps {SIDES[rng.integers(len(SIDES))]}")
        text = f"{VERBS[v]} the {COLOURS[c]} {OBJECTS[o]}. You see " + ", ".join(parts) + "."
        if text not in seen:
            seen.add(text)
            texts.append(text)
    return texts


def _encode(texts: list[str]) -> np.ndarray:
    from hieragent.memory.encoder import embed, load_encoder

    return embed(load_encoder(), texts, batch_size=128)


def minilm(n: int, nq: int, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """MiniLM keys and queries; encoded in a spawned process so torch's threads stay out of ours."""
    texts = mission_texts(n + nq, seed)  # queries are texts the bank does not hold
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.apply(_encode, (texts[:8],))  # load the encoder before the clock starts
        t0 = time.perf_counter()
        vecs = pool.apply(_encode, (texts,))
        rate = len(texts) / (time.perf_counter() - t0)
    return vecs[:n], vecs[n:], rate


# ---------------------------------------------------------------- search

def timed(fn: Callable[[], object], budget_s: float = 1.0, max_reps: int = 7) -> float:
    """Median wall time of fn in seconds; repeats while the total stays within budget_s."""
    times: list[float] = []
    while len(times) < max_reps and (not times or sum(times) < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def numpy_topk(x: np.ndarray, q: np.ndarray, k: int = K) -> np.ndarray:
    s = q @ x.T  # [B, N]
    n = s.shape[1]
    part = np.argpartition(s, n - k, axis=1)[:, n - k:]  # [B, k], unordered
    order = np.argsort(-np.take_along_axis(s, part, axis=1), axis=1)
    return np.take_along_axis(part, order, axis=1)


def faiss_search(index: faiss.Index, q: np.ndarray, k: int = K, threads: int | None = None,
                 blas_threshold: int | None = None) -> np.ndarray:
    old_threads, old_threshold = faiss.omp_get_max_threads(), faiss.cvar.distance_compute_blas_threshold
    try:
        if threads is not None:
            faiss.omp_set_num_threads(threads)
        if blas_threshold is not None:
            faiss.cvar.distance_compute_blas_threshold = blas_threshold
        return index.search(q, k)[1]
    finally:
        faiss.omp_set_num_threads(old_threads)
        faiss.cvar.distance_compute_blas_threshold = old_threshold


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    hits = sum(len(set(f[f >= 0]) & set(t)) for f, t in zip(found, truth))
    return hits / truth.size


def top_k(index: faiss.Index) -> Callable[[np.ndarray], np.ndarray]:
    return lambda q: index.search(q, K)[1]


def measure(row: Row, search: Callable[[np.ndarray], np.ndarray], q: np.ndarray,
            truth: np.ndarray | None) -> Row:
    found = search(q)  # warm-up, and the result scored for recall
    singles = iter(range(10**9))
    row.one_ms = 1e3 * timed(lambda: search(q[[next(singles) % len(q)]]), budget_s=0.5, max_reps=20)
    row.batch_ms = 1e3 * timed(lambda: search(q), budget_s=2.0, max_reps=5)
    row.recall = 1.0 if truth is None else recall_at_k(found, truth)
    return row


def bench(data: str, x: np.ndarray, q: np.ndarray, seed: int, hnsw_max: int, ivfpq: bool,
          advance: Callable[[], None], asked: np.ndarray | None = None) -> list[Row]:
    n = len(x)
    rows = [measure(Row(data, n, EXACT[0]), lambda qq: numpy_topk(x, qq), q, None)]
    truth = numpy_topk(x, q)
    flat = faiss.IndexFlatIP(DIM)
    t0 = time.perf_counter()
    flat.add(x)
    build = time.perf_counter() - t0
    rows[0].build_s = 0.0
    for name, kwargs in zip(EXACT[1:], ({}, {"threads": 1}, {"blas_threshold": BLAS_THRESHOLD})):
        rows.append(measure(Row(data, n, name, build_s=build), lambda qq: faiss_search(flat, qq, **kwargs),
                            q, truth))
    del flat
    advance()

    nlist = auto_nlist(n)
    train = x[np.random.default_rng(seed).choice(n, size=min(n, 64 * nlist), replace=False)]
    quantizer = faiss.IndexFlatIP(DIM)
    ivf = faiss.IndexIVFFlat(quantizer, DIM, nlist, faiss.METRIC_INNER_PRODUCT)
    ivf.cp.seed = seed
    t0 = time.perf_counter()
    ivf.train(train)
    ivf.add(x)
    build = time.perf_counter() - t0
    for nprobe in (8, 16, 32, 64):
        if nprobe > nlist:
            continue
        ivf.nprobe = nprobe
        rows.append(measure(Row(data, n, f"IVF{nlist},Flat", f"nprobe {nprobe}", build), top_k(ivf), q, truth))
    del ivf, quantizer
    rows += fastscan_rows(data, x, q, truth)
    rows.append(bank_index_row(data, x, q, truth, asked))
    advance()

    if ivfpq:
        quantizer = faiss.IndexFlatIP(DIM)
        pq = faiss.IndexIVFPQ(quantizer, DIM, nlist, 48, 8, faiss.METRIC_INNER_PRODUCT)
        pq.cp.seed = seed
        t0 = time.perf_counter()
        pq.train(train)
        pq.add(x)
        build = time.perf_counter() - t0
        pq.nprobe = 32
        rows.append(measure(Row(data, n, f"IVF{nlist},PQ48", "nprobe 32", build), top_k(pq), q, truth))
        del pq, quantizer

    if data != "uniform":
        if n <= hnsw_max:
            hnsw = faiss.IndexHNSWFlat(DIM, 32, faiss.METRIC_INNER_PRODUCT)
            t0 = time.perf_counter()
            hnsw.add(x)
            build = time.perf_counter() - t0
            for ef in (16, 32, 64, 128):
                hnsw.hnsw.efSearch = ef
                rows.append(measure(Row(data, n, "HNSW32", f"efSearch {ef}", build), top_k(hnsw), q, truth))
            del hnsw
            rows += projected_rows(data, x, q, truth)
        else:
            rows.append(Row(data, n, "HNSW32", note=f"not built: n > --hnsw-max {hnsw_max} "
                                                    "(~12 min to build at 1M on 2 cores)"))
    advance()
    return rows


def built_index(spec: IndexSpec, x: np.ndarray, asked: np.ndarray | None = None) -> tuple[KeyIndex, float]:
    """A bank ``KeyIndex`` of ``spec`` over ``x`` (ids = rows, so results compare with the truth),
    asked ``asked`` first, and the seconds its build took (a background one included)."""
    index = KeyIndex(DIM, spec)
    if asked is not None:
        index.search(asked, K)
    t0 = time.perf_counter()
    index.add(np.arange(len(x), dtype=np.int64), x)
    index.wait()
    return index, time.perf_counter() - t0


def fastscan_rows(data: str, x: np.ndarray, q: np.ndarray, truth: np.ndarray) -> list[Row]:
    """The bank's ``ivf_fastscan`` index (4-bit PQ codes of 48 and 192 sub-quantizers, the top
    ``rerank * k`` re-scored exactly) at two nprobes."""
    rows = []
    for m in (DIM // 8, DIM // 2):
        spec = IndexSpec(kind="ivf_fastscan", background_from=10**12, train_per_list=1, fastscan_m=m)
        index, build = built_index(spec, x)
        if index.active != "ivf_fastscan":
            continue
        for nprobe in (8, 16):
            index.spec = replace(spec, nprobe=nprobe)
            rows.append(measure(Row(data, len(x), f"IVF{index._faiss.nlist},PQ{m}x4fs",
                                    f"nprobe {nprobe}, re-score top {K * spec.rerank}", build),
                                lambda qq: index.search(qq, K)[0], q, truth))
        del index
    return rows


def projected_rows(data: str, x: np.ndarray, q: np.ndarray, truth: np.ndarray) -> list[Row]:
    """The bank's projected graph (``hnsw`` with ``hnsw_dim``): HNSW16 over the keys' quarter
    dimension of top principal directions, each of the k results re-scored with the exact keys."""
    spec = IndexSpec(kind="hnsw", hnsw_m=16, hnsw_dim=DIM // 4, rerank=1, background_from=10**12)
    index, build = built_index(spec, x)
    rows = []
    for ef in (12, 16, 24):
        index.spec = replace(spec, ef_search=ef)
        rows.append(measure(Row(data, len(x), f"HNSW16 over {DIM // 4} directions", f"efSearch {ef}, re-scored",
                                build), lambda qq: index.search(qq, K)[0], q, truth))
    del index
    return rows


def bank_index_row(data: str, x: np.ndarray, q: np.ndarray, truth: np.ndarray,
                   asked: np.ndarray | None = None) -> Row:
    """What the bank itself searches with under the default config (``memory.index.kind: auto``):
    exact FlatIP with BLAS batches below 50k keys, from there the kind this machine measured best,
    tuned on the queries the bank was ``asked`` before (other queries of the same source as ``q``,
    as a training run asks before its bank grows)."""
    index, build = built_index(IndexSpec(), x, asked)
    params = ("flat, BLAS batches" if index.active == "flat" else
              ", ".join([index.active, *(f"{k} {v}" for k, v in index.tuned.items())]))
    row = measure(Row(data, len(x), "bank KeyIndex (auto)", params, build, note=index.auto_note),
                  lambda qq: index.search(qq, K)[0], q, truth)
    del index
    return row


# ---------------------------------------------------------------- report

def diagnose(x: np.ndarray, q: np.ndarray) -> Table:
    """Where FAISS flat spends its time at batch 256: path (BLAS or not), threads, k."""
    flat = faiss.IndexFlatIP(DIM)
    flat.add(x)
    table = Table(title=f"FAISS flat vs numpy, batch {len(q)}, n = {len(x)} clustered")
    for col in ("variant", "k", "batch ms"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for k in (1, 10, 100):
        table.add_row("faiss, as shipped (non-BLAS path)", str(k),
                      f"{1e3 * timed(lambda: faiss_search(flat, q, k), 1.0, 3):.0f}")
        table.add_row("faiss, BLAS path", str(k),
                      f"{1e3 * timed(lambda: faiss_search(flat, q, k, blas_threshold=BLAS_THRESHOLD), 1.0, 3):.0f}")
    table.add_row("faiss, BLAS path, 1 OMP thread", "10",
                  f"{1e3 * timed(lambda: faiss_search(flat, q, 10, 1, BLAS_THRESHOLD), 1.0, 3):.0f}")
    table.add_row("numpy", "10", f"{1e3 * timed(lambda: numpy_topk(x, q), 1.0, 3):.0f}")
    if threadpool_limits is not None:
        with threadpool_limits(1):
            table.add_row("numpy, 1 BLAS thread", "10", f"{1e3 * timed(lambda: numpy_topk(x, q), 1.0, 3):.0f}")
    return table


def results_table(rows: list[Row], title: str) -> Table:
    table = Table(title=title)
    for col in ("data", "n", "index", "params", "build s", "1 query ms", f"batch {BATCH} ms",
                "speed-up vs fastest exact", "recall@10", "note"):
        table.add_column(col, justify="left" if col in ("data", "index", "params", "note") else "right",
                         no_wrap=col in ("index", "params"))
    for r in rows:
        fastest = min(s.batch_ms for s in rows if s.exact and (s.data, s.n) == (r.data, r.n))
        fmt = (lambda v, f: "-" if math.isnan(v) else format(v, f))
        table.add_row(r.data, f"{r.n:,}", r.index, r.params, fmt(r.build_s, ".2f"), fmt(r.one_ms, ".2f"),
                      fmt(r.batch_ms, ".1f"), fmt(fastest / r.batch_ms, ".1f") + ("x" if r.batch_ms == r.batch_ms else ""),
                      fmt(r.recall, ".3f"), r.note)
    return table


def finding(rows: list[Row]) -> str:
    n = max(r.n for r in rows if r.data == "clustered")
    here = {r.index: r for r in rows if (r.data, r.n) == ("clustered", n) and r.exact}
    shipped, one, blas, numpy_ms = (here[name].batch_ms / 1e3 for name in EXACT[1:] + EXACT[:1])
    numbers = (f"faiss FlatIP {shipped:.2f} s, 1 OMP thread {one:.2f} s, BLAS path {blas:.2f} s, "
               f"numpy {numpy_ms:.2f} s")
    if blas < 0.6 * shipped:
        why = (f"the batch is below distance_compute_blas_threshold "
               f"({faiss.cvar.distance_compute_blas_threshold}), so FAISS takes its per-query non-BLAS path "
               f"(one pass over the keys per query); one OMP thread takes {one / shipped:.1f}x as long, "
               f"so oversubscription is not the cause. Set faiss.cvar.distance_compute_blas_threshold = "
               f"{BLAS_THRESHOLD} for batched exact search")
    else:
        why = "the BLAS path does not explain the gap at this size; see the diagnosis table"
    return f"finding (clustered n={n:,}, batch {BATCH}): {numbers}: {why}."


def goal(rows: list[Row]) -> list[str]:
    """The issue's goal: the bank's default at least 20x the fastest exact path with recall@10 >= 0.95,
    at the largest clustered size and on the largest MiniLM size."""
    lines = []
    for data in ("clustered", "minilm"):
        sizes = [r.n for r in rows if r.data == data]
        if not sizes:
            continue
        n = max(sizes)
        here = [r for r in rows if (r.data, r.n) == (data, n)]
        fastest = min(r.batch_ms for r in here if r.exact)
        bank = next(r for r in here if r.index == "bank KeyIndex (auto)")
        speedup = fastest / bank.batch_ms
        met = speedup >= 20 and bank.recall >= 0.95
        lines.append(f"goal ({data} n={n:,}): bank default ({bank.params}) {speedup:.1f}x the fastest exact path, "
                     f"recall@10 {bank.recall:.3f}: {'met' if met else 'not met'} (>= 20x, >= 0.95)")
        if bank.note:
            lines.append(f"  {bank.note}")
    return lines


def machine_line() -> str:
    """The CPU, and its fp32 and bf16 matmul peaks measured now (the figures below depend on them)."""
    from hieragent.memory.autotune import cpu_name
    from hieragent.memory.openmp import one_runtime

    fp32 = matmul_peak(torch.float32)
    bf16 = matmul_peak(torch.bfloat16, size=512, seconds=0.5)
    return (f"machine: {cpu_name()}{cap_label(isa_cap(), detail=True)}, {os.cpu_count()} cpus; "
            f"matmul peak fp32 {fp32:.0f} GFLOP/s, "
            f"bf16 {bf16:.1f} GFLOP/s (bf16/fp32 {bf16 / fp32:.2f}), measured in this run; "
            f"OpenMP: {'one runtime for torch and FAISS' if one_runtime() else 'two runtimes (FAISS first)'}")


def heap_line() -> str:
    """A full garbage collection in a fresh process with the trainer's imports, before and
    after the freeze that training does (``python -m hieragent.heap``)."""
    out = subprocess.run([sys.executable, "-m", "hieragent.heap"], capture_output=True, text=True, check=True)
    h = json.loads(out.stdout.splitlines()[-1])
    return (f"a full garbage collection with the trainer's imports: {h['live_ms']:.0f} ms over {h['tracked']:,} "
            f"tracked objects; {h['frozen_ms']:.2f} ms once they are frozen, as training does at its start "
            f"(python -m hieragent.heap)")


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                   help="bank sizes for the clustered data (and the upkeep table)")
    p.add_argument("--minilm-sizes", type=int, nargs="*", default=[10_000, 100_000],
                   help="bank sizes of real MiniLM embeddings (none: skip the encoder)")
    p.add_argument("--uniform-size", type=int, default=100_000, help="size of the worst-case uniform row (0: skip)")
    p.add_argument("--hnsw-max", type=int, default=100_000, help="build HNSW only up to this size")
    p.add_argument("--ivfpq", action="store_true", help="also measure IVF-PQ (48 x 8 bits, nprobe 32)")
    p.add_argument("--stall-size", type=int, default=None,
                   help="bank size of the retrain-stall measurement (default: the largest size; 0: skip)")
    p.add_argument("--stall-modes", nargs="+", choices=list(bank_upkeep.MODES), default=list(bank_upkeep.MODES),
                   help="how the stall measurement rebuilds: inside add, in a thread, in a process on loans")
    p.add_argument("--stall-heap", nargs="+", choices=["frozen", "live"], default=["frozen"],
                   help="the stall loop's heap: frozen before the first step, as training's (callbacks.FrozenHeap), "
                        "or live, as before 2026-12-07 (later); both: one run each, for the comparison")
    p.add_argument("--spinner", action="store_true",
                   help="also time the fixed training step beside a process spinning at niceness 10 and 19")
    p.add_argument("--no-upkeep", action="store_true", help="skip the upkeep and stall tables")
    p.add_argument("--no-search", action="store_true",
                   help="skip the search rows: only the upkeep and stall tables (the bank at each size chooses its "
                        "index afresh)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, no encoder (for the test)")
    p.add_argument("--isa", choices=sorted(ISA_CAPS), default=None,
                   help="run as a machine without AMX and AVX-512 would (hieragent/isa.py): restarts this "
                        "process with every library's instruction set capped")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.isa:
        run_capped(a.isa, "hieragent.bench.memory", sys.argv[1:] if argv is None else argv)
    if a.quick:
        a.sizes, a.minilm_sizes, a.uniform_size = [2000], [], 2000
    stall_n = max(a.sizes) if a.stall_size is None else a.stall_size
    # --quick: an IVF small enough to retrain at 2000 keys, and a short step
    quick_stall = {"spec": IndexSpec(kind="ivf_flat", nlist=16), "step_ms": 20.0} if a.quick else {}
    jobs = [("clustered", n) for n in a.sizes] + [("minilm", n) for n in a.minilm_sizes]
    jobs += [("uniform", a.uniform_size)] if a.uniform_size else []
    if a.no_search:
        if a.no_upkeep and not a.spinner:
            p.error("--no-search with --no-upkeep leaves nothing to measure (add --spinner for the step beside a "
                    "spinning process)")
        jobs = []
    rows: list[Row] = []
    notes: list[str] = []
    blas = (", ".join(f"{i['internal_api']} {i['num_threads']}" for i in threadpool_info())
            if threadpool_info is not None else "unknown (no threadpoolctl)")
    # the FAISS diagnosis runs on the largest clustered size up to 100k (seconds, not minutes)
    diag_n = max([n for n in a.sizes if n <= 100_000] or [min(a.sizes)]) if jobs else None
    diag = None
    upkeep: list[tuple[int, str, bank_upkeep.Update, float]] = []
    stalls: list[bank_upkeep.Stall] = []
    started = time.perf_counter()
    console = Console(width=max(Console().width, 170))
    machine = machine_line()
    print(machine)
    notes += [] if a.quick or a.no_upkeep else [heap_line()]
    cache = os.environ.get("HIERAGENT_CACHE")
    with tempfile.TemporaryDirectory() as fresh, Progress(console=console) as progress:
        upkeep_jobs = [] if a.no_upkeep else a.sizes
        stall_runs = len(a.stall_modes) * len(a.stall_heap) * bool(stall_n)
        task = progress.add_task("bench-memory", total=3 * len(jobs) + 1 + len(upkeep_jobs) + stall_runs)
        try:
            for data, n in jobs:
                progress.update(task, description=f"{data} n={n:,}")
                # auto measures in this run, for each data set afresh (a machine's cache is per key
                # dimension, and these data sets share one)
                os.environ["HIERAGENT_CACHE"] = os.path.join(fresh, f"{data}-{n}")
                if data == "clustered":
                    x, q = clustered(n, 2 * BATCH, a.seed)
                elif data == "uniform":
                    x, q = uniform(n, 2 * BATCH, a.seed)
                else:
                    x, q, rate = minilm(n, 2 * BATCH, a.seed)
                    notes.append(f"MiniLM encoding: {rate:,.0f} texts/s on this machine "
                                 f"(100k texts: ~{1e5 / rate / 60:.1f} min)")
                q, asked = q[:BATCH], q[BATCH:]  # measured with the first, the bank asked the rest before
                rows += bench(data, x, q, a.seed, a.hnsw_max, a.ivfpq, lambda: progress.advance(task), asked)
                if data == "clustered" and n == diag_n:
                    diag = diagnose(x, q)
                progress.advance(task)
                del x, q
            for n in upkeep_jobs:
                progress.update(task, description=f"bank upkeep n={n:,}")
                os.environ["HIERAGENT_CACHE"] = os.path.join(fresh, f"clustered-{n}")  # what the search rows chose
                draw = cluster_source(n, a.seed + 1)
                bank, timings, load_s = bank_upkeep.upkeep(draw(n), draw, a.seed, updates=5 if a.quick else 20)
                upkeep.append((n, bank.index_kind, timings, load_s))
                progress.advance(task)
                if n == stall_n and not a.no_upkeep:
                    state = bank.state_dict()
                    del bank
                    for mode in a.stall_modes:
                        for kept in a.stall_heap:
                            progress.update(task, description=f"retrain stall n={n:,}, {mode}, heap {kept}")
                            stalls.append(bank_upkeep.stall(state, draw, mode, a.seed, freeze=kept == "frozen",
                                                            **quick_stall))
                            progress.advance(task)
                    del state
        finally:
            if cache is None:
                os.environ.pop("HIERAGENT_CACHE", None)
            else:
                os.environ["HIERAGENT_CACHE"] = cache
    if rows:
        console.print(results_table(rows, f"bench-memory: d={DIM}, k={K}, seed {a.seed}; faiss {faiss.__version__} "
                                          f"(OMP threads {faiss.omp_get_max_threads()}, blas threshold "
                                          f"{faiss.cvar.distance_compute_blas_threshold}); thread pools: {blas}"))
    if diag is not None:
        console.print(diag)
    if upkeep:
        console.print(bank_upkeep.upkeep_table(upkeep))
    if stalls:
        console.print(bank_upkeep.stall_table(stalls))
        console.print(bank_upkeep.longest_table(stalls))
    spun = []
    if a.spinner:
        (_, alone, _), *beside = bank_upkeep.beside_spinner(step_ms=20.0 if a.quick else bank_upkeep.STEP_MS)
        spun = [f"the fixed step {label}: median {med:.0f} ms, longest {top:.0f} ms ({top / alone:.1f}x the median "
                f"alone, {alone:.0f} ms)" for label, med, top in beside]
    for line in [machine, *notes, *([finding(rows)] if rows else []), *goal(rows), *bank_upkeep.verdicts(upkeep, stalls),
                 *spun, f"total {time.perf_counter() - started:.0f} s"]:
        print(line)
    return rows


if __name__ == "__main__":
    main()
