"""Which Lightning strategies hieragent runs, checked before anything is built.

* One process (the default), on a CPU or one GPU.
* ``ddp``: several processes, CPU (gloo) or GPU (NCCL), through ``RolloutDDPStrategy``.
  ``trainer.strategy: ddp`` (or ``auto`` with several devices) is turned into it by the
  CLI. It is Lightning's DDP with one change: gradients are not synced per backward pass.
  The update runs one backward pass per role and micro-batch, each touching one adapter,
  and the ranks run different numbers of them; DDP's reducer would either fail at once
  ("parameters that were not used") or, with ``find_unused_parameters``, wait for ever on
  collectives the ranks issue in different numbers. The module sums the gradients itself,
  once per optimizer step (``lightning/distributed.py``).
* FSDP and DeepSpeed are Lightning strategies for CUDA GPUs: without CUDA they fail at start
  for that; with it, because hieragent does not support them yet.

A refusal is one line naming ``trainer.strategy``, before a model is loaded or a folder
written.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import DDPStrategy

from hieragent.lightning.distributed import end_every_rank_on_signal

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


def process_count(devices: Any = "auto", num_nodes: Any = 1) -> int:
    """How many processes ``trainer.devices`` and ``trainer.num_nodes`` ask for."""
    return _count(devices) * _count(num_nodes)


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


# ``ddp`` names (and ``auto`` with several devices) that become ``RolloutDDPStrategy``;
# spawn and fork start methods would pickle the module or fork a process that holds threads
DDP_NAMES = ("ddp", "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true")


def check_strategy(strategy: Any, devices: Any = "auto", num_nodes: Any = 1,
                   cuda: bool | None = None) -> bool:
    """Raise ``ValueError`` (one line) if this strategy cannot run here; return whether the
    run needs ``RolloutDDPStrategy`` (a ``ddp`` name, or several processes)."""
    name = strategy_name(strategy)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for key, label in _CUDA_ONLY.items():
        if name.startswith(key) and not cuda:
            raise ValueError(f"trainer.strategy: {name} is Lightning's {label} strategy and needs CUDA GPUs; "
                             "this machine has none (use ddp, or the default single-process strategy)")
        if name.startswith(key):
            raise ValueError(f"trainer.strategy: {name} ({label}) is not supported yet: it wraps the model and "
                             "syncs gradients per backward pass, and the trainer runs one per role and "
                             "micro-batch; use ddp")
    processes = process_count(devices, num_nodes)
    if name == "rolloutddp":
        return True
    if name.startswith("ddp") and strategy is not None and not isinstance(strategy, str):
        raise ValueError(f"trainer.strategy: Lightning's own {name} strategy syncs gradients per backward "
                         "pass; give `ddp`, or class_path hieragent.strategies.RolloutDDPStrategy")
    if name.startswith("ddp") and name not in DDP_NAMES:
        raise ValueError(f"trainer.strategy: {name} is not supported: use ddp (one process launched per "
                         "device); spawn and fork start methods are not")
    if name not in ("auto", *DDP_NAMES) and processes > 1:
        raise ValueError(f"trainer.strategy: {name} with {processes} processes is not supported: use ddp")
    return name in DDP_NAMES or processes > 1


class RolloutDDPStrategy(DDPStrategy):
    """Lightning's DDP for hieragent's update: no gradient sync per backward pass (the module
    sums gradients once per optimizer step), a timeout on every collective, and SIGTERM or
    Ctrl-C ending every rank at once.

    Args:
        timeout_s: Seconds a collective may wait for the other ranks before it fails with the
            rank and the stage. Ranks roll out between collectives, so this must exceed the
            longest difference in rollout time between ranks.
        **kwargs: Further arguments of Lightning's ``DDPStrategy``.
    """

    def __init__(self, timeout_s: float = 1800.0, **kwargs: Any) -> None:
        if timeout_s <= 0:
            raise ValueError(f"trainer.strategy timeout_s must be > 0, got {timeout_s}")
        kwargs.setdefault("forward_sync_buffers", False)  # no buffer is trained; every rank has the same
        super().__init__(timeout=timedelta(seconds=timeout_s), **kwargs)
        self.timeout_s = timeout_s
        self._stop_watch: Callable[[], None] | None = None

    def setup_environment(self) -> None:
        super().setup_environment()
        self._stop_watch = end_every_rank_on_signal(lambda: list(getattr(self.launcher, "procs", None) or []))

    def teardown(self) -> None:
        super().teardown()
        if self._stop_watch is not None:
            self._stop_watch()
            self._stop_watch = None

    def configure_ddp(self) -> None:
        super().configure_ddp()
        # DDP's reducer would all-reduce during each backward pass; the module does it once
        self.model.require_backward_grad_sync = False

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """No reducer preparation: gradients are summed by the module (see the class doc)."""

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to finish: see ``pre_backward``."""
