"""What a hieragent checkpoint holds beyond Lightning's own, and how it is read back.

The module's ``state_dict`` keeps the trainable parts only (LoRA adapters, query adapter,
value head: ``TRAINABLE_MARKERS``); ``checkpoint["hieragent"]`` adds the bank, the bank's
evolution state, the replay buffer and the RNG states, all weights-only loadable.

Across processes the bank, the adapters and the optimizer state are the same on every rank,
and rank 0 writes them. Each rank's replay buffer holds its own episodes, so the checkpoint
keeps every rank's (``replay_ranks``); a run resumed on another number of ranks deals the
batches out round-robin.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hieragent.lightning.distributed import distributed, gather_objects, world

TRAINABLE_MARKERS = ("lora_", "planner.query_adapter.", "value_head.")


def read_checkpoint(path: str | Path, what: str) -> dict[str, Any]:
    """``torch.load`` a Lightning checkpoint; a missing, torn or foreign file is a one-line
    error that starts with ``what`` (the option or command that named the file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}: checkpoint '{path}' does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # say which file, not a pickle trace
        raise ValueError(f"{what}: '{path}' is not a readable checkpoint ({err})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{what}: '{path}' has no state_dict; is it a Lightning checkpoint?")
    return checkpoint


def rng_state() -> dict[str, Any]:
    """torch, numpy and Python RNG states as tensors and plain types (weights-only loadable)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    version, python_state, python_gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": list(python_state),
            "python_pos": python_gauss}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate((3, tuple(state["python"]), state["python_pos"]))


class CheckpointHooks:
    """The checkpoint hooks of ``HierAgentModule`` (a mixin: it uses the module's bank,
    evolution and replay buffer)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if not any(m in k for m in TRAINABLE_MARKERS)]:
            del state[key]
        replay = self.replay.state_dict()
        checkpoint["hieragent"] = {
            "bank": self.bank.state_dict() if self.bank is not None else None,
            "replay": replay,
            "evolution": self.evolution.state_dict() if self.evolution is not None else None,
            "rng": rng_state(),
            "env_steps": self.env_steps,
        }
        if distributed():  # every rank's buffer; "replay" above is rank 0's
            checkpoint["hieragent"]["replay_ranks"] = gather_objects(replay, "checkpoint replay buffers")

    def load_weights(self, path: str) -> None:
        """Adapters, query adapter and bank from checkpoint ``path`` (``model.init_from``), or
        from a folder written by ``hieragent export``."""
        from hieragent.lightning.export import is_export, load_export  # export reads checkpoints

        if is_export(path):
            load_export(self, path)
            return
        checkpoint = read_checkpoint(path, "model.init_from")
        self._check_adapters(checkpoint, f"model.init_from '{path}'")
        self.load_state_dict(checkpoint["state_dict"], strict=False)
        bank = checkpoint.get("hieragent", {}).get("bank")
        if self.bank is not None and bank is not None:
            self.bank.load_state_dict(bank)

    def _check_adapters(self, checkpoint: dict[str, Any], what: str) -> None:
        expected = {k for k in self.state_dict() if any(m in k for m in TRAINABLE_MARKERS)}
        missing = sorted(expected - set(checkpoint.get("state_dict", {})))
        if missing:
            raise ValueError(f"{what} lacks {len(missing)} adapter weights this model expects "
                             f"(first: {missing[0]}); was it written with another model or lora "
                             "config?")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._check_adapters(checkpoint, "checkpoint")
        extra = checkpoint.get("hieragent", {})
        if self.bank is not None and extra.get("bank") is not None:
            self.bank.load_state_dict(extra["bank"])
        if self.evolution is not None and extra.get("evolution") is not None:
            self.evolution.load_state_dict(extra["evolution"])
        if extra.get("replay") is not None:
            self.replay.load_state_dict(replay_share(extra.get("replay_ranks") or [extra["replay"]]))
        if extra.get("rng"):
            restore_rng(extra["rng"])
        self.env_steps = int(extra.get("env_steps", 0))


def replay_share(states: list[dict[str, Any]], rank: int | None = None, size: int | None = None) -> dict[str, Any]:
    """This rank's replay buffer from the saved ranks' buffers: its own when the number of
    ranks is unchanged, else every ``size``-th batch of all of them, oldest first (``rank``
    and ``size``: this process's, by default)."""
    if rank is None or size is None:
        rank, size = world()
    if len(states) == size:
        return states[rank]
    batches = sorted((b for s in states for b in s["batches"]), key=lambda b: int(b["policy_version"]))
    return {"batches": batches[rank::size],
            "dropped_turns": sum(int(s["dropped_turns"]) for s in states) if rank == 0 else 0}
