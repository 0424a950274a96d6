"""`hieragent fit|test` end to end on configs/tiny.yaml, in real subprocesses."""

import pytest
import torch

from cli_helpers import REPO, make_workspace, run_cli as run


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
def test_bad_input_fails_clearly_and_writes_nothing(workspace, args, expected):
    out = run(["fit", "--config", "configs/tiny.yaml", *args], workspace)
    assert out.returncode != 0
    assert expected in out.stderr
    assert not (workspace / "lightning_logs").exists()


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_config_parses(config):
    out = run(["fit", "--config", f"configs/{config}", "--print_config"], REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "model:" in out.stdout
