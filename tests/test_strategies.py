"""Strategies that cannot run here fail at start, in one line naming ``trainer.strategy``,
before a model is loaded or a folder written."""

import pytest
import torch

from cli_helpers import make_workspace, run_cli
from hieragent.strategies import check_strategy, strategy_name


@pytest.mark.parametrize("strategy,devices,nodes,ok", [
    ("auto", "auto", 1, True), (None, 1, 1, True), ("single_device", "1", 1, True),
    ("ddp", 2, 1, False), ("ddp", 1, 1, False), ("ddp_spawn", 2, 1, False),
    ("ddp_find_unused_parameters_true", 2, 1, False), ("auto", 2, 1, False), ("auto", "0,1", 1, False),
    ("auto", [0, 1], 1, False), ("auto", 1, 2, False),
])
def test_one_process_runs_and_several_are_refused_for_now(strategy, devices, nodes, ok):
    if ok:
        check_strategy(strategy, devices, nodes, cuda=False)
        return
    with pytest.raises(ValueError, match=r"^trainer\.strategy: .*not supported yet.*run one process"):
        check_strategy(strategy, devices, nodes, cuda=False)


@pytest.mark.parametrize("strategy,label", [
    ("fsdp", "FSDP"), ("deepspeed", "DeepSpeed"), ("deepspeed_stage_2", "DeepSpeed"),
    ({"class_path": "lightning.pytorch.strategies.FSDPStrategy"}, "FSDP"),
])
def test_fsdp_and_deepspeed_need_cuda(strategy, label):
    with pytest.raises(ValueError, match=rf"{label} strategy and needs CUDA GPUs; this machine has none"):
        check_strategy(strategy, 1, 1, cuda=False)
    with pytest.raises(ValueError, match="not supported yet"):  # with CUDA: not yet either
        check_strategy(strategy, 1, 1, cuda=True)


def test_strategy_names():
    assert strategy_name("DDP") == "ddp" and strategy_name(None) == "auto"
    assert strategy_name({"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy"}) == "deepspeed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the FSDP message differs on a CUDA machine")
@pytest.mark.parametrize("flags,expect", [
    (["--trainer.strategy", "fsdp"], "fsdp is Lightning's FSDP strategy and needs CUDA GPUs"),
    (["--trainer.strategy", "ddp", "--trainer.devices", "2"], "ddp with 2 process(es)"),
])
def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, flags, expect):
    workspace = make_workspace(tmp_path)
    out = run_cli(["fit", "--config", "configs/tiny.yaml", *flags], workspace, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("hieragent: error")]
    assert len(errors) == 1 and expect in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not (workspace / "lightning_logs").exists()
