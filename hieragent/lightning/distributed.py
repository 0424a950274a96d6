"""The few collectives a multi-process run needs, each named by the stage that calls it.

Under ``trainer.strategy: ddp`` (``strategies.RolloutDDPStrategy``) every rank plays its own
whole groups and runs its own backward passes, one per role and micro-batch, with DDP's
per-backward gradient sync switched off. The update then meets the other ranks exactly
three times, whatever its episodes (``HierAgentModule._update``):

  1. ``update counts``: the tokens (or sequences) each loss is normalised by, summed, so
     that N ranks take the step one process takes on the same episodes;
  2. ``update stats``: whether any rank must skip the step, which parameters got gradients
     anywhere, and the clipping sums of the normalization;
  3. ``gradients``: one all-reduce of the summed gradients of every trainable parameter
     (skipped on every rank together).

Nothing here runs per micro-batch, so ranks may hold different numbers of turns. In one
process every function returns its input. A collective that fails or times out (the
strategy's ``timeout_s``) raises an error naming the rank and the stage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def distributed() -> bool:
    return world()[1] > 1


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Re-raise a failed or timed-out collective with the rank and the stage it was in."""
    try:
        yield
    except RuntimeError as err:
        rank, size = world()
        raise RuntimeError(f"rank {rank} of {size}: the collective of stage '{name}' failed or timed out "
                           f"(trainer.strategy timeout_s); another rank crashed, hangs, or ran other "
                           f"collectives: {err}") from err


def _device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo CPU ones
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: Sequence[float] | torch.Tensor, name: str) -> torch.Tensor:
    """The element-wise sum over ranks, ``[n]`` float64 on CPU."""
    local = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if not distributed():
        return local
    with stage(name):
        out = local.to(_device(), copy=True)  # the caller's tensor stays as it was
        dist.all_reduce(out)
    return out.cpu()


def gather_objects(obj: Any, name: str) -> list[Any]:
    """Every rank's ``obj``, in rank order (this rank's own object at its place, not a copy)."""
    rank, size = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    with stage(name):
        dist.all_gather_object(out, obj)
    out[rank] = obj
    return out


def sum_gradients(params: Sequence[torch.nn.Parameter], name: str = "gradients") -> None:
    """Replace each gradient by its sum over ranks, in one all-reduce.

    Every rank passes the same parameters in the same order; a parameter without a gradient
    here takes part with zeros. The caller decides beforehand (``update stats``) which
    parameters keep ``None`` because no rank touched them.
    """
    if not distributed() or not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    with stage(name):
        out = flat.to(_device())  # torch.cat made a fresh tensor
        dist.all_reduce(out)
    out = out.to(flat.device)
    at = 0
    for p in params:
        n = p.numel()
        p.grad = out[at:at + n].view_as(p).clone()
        at += n


def end_every_rank_on_signal(children: Callable[[], list]) -> Callable[[], None]:
    """SIGTERM or Ctrl-C ends this rank at once, and the ranks it launched, until the returned
    function is called.

    A rank blocked in a collective never returns to Python, so no Python signal handler
    (Lightning's included) would run until the collective times out. The interpreter's C
    handler still writes the signal's number to a wakeup pipe; a thread reading it sends
    SIGTERM to ``children()`` (the processes this rank launched) and exits. Checkpoints are
    written atomically, so nothing is torn.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    watching = threading.Event()
    watching.set()

    def on_sigterm(signum, frame) -> None:
        # a Python handler, so that the wakeup pipe is written; the thread acts while it
        # watches, and afterwards (Lightning may reinstall this handler) SIGTERM is as usual
        if not watching.is_set():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, on_sigterm)
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        while data := os.read(read, 64):
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    for proc in children():
                        with contextlib.suppress(Exception):
                            proc.send_signal(signal.SIGTERM)
                    os._exit(128 + signum)
        os.close(read)

    threading.Thread(target=watch, name="hieragent-signal-watch", daemon=True).start()

    def stop() -> None:
        watching.clear()
        signal.set_wakeup_fd(previous)
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.close(write)  # the thread reads end-of-file and returns

    return stop


def log_dir(trainer) -> str | None:
    """``trainer.log_dir`` without its broadcast: that property is a collective, which hangs
    when only rank 0 asks (as it does before writing a file)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not trainer.loggers:
        return trainer.default_root_dir
    logger = trainer.loggers[0]
    return logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir
