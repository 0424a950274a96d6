"""Which Lightning strategies hieragent can run here, checked before anything is built.

A strategy that cannot run on this machine, or that hieragent does not support yet, fails at
start with one line that names ``trainer.strategy`` and says what it needs, before a model
is loaded or a log folder written:

* FSDP and DeepSpeed are Lightning strategies for CUDA GPUs; on a machine without CUDA they
  are refused for that, and on one with CUDA because, like DDP, they are not supported yet.
* Several processes (``ddp`` and its variants, or ``trainer.devices`` / ``num_nodes`` above 1)
  are refused for now. The trainer's update runs one backward pass per role and micro-batch,
  each touching one adapter, so DDP's reducer either fails at once ("parameters that were
  not used") or, with ``find_unused_parameters``, waits forever on collectives that the
  ranks issue in different numbers. The bank and the replay buffer would also drift apart
  per rank. The README's "One process, for now" says what the multi-process path needs.
"""

from __future__ import annotations

from typing import Any

import torch

_CUDA_ONLY = {"fsdp": "FSDP", "deepspeed": "DeepSpeed"}


def strategy_name(strategy: Any) -> str:
    """A short lower-case name for a ``trainer.strategy`` value: a registry name (``"ddp"``,
    ``"deepspeed_stage_2"``), a strategy object, or a ``class_path`` config."""
    if strategy is None:
        return "auto"
    if isinstance(strategy, str):
        return strategy.lower()
    path = strategy.get("class_path") if hasattr(strategy, "get") else type(strategy).__name__
    return str(path).rsplit(".", 1)[-1].lower().removesuffix("strategy")


def _count(value: Any) -> int:
    """How many devices a ``trainer.devices`` value asks for (``auto``/-1: unknown, taken as 1)."""
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str):
        value = value.strip()
        if "," in value:
            return len([v for v in value.split(",") if v.strip()])
        return int(value) if value.lstrip("-").isdigit() else 1
    return int(value) if isinstance(value, int) and value > 0 else 1


def check_strategy(strategy: Any, devices: Any = "auto", num_nodes: Any = 1,
                   cuda: bool | None = None) -> None:
    """Raise ``ValueError`` (one line) if this strategy and device count cannot run here."""
    name = strategy_name(strategy)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for key, label in _CUDA_ONLY.items():
        if name.startswith(key) and not cuda:
            raise ValueError(f"trainer.strategy: {name} is Lightning's {label} strategy and needs CUDA GPUs; "
                             "this machine has none (use the default single-process strategy here)")
        if name.startswith(key):
            raise ValueError(f"trainer.strategy: {name} ({label}) is not supported yet: it wraps the model and "
                             "syncs gradients per backward pass, and the trainer runs one per role and "
                             "micro-batch; use the default single-process strategy")
    processes = _count(devices) * _count(num_nodes)
    if name.startswith("ddp") or processes > 1:
        raise ValueError(f"trainer.strategy: {name} with {processes} process(es): training across processes is "
                         "not supported yet (the per-role backward passes need their own gradient sync, and "
                         "the bank and replay buffer are per process); run one process "
                         "(trainer.devices 1, the default strategy)")
