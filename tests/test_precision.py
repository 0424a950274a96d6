"""hieragent/precision.py: the precision each kind of machine gets, and the CLI applying it."""

import csv
import math
import os

import pytest
import torch
import yaml

from cli_helpers import make_workspace, run_cli
from hieragent.precision import (ENV, autocast_dtype, cast_for, machine_precision, matmul_speedup, read_cpu_flags,
                                 resolve_precision)

# Flags as /proc/cpuinfo lists them: a Sapphire Rapids Xeon, and an EPYC with AVX512-BF16 only.
XEON_AMX = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
EPYC_AVX512_BF16 = {"avx2", "avx512f", "avx512_bf16"}
OLD_X86 = {"sse4_2", "avx", "avx2"}


def test_cpu_with_amx_bf16_gets_bf16_mixed():
    assert resolve_precision("cpu", cpu_flags=XEON_AMX)[0] == "bf16-mixed"


@pytest.mark.parametrize("flags", [OLD_X86, set()])
def test_cpu_without_amx_or_avx512_bf16_gets_fp32_without_measuring(flags):
    precision, reason = resolve_precision("cpu", cpu_flags=flags, bf16_speedup=100.0)
    assert precision == "32-true"
    assert "slow" in reason


@pytest.mark.parametrize("speedup,want", [(0.003, "32-true"), (1.2, "32-true"), (2.2, "bf16-mixed")])
def test_cpu_with_avx512_bf16_but_no_amx_goes_by_the_measured_matmul_speedup(speedup, want):
    # 0.003: the machine where bf16 was 300x slower; 2.2: the EPYC this was written on
    precision, reason = resolve_precision("cpu", cpu_flags=EPYC_AVX512_BF16, bf16_speedup=speedup)
    assert precision == want and f"measured {speedup:.1f}x" in reason


def test_the_measured_speedup_is_a_real_ratio_of_two_timings():
    speedup = matmul_speedup(size=128, seconds=0.02)
    assert math.isfinite(speedup) and speedup > 0


def test_a_launched_rank_inherits_the_choice_instead_of_measuring(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    first = machine_precision("cpu")
    assert os.environ[ENV] == first[0]
    monkeypatch.setenv(ENV, "64-true")  # whatever the launcher chose, the rank takes it
    assert machine_precision("cpu") == ("64-true", "chosen by the launching process")


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
    assert resolve_precision("auto", cuda=False, cpu_flags=EPYC_AVX512_BF16, bf16_speedup=0.5)[0] == "32-true"


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
    flags = read_cpu_flags()  # tiny.yaml pins accelerator: cpu
    if "amx_bf16" in flags:
        assert saved == "bf16-mixed"
    elif "avx512_bf16" not in flags:
        assert saved == "32-true"
    else:  # measured in the subprocess
        assert saved in ("32-true", "bf16-mixed")
    lines = [line for line in out.stderr.splitlines() if line.startswith("hieragent: precision")]
    assert len(lines) == 1 and lines[0].startswith(f"hieragent: precision {saved} (")
    assert lines[0].endswith("); set trainer.precision to override")


def test_fit_keeps_a_precision_that_was_given(tmp_path):
    out, saved = _fit_zero_steps(make_workspace(tmp_path), "--trainer.precision", "64-true")
    assert saved == "64-true"
    assert "hieragent: precision" not in out.stderr


def test_a_bf16_mixed_cpu_fit_acts_and_trains_alike(tmp_path):
    """The engine acts under the trainer's autocast: on-policy ratios are 1 in bf16 too."""
    workdir = make_workspace(tmp_path)
    out = run_cli(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "2",
                   "--trainer.precision", "bf16-mixed"], workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(workdir / "lightning_logs/tiny/version_0/metrics.csv")))
    ratios = [float(r[k]) for r in rows for k in ("executor/ratio_max", "executor/ratio_min") if r.get(k)]
    assert len(ratios) == 4 and max(abs(r - 1.0) for r in ratios) < 1e-5


def test_benches_cast_weights_only_under_a_true_precision():
    """Outside a Trainer, "bf16-true" holds bf16 weights; "bf16" is Lightning's bf16-mixed (fp32
    weights, bf16 autocast), as are the fp32 precisions."""
    for precision, dtype in (("bf16-true", torch.bfloat16), ("bf16", torch.float32), ("bf16-mixed", torch.float32),
                             ("32-true", torch.float32), (None, torch.float32)):
        layer = cast_for(torch.nn.Linear(3, 2), precision)
        assert layer.weight.dtype == dtype, precision
