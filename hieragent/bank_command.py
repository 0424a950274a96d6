"""``hieragent bank``: list, search and export the skill bank of a checkpoint.

    hieragent bank list   --ckpt_path last.ckpt [--sort utility|uses|created|id] [--limit 20]
    hieragent bank search --ckpt_path last.ckpt --query "go to the red ball" [--k 5]
    hieragent bank export --ckpt_path last.ckpt --out bank.jsonl

``list`` and ``search`` print a table; ``export`` writes every entry as one JSON line
(id, kind, text, source, created_step, uses, utility, merges), atomically. Search embeds
the query with the bank's own frozen encoder, without the trained query adapter: it shows
what the keys are near, not what the planner would pick.

A command, so it sits beside ``cli.py``: it reads checkpoints (``lightning``), which
``memory`` itself must not import.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hieragent.io import write_jsonl
from hieragent.memory.bank import MemoryBank

SORT_KEYS = {"utility": lambda e: -e["utility"], "uses": lambda e: -e["uses"],
             "created": lambda e: -e["created_step"], "id": lambda e: e["id"]}


def bank_from_checkpoint(path: str | Path) -> MemoryBank:
    """The bank saved in a hieragent checkpoint; clear errors for a missing or foreign file."""
    from hieragent.lightning.state import read_checkpoint  # torch loads only when a command runs

    state = read_checkpoint(path, "hieragent bank").get("hieragent", {}).get("bank")
    if state is None:
        raise ValueError(f"checkpoint '{path}' holds no memory bank (a run with model.memory.enabled: "
                         "false, or not a hieragent checkpoint)")
    return MemoryBank.from_state(state)


def entries(bank: MemoryBank) -> list[dict[str, Any]]:
    return [bank.entry(i) for i in bank.ids()]


def _table(rows: list[dict[str, Any]], title: str, score: list[float] | None = None) -> Table:
    table = Table(title=title)
    columns = ["id", "kind", "uses", "utility", "created", "merges", "text"]
    if score is not None:
        columns.insert(0, "cosine")
    for col in columns:
        table.add_column(col, justify="left" if col in ("kind", "text") else "right",
                         overflow="fold")
    for j, e in enumerate(rows):
        cells = [str(e["id"]), e["kind"], str(e["uses"]), f"{e['utility']:.3f}", str(e["created_step"]),
                 str(e["merges"]), e["text"]]
        if score is not None:
            cells.insert(0, f"{score[j]:.3f}")
        table.add_row(*cells)
    return table


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="hieragent bank", description="Inspect a checkpoint's skill bank.")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("list", "search", "export"):
        s = sub.add_parser(name)
        s.add_argument("--ckpt_path", required=True, help="a checkpoint written by hieragent fit")
        if name == "list":
            s.add_argument("--sort", choices=sorted(SORT_KEYS), default="utility")
            s.add_argument("--limit", type=int, default=20)
            s.add_argument("--kind", default=None, help="only entries of this kind")
        if name == "search":
            s.add_argument("--query", required=True)
            s.add_argument("--k", type=int, default=5)
        if name == "export":
            s.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    a = p.parse_args(argv)
    bank = bank_from_checkpoint(a.ckpt_path)
    console = Console(width=max(Console().width, 120))
    if a.command == "list":
        rows = [e for e in entries(bank) if a.kind is None or e["kind"] == a.kind]
        rows = sorted(rows, key=SORT_KEYS[a.sort])[: a.limit]
        console.print(_table(rows, f"{len(bank)} entries, by {a.sort} (first {len(rows)})"))
    elif a.command == "search":
        ids, scores = bank.search(bank.embed([a.query]), a.k)
        rows = [bank.entry(i) for i in ids[0]]
        console.print(_table(rows, f"nearest to {a.query!r}", [float(s) for s in scores[0]]))
    else:
        rows = entries(bank)
        write_jsonl(rows, a.out)
        print(f"{len(rows)} entries written to {a.out}")
