"""The instruction-set cap (hieragent/isa.py): a process run under it computes with AVX2
kernels in every library, and what depends on the machine sees the cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hieragent.isa import ISA_CAPS, ISA_ENV, cap_label, capped_env, isa_cap, visible_flags
from hieragent.memory.autotune import machine_key
from hieragent.memory.structures import IndexSpec


def probe(env: dict[str, str], code: str = "from hieragent.isa import kernels; import json; "
                                            "print(json.dumps(kernels()))") -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def bare_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != ISA_ENV}


def test_a_capped_process_computes_with_avx2_kernels_in_every_library():
    got = probe(capped_env("avx2", bare_env()))
    assert got["cap"] == "avx2"
    assert got["aten"] == "AVX2"
    assert got["faiss"] == "AVX2"
    assert got["openblas"] in (["Haswell"], ["unknown (no threadpoolctl)"])
    assert got["precision"] == "32-true"  # AMX and AVX512-BF16 are hidden from the choice


def cpu_vendor() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "unknown")


def test_mkl_runs_its_avx2_kernels_under_the_cap():
    if cpu_vendor() != "GenuineIntel":  # elsewhere its banner says "Intel(R) Architecture processors" only
        pytest.skip(f"MKL names the instruction set it runs only on Intel CPUs; this one is {cpu_vendor()}")
    env = {**capped_env("avx2", bare_env()), "MKL_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", "import torch; a = torch.randn(64, 64); a @ a"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    banner = [line for line in out.stdout.splitlines() if line.startswith("MKL_VERBOSE") and "processors" in line]
    assert banner and "AVX2" in banner[0] and "AVX-512" not in banner[0], out.stdout[:2000]


def test_run_capped_restarts_the_process_under_the_cap_once():
    code = ("import sys; from hieragent.isa import run_capped; print('started', flush=True); "
            "run_capped('avx2', 'hieragent.isa', [])")
    out = subprocess.run([sys.executable, "-c", code], env=bare_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "started" and len(lines) == 2  # the restarted module printed its kernels
    assert json.loads(lines[1])["aten"] == "AVX2"
    # already capped: run_capped returns and the process goes on
    code = "from hieragent.isa import run_capped; run_capped('avx2', 'hieragent.isa', []); print('went on')"
    out = subprocess.run([sys.executable, "-c", code], env=capped_env("avx2", bare_env()), capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.strip() == "went on", out.stderr[-2000:]


def test_the_cap_hides_amx_and_avx512_flags_only(monkeypatch):
    flags = {"fma", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert visible_flags(flags) == flags
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert visible_flags(flags) == {"fma", "avx2"}


def test_an_unknown_cap_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "sse2")
    with pytest.raises(ValueError, match=f"{ISA_ENV}='sse2'.*avx2"):
        isa_cap()
    with pytest.raises(ValueError, match="'sse2'.*avx2"):
        capped_env("sse2")


def test_the_auto_index_cache_keeps_a_capped_machine_apart(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    plain = machine_key(384, IndexSpec())
    monkeypatch.setenv(ISA_ENV, "avx2")
    capped = machine_key(384, IndexSpec())
    assert capped != plain and "capped at avx2" in capped


def test_the_cap_label_names_the_cap_and_on_request_each_variable():
    assert cap_label(None) == "" and cap_label(None, detail=True) == ""
    assert cap_label("avx2") == " capped at avx2"
    detailed = cap_label("avx2", detail=True)
    assert detailed.startswith(" capped at avx2 (")
    for k, v in ISA_CAPS["avx2"][0].items():
        assert f"{k}={v}" in detailed
