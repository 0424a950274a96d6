"""Shared fixtures: the tiny random Llama (with SmolLM2's tokenizer) loaded once."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


FIRST = ("tests/repro/",)  # their modules build the --quick reproductions (minutes) that test_notebooks reads
LAST = ("tests/test_notebooks.py",)


def pytest_collection_modifyitems(config, items):
    """The reproductions' modules first and the notebooks' last. ``make test`` passes
    ``--no-loadscope-reorder``, so pytest-xdist hands the modules out in this order: the two
    reproductions start at once on the two workers, and the notebooks find them done instead of
    waiting on a lock (258 s of one worker's time in a CI run that ordered by module size)."""
    items.sort(key=lambda item: 0 if item.nodeid.startswith(FIRST) else 2 if item.nodeid.startswith(LAST) else 1)


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


def _once_per_run(tmp_path_factory, name: str, argv):
    """Run ``python -m <argv(workspace)>`` once per test run, from a workspace named ``name``.

    Under pytest-xdist every worker has its own session, so a session fixture alone would run a
    reproduction once per worker that asks. The first worker to ask runs it, under a file lock,
    in a folder that all workers share, and records how it ended; the others wait for the lock and
    read the record. Returns the workspace and the finished process."""
    import json
    import subprocess
    import sys

    from filelock import FileLock

    from cli_helpers import make_workspace

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    work, record = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            work.mkdir()
            done = subprocess.run([sys.executable, "-m", *argv(work)], cwd=make_workspace(work),
                                  capture_output=True, text=True, timeout=900)
            record.write_text(json.dumps({"returncode": done.returncode, "stdout": done.stdout,
                                          "stderr": done.stderr}))
    ended = json.loads(record.read_text())
    done = subprocess.CompletedProcess(argv(work), ended["returncode"], ended["stdout"], ended["stderr"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work, done


@pytest.fixture(scope="session")
def repro_quick(tmp_path_factory):
    """``python -m hieragent.repro.babyai --quick`` on one small level, run once per test run:
    the folder it wrote (the tests of the runner and the results notebook read it)."""
    work, done = _once_per_run(tmp_path_factory, "repro", lambda work: [
        "hieragent.repro.babyai", "--quick", "--out", str(work / "repro_babyai_quick"),
        "--levels", "BabyAI-GoToRedBallNoDists-v0"])
    return work, work / "repro_babyai_quick", done


@pytest.fixture(scope="session")
def offpolicy_quick(tmp_path_factory):
    """``python -m hieragent.repro.offpolicy --quick``, run once per test run: the folder it
    wrote (its tests and the results notebook read it)."""
    work, done = _once_per_run(tmp_path_factory, "offpolicy", lambda work: [
        "hieragent.repro.offpolicy", "--quick", "--out", str(work / "repro_offpolicy_quick")])
    return work, work / "repro_offpolicy_quick", done
