"""Measuring as a machine without AMX or AVX-512.

``HIERAGENT_ISA=avx2`` (``capped_env``) makes a machine with AMX and AVX-512 compute as one
without them, for benchmarks that must hold on both kinds: each library that picks its
kernels from the CPU reads its own cap when it loads (MKL for torch's fp32 matmul, oneDNN
for its bf16 matmul, ATen's vector kernels, OpenBLAS for numpy and FAISS's BLAS, FAISS's
SIMD dispatch), and the precision choice (``hieragent.precision``) no longer sees the capped
flags. The caches, memory and clock stay the machine's own, so it is a proxy for another
machine, not one. ``make bench-memory BENCH_ARGS='--isa avx2'`` measures under it.
"""

from __future__ import annotations

import os
import sys

ISA_ENV = "HIERAGENT_ISA"
# per cap: each library's own variable, and the prefixes of the CPU flags it hides
ISA_CAPS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
              "OPENBLAS_CORETYPE": "Haswell", "FAISS_SIMD_LEVEL": "AVX2"}, ("amx", "avx512")),
}


def _known(isa: str, where: str) -> str:
    if isa not in ISA_CAPS:
        raise ValueError(f"{where}={isa!r}: expected an instruction-set cap, one of {sorted(ISA_CAPS)}")
    return isa


def isa_cap() -> str | None:
    """The instruction-set cap this process runs under (``HIERAGENT_ISA``), None for none."""
    isa = os.environ.get(ISA_ENV) or None
    return None if isa is None else _known(isa, ISA_ENV)


def cap_label(isa: str | None, detail: bool = False) -> str:
    """`` capped at avx2`` for a machine's name ('' uncapped); ``detail`` adds the variables set."""
    if isa is None:
        return ""
    vars_ = f" ({', '.join(f'{k}={v}' for k, v in ISA_CAPS[isa][0].items())})" if detail else ""
    return f" capped at {isa}{vars_}"


def capped_env(isa: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with every library capped at ``isa``."""
    _known(isa, "isa")
    return {**(os.environ if base is None else base), **ISA_CAPS[isa][0], ISA_ENV: isa}


def run_capped(isa: str, module: str, argv: list[str]) -> None:
    """Return at once if this process already runs capped at ``isa``; otherwise replace it
    with ``python -m module *argv`` under the cap (the libraries read their caps on load)."""
    env = capped_env(isa)
    if all(os.environ.get(k) == env[k] for k in (*ISA_CAPS[isa][0], ISA_ENV)):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def visible_flags(flags: set[str]) -> set[str]:
    """``flags`` less those the process's instruction-set cap hides."""
    isa = isa_cap()
    return flags if isa is None else {f for f in flags if not f.startswith(ISA_CAPS[isa][1])}


def kernels() -> dict[str, object]:
    """What each library computes with in this process: ``python -m hieragent.isa``."""
    import torch  # before faiss, as training has them (memory/openmp.py)

    import faiss

    from hieragent.precision import resolve_precision

    try:  # comes with scikit-learn (sentence-transformers' dependency)
        from threadpoolctl import threadpool_info
        blas = sorted({str(p.get("architecture")) for p in threadpool_info() if p["internal_api"] == "openblas"})
    except ImportError:
        blas = ["unknown (no threadpoolctl)"]
    return {"cap": isa_cap(), "aten": torch.backends.cpu.get_cpu_capability(),
            "faiss": faiss.SIMDConfig.get_level_name(), "openblas": blas, "precision": resolve_precision("cpu")[0]}


if __name__ == "__main__":
    import json

    print(json.dumps(kernels()))
