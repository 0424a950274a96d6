"""A training run killed with SIGKILL leaves a checkpoint that loads and resumes.

Checkpoints are written to a temporary file and renamed into place, so a reader never sees
a half-written ``last.ckpt``: the test loads it over and over while training rewrites it,
then kills the process mid-run and resumes from whatever is on disk.
"""

import os
import signal
import subprocess
import sys
import time

import torch

from cli_helpers import run_cli


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_sigkill_mid_training_leaves_a_resumable_checkpoint(workspace):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hieragent.cli", "fit", "--config", "configs/tiny.yaml",
         "--trainer.max_steps", "10000"],
        cwd=workspace, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    ckpt = workspace / "lightning_logs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    loads, step = 0, 0
    deadline = time.monotonic() + 300
    try:
        while step < 3:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 3 within 300 s"
            if ckpt.exists():
                step = _load(ckpt)["global_step"]  # raises if a reader ever saw a torn file
                loads += 1
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    saved = _load(ckpt)
    assert saved["global_step"] >= 3 and loads >= 1
    assert saved["hieragent"]["bank"] is not None
    target = saved["global_step"] + 1
    resume = run_cli(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", str(target),
                      "--ckpt_path", str(ckpt)], workspace)
    assert resume.returncode == 0, resume.stderr[-3000:]
    resumed = sorted(workspace.glob("lightning_logs/tiny/version_*/checkpoints/last.ckpt"))[-1]
    assert resumed != ckpt
    assert _load(resumed)["global_step"] == target
