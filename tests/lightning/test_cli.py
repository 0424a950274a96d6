"""`hieragent fit|test` end to end on configs/tiny.yaml, in real subprocesses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run(args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "hieragent.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    (d / "configs").symlink_to(REPO / "configs")
    (d / "data").symlink_to(REPO / "data")
    return d


def test_fit_writes_checkpoint_then_test_and_resume(workdir):
    fit = run(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "2"], workdir)
    assert fit.returncode == 0, fit.stderr[-3000:]
    ckpt = workdir / "lightning_logs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
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
def test_bad_input_fails_clearly_and_writes_nothing(tmp_path, args, expected):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "data").symlink_to(REPO / "data")
    out = run(["fit", "--config", "configs/tiny.yaml", *args], tmp_path)
    assert out.returncode != 0
    assert expected in out.stderr
    assert not (tmp_path / "lightning_logs").exists()


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_config_parses(config):
    out = run(["fit", "--config", f"configs/{config}", "--print_config"], REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "model:" in out.stdout
