"""`hieragent fit|test` end to end on configs/tiny.yaml, in real subprocesses."""

import pytest
import torch
import yaml

from cli_helpers import REPO, make_workspace, run_cli as run, run_cli_here


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("run"))


def test_fit_writes_checkpoint_then_test_and_resume(workdir):
    fit = run(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "2"], workdir)
    assert fit.returncode == 0, fit.stderr[-3000:]
    ckpt = workdir / "lightning_logs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    # CSV and TensorBoard share the run folder with the checkpoints
    assert (ckpt.parents[1] / "metrics.csv").is_file()
    assert list((ckpt.parents[1] / "tensorboard").glob("events.out.tfevents.*"))
    assert not (ckpt.parents[2] / "version_1").exists()
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == 2
    assert all("lora_" in k or k.startswith("planner.query_adapter.") for k in state["state_dict"])
    bank = state["hieragent"]["bank"]
    assert bank is not None

    test = run(["test", "--config", "configs/tiny.yaml", "--ckpt_path", str(ckpt)], workdir)
    assert test.returncode == 0, test.stderr[-3000:]
    assert "test/success" in test.stdout

    resume = run(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "3",
                  "--ckpt_path", str(ckpt)], workdir)
    assert resume.returncode == 0, resume.stderr[-3000:]
    resumed = sorted(workdir.glob("lightning_logs/tiny/version_*/checkpoints/last.ckpt"))[-1]
    after = torch.load(resumed, map_location="cpu", weights_only=False)
    assert after["global_step"] == 3
    # the bank was restored from the checkpoint, then grew (or not) from there
    assert after["hieragent"]["bank"]["next_id"] >= bank["next_id"]


@pytest.mark.parametrize("args,expected", [
    (["--model.no_such_key", "1"], "no_such_key"),
    (["--model.model", "/no/such/model/dir"], "/no/such/model/dir"),
    (["--data.env", "BabyAI-Foo-v0"], "BabyAI-Foo-v0"),
    (["--ckpt_path", "missing.ckpt"], "missing.ckpt"),
])
def test_bad_input_fails_clearly_and_writes_nothing(workspace, args, expected, monkeypatch, capsys):
    out = run_cli_here(["fit", "--config", "configs/tiny.yaml", *args], workspace, monkeypatch, capsys)
    assert out.returncode != 0
    assert expected in out.stderr
    assert not (workspace / "lightning_logs").exists()


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_config_parses(config, capsys, monkeypatch):
    """In this process (the CLI's start-up, about 10 s here, is the subprocess tests' part):
    the parser that ``hieragent fit`` builds, printing the parsed config and exiting."""
    from hieragent.cli import HierAgentCLI
    from hieragent.lightning.datamodule import RolloutDataModule
    from hieragent.lightning.module import HierAgentModule

    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as ended:
        HierAgentCLI(HierAgentModule, RolloutDataModule, args=["fit", "--config", f"configs/{config}", "--print_config"],
                     seed_everything_default=0)
    out = capsys.readouterr()
    assert ended.value.code in (0, None), out.err[-2000:]
    printed = yaml.safe_load(out.out)
    assert set(printed) >= {"model", "data", "trainer"} and printed["model"]["model"]


def test_test_on_several_levels_prints_a_row_per_level(workspace):
    envs = "[BabyAI-GoToRedBallNoDists-v0, FrozenLake-4x4-v0, Sokoban-6x6-1box-v0, TextWorld-Easy-v0]"
    out = run(["test", "--config", "configs/tiny.yaml", "--data.test_envs", envs], workspace)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out episodes per env" in out.stdout
    import json

    rows = json.loads(next(workspace.glob("lightning_logs/tiny/version_*/test_summary.json")).read_text())
    assert list(rows) == ["BabyAI-GoToRedBallNoDists-v0", "FrozenLake-4x4-v0", "Sokoban-6x6-1box-v0",
                          "TextWorld-Easy-v0"]
    for row in rows.values():
        assert 0.0 <= row["success"] <= 1.0 and row["length"] >= 1  # every level really played
    assert rows["Sokoban-6x6-1box-v0"]["return"] < 0  # the per-step penalty: its own env ran


def test_fit_with_env_worker_processes_and_the_loop_guard(workspace):
    out = run(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "1",
               "--data.workers", "1", "--data.loop_guard", "3"], workspace)
    assert out.returncode == 0, out.stderr[-3000:]
    import csv

    with open(next(workspace.glob("lightning_logs/tiny/version_*/metrics.csv")), newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("env/worker_restarts")]
    assert rows and float(rows[0]["env/dropped_episodes"]) == 0.0
    assert 0.0 <= float(rows[0]["train/loop_ended"]) <= 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine may run the vllm engine")
def test_vllm_engine_without_a_gpu_fails_at_start_in_one_line_and_writes_nothing(workspace, monkeypatch, capsys):
    out = run_cli_here(["fit", "--config", "configs/tiny.yaml", "--model.engine", "vllm"], workspace,
                       monkeypatch, capsys)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("hieragent: error")]
    assert len(errors) == 1, out.stderr[-2000:]
    assert "model.engine: vllm needs a CUDA GPU" in errors[0] and "Traceback" not in out.stderr
    assert not (workspace / "lightning_logs").exists()
