"""Running the ``hieragent`` CLI in a subprocess, from a scratch directory."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(args, cwd, timeout=600, env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([sys.executable, "-m", "hieragent.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def make_workspace(path: Path) -> Path:
    """A directory with the repo's configs and data, so relative paths resolve as in a clone."""
    (path / "configs").symlink_to(REPO / "configs")
    (path / "data").symlink_to(REPO / "data")
    return path


def held(folder: Path):
    """A lock on a folder that tests on several pytest-xdist workers share (``make test`` runs
    two): the tests that rewrite the babyai ``--quick`` folder hold it, and so does the notebook
    that reads it, so that it never reads a folder half rewritten."""
    from filelock import FileLock

    return FileLock(f"{folder}.lock")


def run_cli_here(args, cwd, monkeypatch, capsys):
    """The CLI's ``main`` in this process, from ``cwd``: for runs that end at start (a refusal,
    a bad key), without a subprocess's start-up (about 10 s of imports on a slow machine)."""
    from hieragent.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["hieragent"])  # the arguments go to main, as LightningCLI asks
    try:
        main(list(args))
        code = 0
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else int(ended.code is not None)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["hieragent", *args], code, out.out, out.err)
