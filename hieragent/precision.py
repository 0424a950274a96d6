"""Which Lightning precision fits this machine, when the config does not say.

bf16 is only worth it where the hardware computes in it fast: a CUDA GPU with bf16 units
(Ampere and later), or a CPU with AMX-BF16 tiles (Xeon Sapphire Rapids and later, about 5x
faster than fp32 there). On other CPUs it varies: we have measured bf16 matmuls 300x
slower than fp32 on one without AMX, and 2.2x faster on an AMD EPYC with AVX512-BF16. So a
CPU without AMX but with AVX512-BF16 is measured (a short matmul of each, about a third of
a second) and gets bf16 only where it is clearly faster; any other CPU gets fp32. The
choice is kept in ``HIERAGENT_PRECISION`` for the processes this one starts (DDP ranks),
so that every rank trains in the same precision.

An instruction-set cap (``hieragent.isa``) hides the flags it caps from the choice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from hieragent.isa import visible_flags

BF16_SPEEDUP = 1.5  # bf16 matmul over fp32 matmul needed to pick bf16 on a CPU without AMX
ENV = "HIERAGENT_PRECISION"


def fastest(fn, seconds: float) -> float:
    """The shortest time of one call of ``fn`` over about ``seconds`` of calls, after one
    warm-up call: the least disturbed measurement on a shared machine."""
    fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(dtype: torch.dtype, size: int = 1024, seconds: float = 1.0) -> float:
    """Best GFLOP/s of a square matmul in ``dtype`` on this machine, now."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size ** 3 / fastest(lambda: a @ b, seconds) / 1e9


def matmul_speedup(size: int = 512, seconds: float = 0.15) -> float:
    """Best bf16 matmul rate over best fp32 matmul rate on this CPU, measured now."""
    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        return fastest(lambda: a @ b, seconds)
    return best(torch.float32) / best(torch.bfloat16)


def read_cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags, e.g. ``{"avx512f", "amx_bf16", ...}``.

    ``/proc/cpuinfo`` comes first: it lists what the kernel has enabled, and AMX needs the
    kernel's support as well as the chip's. Where it is absent (macOS, Windows) or has no
    flags line, torch's own CPUID reading (``torch.cpu.get_capabilities``) is used instead.
    """
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 spells it "flags", arm64 "Features"
            return set(value.split())
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.9
    caps = get_capabilities() if get_capabilities else {}
    return {name for name, on in caps.items() if on is True}


def resolve_precision(
    accelerator: object = "auto",
    *,
    cuda: bool | None = None,
    cuda_bf16: bool | None = None,
    cpu_flags: set[str] | None = None,
    bf16_speedup: float | None = None,
) -> tuple[str, str]:
    """A Lightning precision for ``accelerator`` on this machine, and the reason in words.

    ``cuda`` (a CUDA device is present), ``cuda_bf16`` (it has native bf16) and
    ``cpu_flags`` are detected when left as None, and ``bf16_speedup`` (``matmul_speedup``)
    measured when needed; tests pass them in. The accelerator matters because a config may
    pin ``cpu`` on a machine that has a GPU.
    """
    acc = accelerator.lower() if isinstance(accelerator, str) else None
    if acc in ("auto", "gpu", "cuda"):
        if torch.cuda.is_available() if cuda is None else cuda:
            if cuda_bf16 is None:
                # with emulation counted, pre-Ampere GPUs say yes and then run bf16 slowly
                cuda_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
            if cuda_bf16:
                return "bf16-mixed", "CUDA GPU with native bf16"
            return "32-true", "CUDA GPU without native bf16"
        if acc != "auto":
            return "32-true", f"accelerator {acc!r} without a CUDA device"
        acc = "cpu"  # Lightning's "auto" falls back to the CPU here (or to MPS, which has no AMX)
    if acc != "cpu":
        return "32-true", f"accelerator {accelerator!r}: no automatic choice, fp32 is safe"
    flags = visible_flags(read_cpu_flags()) if cpu_flags is None else cpu_flags
    if "amx_bf16" in flags:
        return "bf16-mixed", "CPU with AMX-BF16"
    if "avx512_bf16" in flags:
        speedup = matmul_speedup() if bf16_speedup is None else bf16_speedup
        if speedup >= BF16_SPEEDUP:
            return "bf16-mixed", f"CPU with AVX512-BF16, no AMX: bf16 matmul measured {speedup:.1f}x fp32"
        return "32-true", f"CPU with AVX512-BF16, no AMX: bf16 matmul measured {speedup:.1f}x fp32"
    return "32-true", "CPU without AMX-BF16 or AVX512-BF16: bf16 matmul is slow here"


def machine_precision(accelerator: object = "auto") -> tuple[str, str]:
    """``resolve_precision`` once per run: a process started by this one (a DDP rank)
    inherits the choice through ``HIERAGENT_PRECISION`` instead of measuring again."""
    if os.environ.get(ENV):
        return os.environ[ENV], "chosen by the launching process"
    precision, reason = resolve_precision(accelerator)
    os.environ[ENV] = precision
    return precision, reason


_AUTOCAST = {
    "bf16-mixed": torch.bfloat16,
    "bf16": torch.bfloat16,  # Lightning reads "bf16" as "bf16-mixed"
    "16-mixed": torch.float16,
    "16": torch.float16,  # and 16 or "16" as "16-mixed"
}


def autocast_dtype(precision: str | int | None) -> torch.dtype | None:
    """The dtype for ``torch.autocast`` under a Lightning precision, None for no autocast.

    Only the mixed precisions autocast during training; the acting engine autocasts with
    the same dtype, so that rollout log-probs are computed as the training step computes
    them. "32-true", "64-true", "bf16-true" (weights already in bf16) and None give None.
    """
    return None if precision is None else _AUTOCAST.get(str(precision))


def cast_for(model: torch.nn.Module, precision: str | int | None) -> torch.nn.Module:
    """``model`` in the weights' dtype of a Lightning precision outside a Trainer (the benches):
    bf16 under "bf16-true"; as it is otherwise ("bf16" is "bf16-mixed": fp32 weights)."""
    return model.to(torch.bfloat16) if str(precision) == "bf16-true" else model
