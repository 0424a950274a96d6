"""The prepared GPU check of training across processes, run on CPU processes (gloo)."""

import json

import pytest

from hieragent.bench.ddp_check import main


def test_ddp_check_on_two_cpu_processes_matches_one_process_and_reports_the_refusals(tmp_path, capsys):
    out = tmp_path / "ddp_check.json"
    main(["--accelerator", "cpu", "--devices", "2", "--steps", "2", "--out", str(out)])
    rows = {row["run"]: row for row in json.loads(out.read_text())}
    one, ddp = rows["one_process"], rows["ddp"]
    assert one["processes"] == 1 and ddp["processes"] == 2 and ddp["device"] == "cpu"
    assert ddp["ranks_identical"] is True
    assert ddp["max_param_diff"] <= 1e-5
    assert one["max_lora_b"] > 1e-4 and ddp["max_lora_b"] > 1e-4  # training did move the adapters
    assert one["step_s_median"] > 0 and ddp["peak_mb"] > 0
    for strategy in ("fsdp", "deepspeed_stage_2"):
        assert "needs CUDA GPUs" in rows[strategy]["refused"]
    printed = capsys.readouterr().out
    assert "ranks identical" in printed and "needs CUDA GPUs" in printed


def test_ddp_check_on_a_gpu_needs_one():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--accelerator", "gpu"])
