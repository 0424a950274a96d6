"""Which strategies run: one process, or ``ddp`` as ``RolloutDDPStrategy``; the others fail at
start, in one line naming ``trainer.strategy``, before a model is loaded or a folder written."""

import pytest
import torch

from cli_helpers import make_workspace, run_cli
from hieragent.strategies import RolloutDDPStrategy, check_strategy, strategy_name


@pytest.mark.parametrize("strategy,devices,nodes,ddp", [
    ("auto", "auto", 1, False), (None, 1, 1, False), ("single_device", "1", 1, False),
    ("ddp", 2, 1, True), ("ddp", 1, 1, True), ("ddp_find_unused_parameters_true", 2, 1, True),
    ("auto", 2, 1, True), ("auto", "0,1", 1, True), ("auto", [0, 1], 1, True), ("auto", 1, 2, True),
    ({"class_path": "hieragent.strategies.RolloutDDPStrategy"}, 2, 1, True),
])
def test_one_process_and_ddp_run_and_ddp_runs_as_the_rollout_strategy(strategy, devices, nodes, ddp):
    assert check_strategy(strategy, devices, nodes, cuda=False) is ddp


@pytest.mark.parametrize("strategy,devices,expected", [
    ("ddp_spawn", 2, "ddp_spawn is not supported: use ddp"),
    ("ddp_fork", 2, "ddp_fork is not supported: use ddp"),
    ("single_device", 2, "single_device with 2 processes is not supported: use ddp"),
    ({"class_path": "lightning.pytorch.strategies.DDPStrategy"}, 2, "syncs gradients per backward pass"),
])
def test_other_multi_process_strategies_are_refused_in_one_line(strategy, devices, expected):
    with pytest.raises(ValueError, match=r"^trainer\.strategy: ") as err:
        check_strategy(strategy, devices, 1, cuda=False)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_the_rollout_strategy_checks_its_timeout():
    assert RolloutDDPStrategy(timeout_s=5).timeout_s == 5
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RolloutDDPStrategy(timeout_s=0)


@pytest.mark.parametrize("strategy,label", [
    ("fsdp", "FSDP"), ("deepspeed", "DeepSpeed"), ("deepspeed_stage_2", "DeepSpeed"),
    ({"class_path": "lightning.pytorch.strategies.FSDPStrategy"}, "FSDP"),
])
def test_fsdp_and_deepspeed_need_cuda(strategy, label):
    with pytest.raises(ValueError, match=rf"{label} strategy and needs CUDA GPUs; this machine has none"):
        check_strategy(strategy, 1, 1, cuda=False)
    with pytest.raises(ValueError, match="not supported yet.*use ddp"):  # with CUDA: not yet either
        check_strategy(strategy, 1, 1, cuda=True)


def test_strategy_names():
    assert strategy_name("DDP") == "ddp" and strategy_name(None) == "auto"
    assert strategy_name({"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy"}) == "deepspeed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the FSDP message differs on a CUDA machine")
@pytest.mark.parametrize("flags,expect", [
    (["--trainer.strategy", "fsdp"], "fsdp is Lightning's FSDP strategy and needs CUDA GPUs"),
    (["--trainer.strategy", "ddp_spawn", "--trainer.devices", "2"], "ddp_spawn is not supported: use ddp"),
    (["--data.eval_episodes", "1", "--trainer.strategy", "ddp", "--trainer.devices", "2"],
     "data.eval_episodes (1) must be at least the number of processes (2)"),
    (["--data.demos", "demos.jsonl", "--trainer.strategy", "ddp", "--trainer.devices", "2"],
     "data.demos: the supervised warm start runs in one process, not 2"),
])
def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, flags, expect):
    workspace = make_workspace(tmp_path)
    out = run_cli(["fit", "--config", "configs/tiny.yaml", *flags], workspace, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("hieragent: error")]
    assert len(errors) == 1 and expect in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not (workspace / "lightning_logs").exists()
