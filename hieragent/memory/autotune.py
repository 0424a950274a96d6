"""What ``memory.index.kind: auto`` uses above its threshold: measured on this machine, cached.

Which approximate index is fastest depends on the machine: where fp32 BLAS is fast and memory
is slow, scanning full IVF lists loses to 4-bit fast-scan codes, and on another machine the
order flips. So the first time a bank crosses ``auto_threshold`` (in the background build, so
no training step waits), ``choose`` builds each candidate on a sample of the bank's own keys
(up to ``SAMPLE`` of them; 256 more, held out, are the queries), exactly as the bank uses it,
and times a batch of 256 queries at each search setting of ``SWEEP``, against exact FlatIP
with BLAS batches:

  * ``ivf_flat``: IVF with full keys, at ``nprobe`` 8, 16 and 32;
  * ``ivf_fastscan``: IVF with 4-bit fast-scan PQ codes of an eighth and of half the key
    dimension in sub-quantizers (48 and 192 at 384: coarse codes are fast, fine ones keep
    MiniLM's close neighbours apart), ``rerank * k`` candidates re-scored exactly from the kept
    keys, at (nprobe, rerank) (8, 5), (8, 10), (16, 5), (16, 10), (32, 10).

The rule: the fastest setting whose recall@10 against exact search is at least ``RECALL``;
if none reaches it, the most accurate. Speed is the machine's, recall the data's: the choice
(kind, nprobe, rerank) is cached per machine (CPU model, cores, FAISS version, key dimension,
fast-scan sub-quantizers) in ``<cache>/index_auto.json``, and a later bank on the machine builds
only the cached setting on a sample of its own keys to check its recall (one build instead of
the sweep); where it misses ``RECALL`` there, the sweep runs again and replaces the entry.
Delete the file (or set ``$HIERAGENT_CACHE``) to measure afresh.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from datetime import datetime, timezone
from typing import Any

import faiss
import numpy as np

from hieragent.io import atomic_write_text, cache_dir
from hieragent.memory.index import IndexSpec, KeyIndex, blas_search

log = logging.getLogger(__name__)

CANDIDATES = ("ivf_flat", "ivf_fastscan")
SWEEP = {"ivf_flat": ((8, 1), (16, 1), (32, 1)),
         "ivf_fastscan": ((8, 5), (8, 10), (16, 5), (16, 10), (32, 10))}  # (nprobe, rerank)
SETTING = ("kind", "fastscan_m", "nprobe", "rerank")  # what a choice fixes
SAMPLE = 100_000
QUERIES = 256
K = 10
RECALL = 0.95


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
    return (f"{cpu_name()} | {os.cpu_count()} cpus | faiss {faiss.__version__} | dim {dim} | "
            f"fastscan_m {spec.fastscan_m or 'swept'}")


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


def _timed(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def builds(dim: int, spec: IndexSpec) -> list[tuple[str, int]]:
    """``(kind, fast-scan sub-quantizers)`` of each candidate index (0: not fast-scan)."""
    ms = [spec.fastscan_m] if spec.fastscan_m else sorted({m for m in (dim // 8, dim // 2) if m and dim % m == 0})
    return [("ivf_flat", 0), *(("ivf_fastscan", m) for m in ms)]


def measure(keys: np.ndarray, spec: IndexSpec, sample: int = SAMPLE,
            only: dict[str, int] | None = None) -> dict[str, Any]:
    """Batch latency and recall@10 of exact search and of each candidate setting on ``keys``
    (``only``: one setting, a choice to check)."""
    rng = np.random.default_rng(0)
    pick = rng.choice(len(keys), min(len(keys), sample + QUERIES), replace=False)
    q, x = np.ascontiguousarray(keys[pick[:QUERIES]]), np.ascontiguousarray(keys[pick[QUERIES:]])
    flat = faiss.IndexFlatIP(x.shape[1])
    flat.add(x)
    with blas_search(len(q)):
        truth = flat.search(q, K)[1]
        exact_s = _timed(lambda: flat.search(q, K))
    del flat
    out: dict[str, Any] = {"keys": len(x), "exact_ms": 1e3 * exact_s, "settings": []}
    for kind, m in builds(x.shape[1], spec):
        if only is not None and (kind, m) != (only["kind"], only.get("fastscan_m", 0)):
            continue
        cand = dataclasses.replace(spec, kind=kind, background_from=10**12, train_per_list=1, fastscan_m=m)
        index = KeyIndex(x.shape[1], cand)
        index.add(np.arange(len(x), dtype=np.int64), x)
        if index.active != kind:  # too few keys for this kind's training
            continue
        settings = SWEEP[kind] if only is None else ((only["nprobe"], only["rerank"]),)
        for nprobe, rerank in settings:
            index.tuned = {"nprobe": nprobe, "rerank": rerank}
            found = index.search(q, K)[0]
            seconds = _timed(lambda: index.search(q, K))
            recall = sum(len(set(f) & set(t)) for f, t in zip(found.tolist(), truth.tolist())) / truth.size
            out["settings"].append({"kind": kind, "fastscan_m": m, "nprobe": nprobe, "rerank": rerank,
                                    "ms": 1e3 * seconds, "speedup": exact_s / seconds, "recall": recall})
        del index
    return out


def decide(measured: dict[str, Any]) -> dict[str, Any]:
    """The fastest setting with recall@10 >= RECALL, else the most accurate one."""
    settings = measured["settings"]
    if not settings:
        return {"kind": "ivf_flat", "fastscan_m": 0, "nprobe": 16, "rerank": 1}
    good = [c for c in settings if c["recall"] >= RECALL]
    best = min(good, key=lambda c: c["ms"]) if good else max(settings, key=lambda c: c["recall"])
    return {k: best.get(k, 0) for k in SETTING}


def describe(choice: dict[str, Any], measured: dict[str, Any], cached: bool) -> str:
    best = next(c for c in measured["settings"] if all(c.get(k, 0) == choice[k] for k in SETTING))
    if cached:
        how = "the machine's cached choice, its recall checked"
    elif best["recall"] >= RECALL:
        how = f"measured now, the fastest of {len(measured['settings'])} settings with recall@10 >= {RECALL}"
    else:
        how = f"measured now; none of {len(measured['settings'])} settings reached recall@10 {RECALL}: the most accurate"
    return (f"auto chose {choice['kind']}"
            + (f" PQ{choice['fastscan_m']}x4" if choice["kind"] == "ivf_fastscan" else "")
            + f" nprobe {choice['nprobe']}" + (f" rerank {choice['rerank']}" if choice["kind"] != "ivf_flat" else "")
            + f": {best['ms']:.1f} ms per {QUERIES} queries, {best['speedup']:.0f}x exact "
              f"({measured['exact_ms']:.0f} ms), recall@10 {best['recall']:.3f} ({how}, on "
              f"{measured['keys']:,} of the bank's keys)")


def choose(keys: np.ndarray, spec: IndexSpec) -> tuple[str, dict[str, int], str]:
    """``(kind, {"nprobe", "rerank"}, note)``: this machine's measured choice for ``keys``."""
    key = machine_key(keys.shape[1], spec)
    cache = _read_cache()
    hit = cache.get(key)
    try:
        choice = {"kind": hit["choice"]["kind"], **{k: int(hit["choice"].get(k, 0)) for k in SETTING[1:]}}
    except (TypeError, KeyError, ValueError, AttributeError):
        choice = None  # no entry (or one from another version): measure
    if choice is not None and choice["kind"] in CANDIDATES:
        check = measure(keys, spec, only=choice)
        if check["settings"] and check["settings"][0]["recall"] >= RECALL:
            return choice["kind"], tuned_of(choice), describe(choice, check, True)
        got = check["settings"][0]["recall"] if check["settings"] else float("nan")
        log.info("memory index: the cached auto choice %s reaches recall@10 %.3f on this bank's keys, "
                 "below %.2f; measuring every setting again", choice, got, RECALL)
    measured = measure(keys, spec)
    choice = decide(measured)
    cache[key] = {"choice": choice, "measured": measured,
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        atomic_write_text(cache_file(), json.dumps(cache, indent=1))
    except OSError as e:
        log.warning("memory index: could not cache the auto-index choice in %s (%s)", cache_file(), e)
    note = describe(choice, measured, cached=False)
    log.info("memory index: %s", note)
    return choice["kind"], tuned_of(choice), note


def tuned_of(choice: dict[str, Any]) -> dict[str, int]:
    """The search (and fast-scan build) settings a ``KeyIndex`` takes from a choice."""
    return {k: int(choice[k]) for k in SETTING[1:] if choice[k]}
