"""hieragent/precision.py: the precision each kind of machine gets, and the CLI applying it."""

import pytest
import torch
import yaml

from cli_helpers import make_workspace, run_cli
from hieragent.precision import autocast_dtype, read_cpu_flags, resolve_precision

# Flags as /proc/cpuinfo lists them: a Sapphire Rapids Xeon, and an EPYC with AVX512-BF16 only.
XEON_AMX = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
EPYC_AVX512_BF16 = {"avx2", "avx512f", "avx512_bf16"}
OLD_X86 = {"sse4_2", "avx", "avx2"}


def test_cpu_with_amx_bf16_gets_bf16_mixed():
    assert resolve_precision("cpu", cpu_flags=XEON_AMX)[0] == "bf16-mixed"


@pytest.mark.parametrize("flags", [EPYC_AVX512_BF16, OLD_X86, set()])
def test_cpu_without_amx_gets_fp32_even_with_avx512_bf16(flags):
    precision, reason = resolve_precision("cpu", cpu_flags=flags)
    assert precision == "32-true"
    assert "slow" in reason


@pytest.mark.parametrize("accelerator", ["auto", "gpu", "cuda"])
def test_cuda_gpu_with_bf16_gets_bf16_mixed(accelerator):
    # the CPU would say fp32; the GPU decides
    got = resolve_precision(accelerator, cuda=True, cuda_bf16=True, cpu_flags=OLD_X86)
    assert got[0] == "bf16-mixed"


def test_cuda_gpu_without_bf16_gets_fp32():
    assert resolve_precision("auto", cuda=True, cuda_bf16=False, cpu_flags=XEON_AMX)[0] == "32-true"


def test_pinned_cpu_accelerator_looks_at_the_cpu_not_the_gpu():
    assert resolve_precision("cpu", cuda=True, cuda_bf16=True, cpu_flags=OLD_X86)[0] == "32-true"
    assert resolve_precision("cpu", cuda=True, cuda_bf16=False, cpu_flags=XEON_AMX)[0] == "bf16-mixed"


def test_auto_without_cuda_falls_back_to_the_cpu():
    assert resolve_precision("auto", cuda=False, cpu_flags=XEON_AMX)[0] == "bf16-mixed"
    assert resolve_precision("auto", cuda=False, cpu_flags=EPYC_AVX512_BF16)[0] == "32-true"


@pytest.mark.parametrize("accelerator", ["mps", "tpu", object()])
def test_other_accelerators_get_fp32(accelerator):
    assert resolve_precision(accelerator, cuda=True, cuda_bf16=True, cpu_flags=XEON_AMX)[0] == "32-true"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512_bf16 amx_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu avx512_bf16 amx_bf16\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx512_bf16", "amx_bf16"}


def test_cpu_flags_fall_back_to_torch_without_cpuinfo(tmp_path):
    flags = read_cpu_flags(tmp_path / "absent")
    caps = torch.cpu.get_capabilities()
    assert flags == {name for name, on in caps.items() if on is True}
    assert ("amx_bf16" in flags) == bool(caps.get("amx_bf16"))


@pytest.mark.parametrize("precision,dtype", [
    ("bf16-mixed", torch.bfloat16), ("bf16", torch.bfloat16),
    ("16-mixed", torch.float16), ("16", torch.float16), (16, torch.float16),
    ("32-true", None), (32, None), ("32", None), ("64-true", None), (64, None),
    ("bf16-true", None), ("16-true", None), (None, None),
])
def test_autocast_dtype_is_set_for_mixed_precision_only(precision, dtype):
    assert autocast_dtype(precision) is dtype


def _fit_zero_steps(workdir, *args):
    """`hieragent fit` on tiny.yaml with no steps: the Trainer is built and the config saved."""
    out = run_cli(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "0", *args], workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = yaml.safe_load((workdir / "lightning_logs/tiny/version_0/config.yaml").read_text())
    return out, saved["trainer"]["precision"]


def test_fit_without_precision_uses_the_resolved_one(tmp_path):
    # tiny.yaml pins 32-true; null is what a config without the key parses to
    out, saved = _fit_zero_steps(make_workspace(tmp_path), "--trainer.precision", "null")
    expected, reason = resolve_precision("cpu")  # tiny.yaml pins accelerator: cpu
    assert saved == expected
    lines = [line for line in out.stderr.splitlines() if line.startswith("hieragent: precision")]
    assert lines == [f"hieragent: precision {expected} ({reason}); set trainer.precision to override"]


def test_fit_keeps_a_precision_that_was_given(tmp_path):
    out, saved = _fit_zero_steps(make_workspace(tmp_path), "--trainer.precision", "64-true")
    assert saved == "64-true"
    assert "hieragent: precision" not in out.stderr
