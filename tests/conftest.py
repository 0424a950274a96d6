"""Shared fixtures: the tiny random Llama (with SmolLM2's tokenizer) loaded once."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    from hieragent.models.loading import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture()
def tiny_lm(tokenizer):
    """A fresh tiny model with planner and executor adapters, adapter B weights randomised
    so that the adapters actually change the output."""
    import torch

    from hieragent.models.loading import load_causal_lm
    from hieragent.models.lora import LoraSettings, add_adapters

    lm = add_adapters(load_causal_lm("tiny", seed=0), ["planner", "executor"], LoraSettings(r=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    lm.eval()
    return lm


@pytest.fixture(scope="session")
def repro_quick(tmp_path_factory):
    """``python -m hieragent.repro.babyai --quick`` on one small level, run once per session:
    the folder it wrote (the tests of the runner and the results notebook read it)."""
    import subprocess
    import sys

    from cli_helpers import make_workspace

    work = make_workspace(tmp_path_factory.mktemp("repro"))
    out = work / "repro_babyai_quick"
    done = subprocess.run([sys.executable, "-m", "hieragent.repro.babyai", "--quick", "--out", str(out),
                           "--levels", "BabyAI-GoToRedBallNoDists-v0"], cwd=work, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work, out, done


@pytest.fixture(scope="session")
def offpolicy_quick(tmp_path_factory):
    """``python -m hieragent.repro.offpolicy --quick``, run once per session: the folder it
    wrote (its tests and the results notebook read it)."""
    import subprocess
    import sys

    from cli_helpers import make_workspace

    work = make_workspace(tmp_path_factory.mktemp("offpolicy"))
    out = work / "repro_offpolicy_quick"
    done = subprocess.run([sys.executable, "-m", "hieragent.repro.offpolicy", "--quick", "--out", str(out)],
                          cwd=work, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work, out, done
