"""A bank on disk: ``keys.npy``, ``entries.jsonl``, ``meta.json`` and, for approximate index
kinds, ``index.npy`` (the built FAISS index as bytes) with ``index_rows.npy`` (the id of each
of its rows, -1 where removed). Plain files, no pickle.

Writes are atomic: everything goes to a temporary directory beside the target, is fsynced,
and is renamed over it; the old bank is moved aside first and restored if the swap fails,
so a crash at any point leaves the last good bank readable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hieragent.io import iter_jsonl, scratch_dir, swap_dir, write_synced

if TYPE_CHECKING:
    from hieragent.memory.bank import MemoryBank

# state-dict columns and the entries.jsonl field each is written as
COLUMNS = {"kinds": "kind", "texts": "text", "sources": "source", "created_steps": "created_step",
           "uses": "uses", "utilities": "utility", "merges": "merges"}
META_KEYS = ("format_version", "embedder", "dim", "capacity", "merge_threshold", "next_id", "events", "index")


def save_bank(bank: MemoryBank, path: str | Path) -> None:
    path = Path(path)
    with scratch_dir(path) as tmp:
        _write_files(bank.state_dict(), tmp)
        swap_dir(tmp, path)


def _write_files(state: dict[str, Any], folder: Path) -> None:
    write_synced(folder / "keys.npy", lambda f: np.save(f, state["keys"].numpy(), allow_pickle=False), True)
    names = ("id", *COLUMNS.values())
    cols = [state["ids"].tolist(), *(state[c] for c in COLUMNS)]
    lines = "".join(json.dumps(dict(zip(names, row))) + "\n" for row in zip(*cols))
    write_synced(folder / "entries.jsonl", lambda f: f.write(lines))
    index_state = state["index_state"]
    if index_state["faiss"] is not None:
        blob, rows = index_state["faiss"].numpy(), index_state["rows"].numpy()
        write_synced(folder / "index.npy", lambda f: np.save(f, blob, allow_pickle=False), True)
        write_synced(folder / "index_rows.npy", lambda f: np.save(f, rows, allow_pickle=False), True)
    meta = {k: state[k] for k in META_KEYS}
    meta["index_state"] = {k: index_state.get(k) for k in ("active", "trained_at", "tuned")}
    write_synced(folder / "meta.json", lambda f: json.dump(meta, f, indent=1))


def load_bank(path: str | Path, cls: type[MemoryBank]) -> MemoryBank:
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"no memory bank at {path} (expected keys.npy, entries.jsonl, meta.json)")
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        keys = np.load(path / "keys.npy", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"memory bank at {path} cannot be read: {e}") from e
    rows = [obj for _, obj in iter_jsonl(path / "entries.jsonl")]
    index_state = dict(meta.get("index_state") or {})
    if (path / "index.npy").is_file() and (path / "index_rows.npy").is_file():
        index_state["faiss"] = torch.from_numpy(np.load(path / "index.npy", allow_pickle=False))
        index_state["rows"] = torch.from_numpy(np.load(path / "index_rows.npy", allow_pickle=False))
    state = {
        **meta,
        "ids": torch.tensor([r["id"] for r in rows], dtype=torch.int64),
        "keys": torch.from_numpy(keys),
        **{c: [r[f] for r in rows] for c, f in COLUMNS.items()},
        "index_state": index_state,
    }
    try:
        return cls.from_state(state)
    except (KeyError, ValueError) as e:
        raise ValueError(f"memory bank at {path} cannot be read: {e}") from e
