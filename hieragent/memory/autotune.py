"""What ``memory.index.kind: auto`` uses above its threshold: measured on this machine, cached.

Which approximate index is fastest depends on the machine and on the keys: where fp32 BLAS is
fast and memory slow, scanning full IVF lists loses to 4-bit fast-scan codes; keys with many
near-ties (MiniLM embeddings of templated text) defeat coarse codes and favour a graph. So the
first time a bank crosses ``auto_threshold`` (in the background build: no training step
waits), ``build`` measures, in two stages.

The queries are the bank's own: ``KeyIndex`` keeps the latest ``QUERIES_KEPT`` (256) it was
asked, and with at least ``MIN_QUERIES`` of them both stages measure on those; before a bank
has been asked, on its keys (held out of the sample in stage 1; in stage 2 each key against
its nearest other keys, which is easier: on MiniLM keys 0.988 where fresh texts got 0.937).

1. **Structure, on a sample.** Each candidate structure is built on a sample of the bank's own
   keys (up to ``SAMPLE``) and searched at every setting of its ``GRID``, against exact search
   on the sample:

   * ``ivf_flat``: IVF with full keys (``nprobe``);
   * ``ivf_fastscan``: IVF with 4-bit fast-scan PQ codes of an eighth and of half the key
     dimension in sub-quantizers, ``rerank * k`` candidates re-scored from the exact keys
     (``nprobe`` x ``rerank``);
   * ``hnsw``: a graph of degree 16 and of 32 (``ef_search``), over the full keys and over their
     projection onto a quarter of the dimension's top principal directions, whose candidates
     are re-scored (``ef_search`` x ``rerank``). On MiniLM keys the projected graph walks at a
     quarter of the cost per step and its recall barely moves: the keys of templated text
     span few directions.

   A sample is sparser than the bank, so its neighbours are farther and the absolute recall it
   shows can be far below the bank's (a 100k sample of 1M clustered keys tops out at 0.87). The
   rule compares structures at what the sample allows: the fastest setting whose recall@10 is
   within ``SLACK`` of the best any setting reached (or at least ``RECALL``).
2. **Search settings, on the bank.** The chosen structure is built over all the keys, and its
   grid is searched again, against exact search over all the keys. The rule: the fastest
   setting with recall@10 >= ``RECALL``, else the most accurate. Later retrainings of the
   index (the bank has grown) repeat this stage.

The structure is cached per machine (CPU model, cores, FAISS version, key dimension) in
``<cache>/index_auto.json``. A later bank on the machine skips stage 1; where stage 2 then
finds no setting with ``RECALL`` on its keys, stage 1 runs again on them and replaces the
entry. Delete the file (or set ``$HIERAGENT_CACHE``) to measure afresh.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import faiss
import numpy as np

from hieragent.io import atomic_write_text, cache_dir
from hieragent.isa import cap_label, isa_cap
from hieragent.memory.index import QUERIES_KEPT
from hieragent.memory.structures import (IVF_KINDS, STRUCTURE, IndexSpec, auto_nlist, reranked, search_params,
                                         search_rows, trained_index)

log = logging.getLogger(__name__)

CANDIDATES = ("ivf_flat", "ivf_fastscan", "hnsw")
GRID: dict[str, tuple[dict[str, int], ...]] = {
    "ivf_flat": tuple({"nprobe": p} for p in (2, 4, 8, 16, 32, 64)),
    "ivf_fastscan": tuple({"nprobe": p, "rerank": r} for p in (2, 4, 8, 16, 32) for r in (2, 5, 10, 20)),
    "hnsw": tuple({"ef_search": e} for e in (10, 12, 16, 24, 32, 64, 128)),
    "hnsw_projected": tuple({"ef_search": e, "rerank": r} for e in (10, 12, 16, 24, 32, 64) for r in (1, 2, 4)),
}
HNSW_M = (16, 32)
PROJECT = 4  # the projected graph holds keys in a quarter of their dimension
MIN_PROJECTED = 32  # and only where that leaves at least this many
CANDIDATES_VERSION = 2  # part of the cache key: a cached choice predates candidates added since
SAMPLE = 100_000
QUERIES = QUERIES_KEPT
MIN_QUERIES = 64  # recent queries needed to measure on them rather than on keys
K = 10
RECALL = 0.95
SLACK = 0.02
TRIES = 3  # structures built over all the keys at most, before keeping the most accurate
CLOCK = time.perf_counter  # a lent build's process (stopped between loans) times in CPU seconds

Make = Callable[[str, dict[str, int]], faiss.Index]  # (kind, structure) -> an index over the keys


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(dim: int, spec: IndexSpec) -> str:
    """The cache key: what the measured choice depends on (an instruction-set cap computes
    as another machine would, so it is part of the machine)."""
    return (f"{cpu_name()}{cap_label(isa_cap())} | {os.cpu_count()} cpus | faiss {faiss.__version__} | "
            f"dim {dim} | fastscan_m {spec.fastscan_m or 'swept'} | candidates v{CANDIDATES_VERSION}")


def cache_file():
    return cache_dir() / "index_auto.json"


def _read_cache() -> dict[str, Any]:
    path = cache_file()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        return data
    except (OSError, ValueError) as e:
        log.warning("memory index: ignoring the unreadable auto-index cache %s (%s); measuring again", path, e)
        return {}


def structures(dim: int, spec: IndexSpec) -> list[tuple[str, dict[str, int]]]:
    """``(kind, build-time settings)`` of each candidate."""
    ms = [spec.fastscan_m] if spec.fastscan_m else sorted({m for m in (dim // 8, dim // 2) if m and dim % m == 0})
    dims = [0] + ([dim // PROJECT] if dim // PROJECT >= MIN_PROJECTED else [])
    return [("ivf_flat", {}), *(("ivf_fastscan", {"fastscan_m": m}) for m in ms),
            *(("hnsw", {"hnsw_m": m, "hnsw_dim": d}) for d in dims for m in HNSW_M)]


def exact_top(keys: np.ndarray, q: np.ndarray, k: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """Exact top-``k`` rows of ``keys`` for ``q`` ``[B, k]``; ``exclude``: each query's own row."""
    rows = faiss.knn(q, keys, k + (exclude is not None), metric=faiss.METRIC_INNER_PRODUCT)[1]
    return rows if exclude is None else without(rows, exclude, k)


def without(rows: np.ndarray, exclude: np.ndarray, k: int) -> np.ndarray:
    """``rows [B, >k]`` less each row's ``exclude[b]`` (or its last), order kept: ``[B, k]``."""
    order = np.argsort(rows == exclude[:, None], axis=1, kind="stable")  # False (kept) first
    return np.take_along_axis(rows, order, axis=1)[:, :k]


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return sum(len(set(f) & set(t)) for f, t in zip(found.tolist(), truth.tolist())) / truth.size


def _fastest_of(fn: Callable[[], object], reps: int = 3) -> float:
    """The least of ``reps`` timings: a build thread shares the cores, and the least is the
    run least disturbed."""
    best = float("inf")
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def grid(kind: str, structure: dict[str, int], spec: IndexSpec, dim: int) -> tuple[dict[str, int], ...]:
    """The search settings ``sweep`` tries on a structure."""
    return GRID["hnsw_projected" if kind == "hnsw" and reranked(kind, spec, dim, structure) else kind]


def sweep(index: faiss.Index, kind: str, structure: dict[str, int], spec: IndexSpec, keys: np.ndarray,
          q: np.ndarray, truth: np.ndarray, exclude: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Latency of a batch and recall@K of every ``grid`` setting of ``index`` (rows of ``keys``)."""
    out = []
    n = K + (exclude is not None)
    for setting in grid(kind, structure, spec, keys.shape[1]):
        if kind != "hnsw" and setting["nprobe"] > index.nlist:  # the same as probing every list
            continue
        params = search_params(index, kind, setting.get("nprobe", 1), setting.get("ef_search", 1))
        rerank = setting.get("rerank", 0)

        def search() -> np.ndarray:
            return search_rows(index, keys, q, n, params, rerank)[1][:, :n]

        found = search()
        seconds = _fastest_of(search)
        found = found[:, :K] if exclude is None else without(found, exclude, K)
        out.append({**setting, "ms": 1e3 * seconds, "recall": recall(found, truth)})
    return out


def measure_sample(keys: np.ndarray, spec: IndexSpec, make_on: Callable[[np.ndarray], Make],
                   queries: np.ndarray | None = None, sample: int | None = None) -> dict[str, Any]:
    """Stage 1: every structure at every setting on a sample of ``keys`` (``make_on(x)``: a
    builder of indexes over ``x``), for the bank's recent ``queries`` (else held-out keys)."""
    rng = np.random.default_rng(0)
    real = queries is not None and len(queries) >= MIN_QUERIES
    pick = rng.choice(len(keys), min(len(keys), (sample or SAMPLE) + (0 if real else QUERIES)), replace=False)
    if real:
        q, x = np.ascontiguousarray(queries), np.ascontiguousarray(keys[np.sort(pick)])
    else:
        q, x = np.ascontiguousarray(keys[pick[:QUERIES]]), np.ascontiguousarray(keys[pick[QUERIES:]])
    truth = exact_top(x, q, K)
    exact_s = _fastest_of(lambda: exact_top(x, q, K))
    make = make_on(x)
    out: dict[str, Any] = {"keys": len(x), "queries": "recent" if real else "held-out keys",
                           "exact_ms": 1e3 * exact_s, "settings": []}
    for kind, structure in structures(x.shape[1], spec):
        index = make(kind, structure)
        if index is None:  # too few keys to train this kind
            continue
        out["settings"] += [{"kind": kind, **structure, **r} for r in sweep(index, kind, structure, spec, x, q, truth)]
        del index
    return out


Structure = tuple[str, dict[str, int]]  # (kind, build-time settings)


def ranked(measured: dict[str, Any]) -> list[Structure]:
    """Stage 1's rule as an order of structures: first those with a setting whose recall is
    within ``SLACK`` of the best any setting reached (or at least ``RECALL``), by the time of
    their fastest such setting; then the rest, the most accurate first."""
    settings = measured["settings"]
    if not settings:
        return [("ivf_flat", {})]
    target = min(RECALL, max(c["recall"] for c in settings) - SLACK)
    score: dict[tuple, tuple[int, float]] = {}
    for c in settings:
        key = (c["kind"], *((k, c[k]) for k in STRUCTURE if k in c))
        s = (0, c["ms"]) if c["recall"] >= target else (1, -c["recall"])
        score[key] = min(score.get(key, s), s)
    return [(key[0], dict(key[1:])) for key in sorted(score, key=score.__getitem__)]


def decide(measured: dict[str, Any]) -> dict[str, Any]:
    """Stage 1's choice: the first of ``ranked``."""
    kind, structure = ranked(measured)[0]
    return {"kind": kind, **structure}


def tune(index: faiss.Index, kind: str, structure: dict[str, int], spec: IndexSpec, keys: np.ndarray,
         queries: np.ndarray | None = None) -> tuple[dict[str, int], dict[str, Any]]:
    """Stage 2: the search settings of ``index`` over ``keys``, measured with the bank's recent
    ``queries`` (at least ``MIN_QUERIES``), else with ``QUERIES`` of the keys as queries, each
    against its nearest other keys. ``(settings, what was measured)``."""
    if queries is not None and len(queries) >= MIN_QUERIES:
        q, rows, asked = np.ascontiguousarray(queries), None, f"its {len(queries)} latest queries"
    else:
        rows = np.sort(np.random.default_rng(1).choice(len(keys), min(QUERIES, len(keys)), replace=False))
        q, asked = np.ascontiguousarray(keys[rows]), f"{len(rows)} of them as queries"
    truth = exact_top(keys, q, K, exclude=rows)
    results = sweep(index, kind, structure, spec, keys, q, truth, exclude=rows)
    good = [r for r in results if r["recall"] >= RECALL]
    best = min(good, key=lambda r: r["ms"]) if good else max(results, key=lambda r: r["recall"])
    return {k: v for k, v in best.items() if k not in ("ms", "recall")}, {"keys": len(keys), "asked": asked,
                                                                          "best": best, "settings": results}


def describe(kind: str, tuned: dict[str, int], tuned_on: dict[str, Any], how: str) -> str:
    best = tuned_on["best"]
    name = kind + "".join(f" {k} {v}" for k, v in tuned.items())
    verdict = "" if best["recall"] >= RECALL else f", the most accurate: none reached {RECALL}"
    return (f"auto chose {name} ({how}); on the bank's {tuned_on['keys']:,} keys, {tuned_on['asked']}: "
            f"{best['ms']:.1f} ms per batch, recall@{K} {best['recall']:.3f}{verdict}")


def build(keys: np.ndarray, spec: IndexSpec, make: Make,
          chosen: Structure | None = None, make_on: Callable[[np.ndarray], Make] | None = None,
          queries: np.ndarray | None = None) -> tuple[str, faiss.Index, dict[str, int], str]:
    """Choose (unless ``chosen``, a retraining), build over ``keys`` with ``make`` and tune:
    ``(kind, index, tuned settings, note)``.

    A structure whose best setting misses ``RECALL`` on all the keys (a sample can flatter
    one: a graph that finds a 100k sample's neighbours may lose them among 1M clustered keys)
    gives way to the next kind in stage 1's order (the same kind with other build settings
    would miss as well), up to ``TRIES`` builds; the one kept is cached."""
    if chosen is not None:
        queue = [(chosen[0], {k: v for k, v in chosen[1].items() if k in STRUCTURE})]
        how, measured = "retrained; the structure kept", True  # nothing else to try
    else:
        hit = _read_cache().get(machine_key(keys.shape[1], spec))
        try:
            queue = [(hit["choice"]["kind"], {k: int(v) for k, v in hit["choice"].items() if k in STRUCTURE})]
            if queue[0][0] not in CANDIDATES:
                raise ValueError(queue[0][0])
            how, measured = "the machine's cached structure", False
        except (TypeError, KeyError, ValueError, AttributeError):  # no entry (or another version's)
            queue, how, measured = [], "", False
    tried: list[tuple[str, dict[str, int], faiss.Index, dict[str, int], dict[str, Any]]] = []
    sample: dict[str, Any] | None = None
    while len(tried) < TRIES:
        if not queue and not measured:
            sample = measure_sample(keys, spec, make_on or default_make_on(spec), queries)
            measured = True
            queue = ranked(sample)
            how = (f"measured now: of {len(sample['settings'])} settings on {sample['keys']:,} sampled keys, "
                   f"the fastest within {SLACK} of the best recall")
        queue = [s for s in queue if all(s[0] != k for k, *_ in tried)]  # a kind that missed misses again
        if not queue:
            break
        kind, structure = queue.pop(0)
        index = make(kind, structure)
        settings, tuned_on = tune(index, kind, structure, spec, keys, queries)
        tried.append((kind, structure, index, settings, tuned_on))
        if tuned_on["best"]["recall"] >= RECALL:
            break
        log.info("memory index: auto's %s %s reaches recall@%d %.3f at best on the bank's %d keys, below %.2f; "
                 "trying the next structure", kind, structure, K, tuned_on["best"]["recall"], len(keys), RECALL)
        del index
        tried[-1] = (kind, structure, None, settings, tuned_on)  # keep the figures, not the index
    good = [t for t in tried if t[4]["best"]["recall"] >= RECALL]
    kind, structure, index, settings, tuned_on = good[0] if good else max(tried, key=lambda t: t[4]["best"]["recall"])
    if index is None:  # none reached RECALL: the most accurate, built again
        index = make(kind, structure)
    if len(tried) > 1:
        how += "; " + ", ".join(f"{k} {st} missed (recall@{K} {t['best']['recall']:.3f})"
                                for k, st, _, _, t in tried if (k, st) != (kind, structure))
    if chosen is None:
        _cache({"kind": kind, **structure}, sample, keys.shape[1], spec)
    tuned = {**structure, **settings}
    note = describe(kind, tuned, tuned_on, how)
    log.info("memory index: %s", note)
    return kind, index, tuned, note


def _cache(choice: dict[str, Any], sample: dict[str, Any] | None, dim: int, spec: IndexSpec) -> None:
    """Record ``choice`` (and what stage 1 measured, where it ran) for this machine."""
    cache = _read_cache()
    key = machine_key(dim, spec)
    entry = cache.get(key) if isinstance(cache.get(key), dict) else {}
    if entry.get("choice") == choice and sample is None:
        return
    entry = {"choice": choice, "measured": sample if sample is not None else entry.get("measured"),
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    cache[key] = entry
    try:
        cache_file().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache_file(), json.dumps(cache, indent=1))
    except OSError as e:
        log.warning("memory index: could not cache the auto-index choice in %s (%s)", cache_file(), e)


def default_make_on(spec: IndexSpec) -> Callable[[np.ndarray], Make]:
    """Index builders over a sample, as the bank builds them (IVF: ``auto_nlist`` of its size)."""
    def make_on(x: np.ndarray) -> Make:
        def make(kind: str, structure: dict[str, int]) -> faiss.Index | None:
            lists = spec.nlist or auto_nlist(len(x))
            if kind in IVF_KINDS and len(x) < lists * (16 if kind == "ivf_fastscan" else 1):
                return None  # too few keys to train
            index = trained_index(kind, x, spec, structure)
            index.add(x)
            return index

        return make

    return make_on
