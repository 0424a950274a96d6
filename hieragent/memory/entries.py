"""The bank's entries as column arrays, kept up to date so that upkeep at a million entries
never passes over all of them.

Each entry has a slot: numeric fields live in numpy columns, texts in lists, and a slot freed
by an eviction is reused by the next add, so the columns never outgrow the largest bank.

  * Adding, removing and crediting an entry cost O(1) (the eviction pool below: O(log P)).
  * **Eviction order** (lowest utility, then oldest, then lowest id) is served from a pool: a
    heap of the ``POOL`` first entries in that order and every entry whose key has since
    fallen below the pool's bound. Adds and credits push into it when their new key is below
    the bound; stale heap items are skipped when popped. Once a quarter of the pool is served
    (or stale items have doubled it), a **scan** refills it ahead of need, ``SCAN`` slots or
    more per eviction call, while the old pool goes on serving: no call pays the whole O(N)
    pass (at 1M entries one pass took up to 130 ms in bench-memory's stall). Keys changed while the scan runs
    are noted and offered to the new pool when it takes over. Only a first fill (done when a
    bank loads, ``fill_pool``) and a pool run dry mid-scan make one full pass. An eviction
    costs O(N / POOL + log POOL) amortised.
  * **Statistics**: sizes by kind, the used count and the sum of used utilities are counters;
    the utility percentiles come from the used entries themselves up to ``SAMPLE`` of them,
    above that from a uniform sample of ``SAMPLE`` (an array of the used slots is kept for it),
    which puts a percentile within about half a percentile point of the exact one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import heapq
import numpy as np

KINDS: tuple[str, ...] = ("skill", "episodic", "lesson")
_STEP_BITS = 40  # eviction order packs (created_step, id) into one int64 while both fit
POOL = 16384  # eviction candidates kept in order
SCAN = 1 << 16  # slots a refill scan reads per eviction call
SAMPLE = 8192  # used entries the percentiles are computed from


class EntryTable:
    """Entry fields by id: kind, text, source, created step, uses, utility, merges."""

    def __init__(self) -> None:
        self._slot: dict[int, int] = {}
        self._free: list[int] = []
        self._id = np.zeros(0, dtype=np.int64)
        self._kind = np.zeros(0, dtype=np.int8)
        self._step = np.zeros(0, dtype=np.int64)
        self._uses = np.zeros(0, dtype=np.int64)
        self._utility = np.zeros(0, dtype=np.float64)
        self._merges = np.zeros(0, dtype=np.int64)
        self._live = np.zeros(0, dtype=bool)
        self._text: list[str] = []
        self._source: list[str] = []
        self.sizes: Counter[str] = Counter({k: 0 for k in KINDS})
        self.used = 0  # entries with uses > 0
        self.utility_sum = 0.0  # over used entries
        self._used_slots = np.zeros(0, dtype=np.int64)  # [:used]: slots of used entries, in any order
        self._used_at = np.zeros(0, dtype=np.int64)  # per slot: its place in _used_slots, or -1
        self._pool: list[tuple[float, int, int]] = []  # heap of (utility, created step, id)
        self._bound: tuple[float, int, int] | None = None  # every live key below it is in the pool
        self._served = 0  # ids the pool has given out since it was filled
        self.passes = 0  # full O(N) passes made (first fills, pools run dry mid-scan)
        self._scan: _Scan | None = None  # a refill under way
        self._rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, entry_id: int) -> bool:
        return int(entry_id) in self._slot

    def slot(self, entry_id: int) -> int:
        try:
            return self._slot[int(entry_id)]
        except KeyError:
            raise KeyError(f"memory bank has no entry with id {int(entry_id)} (evicted or never added)") from None

    # ---- one entry -----------------------------------------------------------------------
    def add(self, entry_id: int, kind: str, text: str, source: str, step: int,
            uses: int = 0, utility: float = 0.0, merges: int = 0) -> None:
        if self._free:
            s = self._free.pop()
        else:
            s = len(self._text)
            if s == len(self._id):
                self._grow(max(64, 2 * s))
            self._text.append("")
            self._source.append("")
        self._slot[int(entry_id)] = s
        self._id[s], self._kind[s], self._step[s] = entry_id, KINDS.index(kind), step
        self._uses[s], self._utility[s], self._merges[s], self._live[s] = uses, utility, merges, True
        self._text[s], self._source[s] = text, source
        self._used_at[s] = -1
        self.sizes[kind] += 1
        if uses > 0:
            self._mark_used(s)
        self._offer(s)

    def remove(self, entry_id: int) -> dict[str, Any]:
        """Drop one entry and return its fields (for the change log)."""
        row = self.get(entry_id)
        s = self._slot.pop(int(entry_id))
        if self._uses[s] > 0:
            self._unmark_used(s)
        self._live[s] = False
        self._text[s] = self._source[s] = ""
        self._free.append(s)
        self.sizes[row["kind"]] -= 1
        return row

    def get(self, entry_id: int) -> dict[str, Any]:
        s = self.slot(entry_id)
        return {"id": int(entry_id), "kind": KINDS[self._kind[s]], "text": self._text[s],
                "source": self._source[s], "created_step": int(self._step[s]), "uses": int(self._uses[s]),
                "utility": float(self._utility[s]), "merges": int(self._merges[s])}

    def kind(self, entry_id: int) -> str:
        return KINDS[self._kind[self.slot(entry_id)]]

    def text(self, entry_id: int) -> str:
        return self._text[self.slot(entry_id)]

    def set_text(self, entry_id: int, text: str) -> None:
        self._text[self.slot(entry_id)] = text

    def utility(self, entry_id: int) -> float:
        """Running utility; 0 for an id not (or no longer) held."""
        s = self._slot.get(int(entry_id))
        return 0.0 if s is None else float(self._utility[s])

    def merged(self, entry_id: int) -> None:
        self._merges[self.slot(entry_id)] += 1

    def credit(self, ids: Iterable[int], episode_return: float) -> None:
        """One more use for each held id (once however often it is listed), and the return
        folded into its running mean."""
        held = [s for s in map(self._slot.get, dict.fromkeys(map(int, ids))) if s is not None]
        if not held:
            return
        slots = np.asarray(held, dtype=np.int64)
        for s in slots[self._uses[slots] == 0].tolist():
            self._mark_used(s)
        old = self._utility[slots]
        self._uses[slots] += 1
        self._utility[slots] = old + (float(episode_return) - old) / self._uses[slots]
        self.utility_sum += float((self._utility[slots] - old).sum())
        for s in held:
            self._offer(s)

    # ---- eviction order ------------------------------------------------------------------
    def _key(self, s: int) -> tuple[float, int, int]:
        return float(self._utility[s]), int(self._step[s]), int(self._id[s])

    def _offer(self, s: int) -> None:
        """Push slot ``s``'s (new) key into the pool if it falls below the bound (and note it
        for the scan under way, whose new bound is not known yet)."""
        if self._scan is not None:
            self._scan.touched.add(s)
        if self._bound is not None and (key := self._key(s)) <= self._bound:
            heapq.heappush(self._pool, key)

    def lowest(self, count: int) -> list[int]:
        """The ``count`` ids first by (utility, created step, id): the eviction order."""
        self._advance(count)
        out: list[int] = []
        taken: set[int] = set()
        count = min(count, len(self))
        while len(out) < count:
            if not self._pool:
                self._refill(taken)
                if not self._pool:
                    break
            u, step, i = heapq.heappop(self._pool)
            s = self._slot.get(i)
            if s is not None and i not in taken and self._key(s) == (u, step, i):  # else stale
                out.append(i)
                taken.add(i)
        self._served += len(out)
        if self._scan is not None:
            self._scan.served += len(out)
        for i in out:  # the caller removes them, or they go back
            s = self._slot[i]
            heapq.heappush(self._pool, self._key(s))
        if len(self._pool) > 4 * POOL:  # stale items pile up faster than scans clear them: start afresh
            self._pool, self._bound, self._scan = [], None, None
        return out

    def fill_pool(self) -> None:
        """Fill the eviction pool now (one O(N) pass), so that the first eviction does not."""
        if self._bound is None and len(self):
            self._refill(set())

    def _advance(self, count: int) -> None:
        """Start a refill scan where a quarter of the pool is served or stale items have doubled
        it (and a bound exists: a first fill is one pass), and move the scan under way on:
        ``SCAN`` slots, or more where it would not end before calls of ``count`` evictions serve
        another eighth of the pool. Ids served during a scan are stale in the pool it makes."""
        if self._scan is None:
            if self._bound is None or not (4 * self._served >= POOL or len(self._pool) > 2 * POOL):
                return
            if self._bound[0] == float("inf"):  # every entry is in the pool already
                return
            self._scan = _Scan(len(self._text))
        scan = self._scan
        calls = max(1, POOL // (8 * max(count, 1)))
        end = min(scan.pos + max(SCAN, -(-(scan.end - scan.pos) // calls)), scan.end)
        slots = np.flatnonzero(self._live[scan.pos:end]) + scan.pos
        u = np.concatenate([scan.u, self._utility[slots]])
        step = np.concatenate([scan.step, self._step[slots]])
        ids = np.concatenate([scan.ids, self._id[slots]])
        best = first_keys(u, step, ids, min(POOL, len(u)))
        scan.u, scan.step, scan.ids, scan.pos = u[best], step[best], ids[best], end
        if scan.pos == scan.end:
            self._take_scan(scan)

    def _take_scan(self, scan: _Scan) -> None:
        """The finished scan's keys become the pool; keys changed meanwhile join it where they
        fall below its new bound."""
        self._scan = None
        pool = list(zip(scan.u.tolist(), scan.step.tolist(), scan.ids.tolist()))  # sorted: already a heap
        bound = pool[-1] if len(pool) == POOL else (float("inf"), 0, 0)
        for s in scan.touched:
            if self._live[s] and (key := self._key(s)) <= bound:
                heapq.heappush(pool, key)
        self._pool, self._bound, self._served = pool, bound, scan.served

    def _refill(self, taken: set[int]) -> None:
        """One O(N) pass: the ``POOL`` first live entries (not in ``taken``) in eviction order."""
        self._scan, self._served = None, 0
        self.passes += 1
        live = self._live[: len(self._text)]
        if taken:  # by slot: np.isin over every live id took ~80 ms at 1M entries
            live = live.copy()
            live[[self._slot[i] for i in taken]] = False
        slots = np.flatnonzero(live)
        first = slots[first_keys(self._utility[slots], self._step[slots], self._id[slots], min(POOL, len(slots)))]
        self._pool = [self._key(s) for s in first.tolist()]  # sorted: already a heap
        if not self._pool:
            self._bound = None
        elif len(first) == len(slots):
            self._bound = (float("inf"), 0, 0)  # every entry is in the pool: so is every new one
        else:
            self._bound = self._pool[-1]

    # ---- statistics ----------------------------------------------------------------------
    def _mark_used(self, s: int) -> None:
        self._used_at[s] = self.used
        self._used_slots[self.used] = s
        self.used += 1
        self.utility_sum += float(self._utility[s])

    def _unmark_used(self, s: int) -> None:
        at, last = int(self._used_at[s]), int(self._used_slots[self.used - 1])
        if last != s:  # swap-remove: the last slot takes its place
            self._used_slots[at] = last
            self._used_at[last] = at
        self._used_at[s] = -1
        self.used -= 1
        self.utility_sum -= float(self._utility[s])

    def stats(self) -> dict[str, float]:
        """Size by kind and the utility distribution of used entries, without a pass over all."""
        n = len(self)
        out = {"bank/size": float(n), **{f"bank/size_{k}": float(self.sizes[k]) for k in KINDS}}
        out["bank/used_fraction"] = self.used / n if n else 0.0
        if self.used:
            if self.used <= SAMPLE:
                slots = self._used_slots[: self.used]
            else:
                slots = self._used_slots[self._rng.integers(0, self.used, SAMPLE)]
            p10, p50, p90 = np.percentile(self._utility[slots], (10, 50, 90))
            out.update({"bank/utility_p10": float(p10), "bank/utility_p50": float(p50),
                        "bank/utility_p90": float(p90), "bank/utility_mean": self.utility_sum / self.used})
        return out

    def columns(self, ids: Iterable[int]) -> dict[str, list]:
        """The fields of ``ids`` as lists, in that order (for persistence)."""
        slots = np.array([self.slot(i) for i in ids], dtype=np.int64)
        return {"kinds": [KINDS[k] for k in self._kind[slots]], "texts": [self._text[s] for s in slots],
                "sources": [self._source[s] for s in slots], "created_steps": self._step[slots].tolist(),
                "uses": self._uses[slots].tolist(), "utilities": self._utility[slots].tolist(),
                "merges": self._merges[slots].tolist()}

    def _grow(self, cap: int) -> None:
        for name in ("_id", "_kind", "_step", "_uses", "_utility", "_merges", "_live", "_used_at", "_used_slots"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)


class _Scan:
    """A refill in progress: slots ``[0, pos)`` of ``[0, end)`` read; the best ``POOL`` keys
    among them (as read); the slots whose keys changed since it began; the ids served since."""

    def __init__(self, end: int) -> None:
        self.pos, self.end, self.served = 0, end, 0
        self.u = np.zeros(0, dtype=np.float64)
        self.step = np.zeros(0, dtype=np.int64)
        self.ids = np.zeros(0, dtype=np.int64)
        self.touched: set[int] = set()


def first_keys(u: np.ndarray, step: np.ndarray, ids: np.ndarray, count: int) -> np.ndarray:
    """Positions of the ``count`` keys first by (utility, step, id), sorted."""
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    # a sort, not np.partition: with most utilities tied at the k-th value (unused entries at 0),
    # partition took 11.5 ms over 82k keys and sort 0.9 (numpy 2.4's SIMD sort; a probe on the
    # 2-core EPYC, outside the repo); at 1M keys sort takes about 11 ms either way
    kth = np.sort(u)[count - 1]
    below, tie = np.flatnonzero(u < kth), np.flatnonzero(u == kth)
    need = count - len(below)
    if need < len(tie):  # break the tie at the boundary by (created step, id), still in O(N)
        steps, tids = step[tie], ids[tie]
        if steps.min() >= 0 and steps.max() < 2 ** (63 - _STEP_BITS) and tids.max() < 2 ** _STEP_BITS:
            order = np.argpartition((steps << _STEP_BITS) | tids, need - 1)[:need]
        else:
            order = np.lexsort((tids, steps))[:need]
        tie = tie[order]
    chosen = np.concatenate([below, tie[:need]])
    return chosen[np.lexsort((ids[chosen], step[chosen], u[chosen]))]
