"""RL measurably learns: the proof that loss, ratios and credit assignment are wired right.

``configs/tiny_learn.yaml`` trains planner, executor and skill bank (a random tiny Llama)
for 15 updates on BabyAI-GoToObjS4-v0, all seeds fixed (``seed_everything: 0``,
``model_seed: 0``, training seeds from 0, held-out seeds from 1,000,000, evaluation
sampling seed 1234). A uniformly random policy succeeds in about 16% of these episodes
within the 8-step cap (measured over 300 seeds); the untrained model is about as good.
Nothing here is hard-coded: a flipped advantage sign, a broken ratio or credit given to
the wrong turns leaves the success rate at chance or drives it down.

The on-policy run never exercises the clip (every ratio is 1), so the same task is also
trained off-policy: each batch used for 4 updates and rolled out by the weights of 2
training steps earlier, with clipping-triggered normalization, where ratios, clip and
normalization all act. The slow control runs that setting with the clip's epsilon signs
swapped, a wrong clip, and checks that it fails the same assertion.
"""

import json
import os
import subprocess
import sys

import pytest

from cli_helpers import run_cli

# ST-PPO's setting: stale data, turn-level IS, clipping-triggered normalization
OFF_POLICY = ["--trainer.max_steps", "60", "--model.replay.updates_per_batch", "4",
              "--model.replay.rollout_lag", "2", "--model.replay.max_staleness", "8",
              "--model.objective.clip_normalization", "true"]
# the wrong clip of the control: clamp(r, 1 + eps_low, 1 - eps_high), in place of the real one
WRONG_CLIP = """
import sys
import hieragent.objectives.update as update
real = update.clipped_policy_loss
def swapped(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, *args, **kwargs):
    return real(lp, old, adv, mask, -eps_low, -eps_high, *args, **kwargs)
update.clipped_policy_loss = swapped
from hieragent.cli import main
sys.argv = ["hieragent", *sys.argv[1:]]
main()
"""


def summary_of(workspace):
    return json.loads(next(workspace.glob("lightning_logs/tiny_learn/version_*/eval_summary.json")).read_text())


def assert_learned(summary, updates):
    before, after = summary["before"], summary["after"]
    assert summary["updates"] == updates
    assert before["episodes"] == after["episodes"] == 64
    assert before["success"] <= 0.35, before  # near chance (about 0.16)
    assert after["success"] >= 0.6, after
    assert after["success"] - before["success"] >= 0.35
    assert after["length"] < before["length"]  # succeeding means finishing early


def test_success_rate_rises_well_above_chance(workspace):
    fit = run_cli(["fit", "--config", "configs/tiny_learn.yaml"], workspace)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert_learned(summary_of(workspace), 15)
    assert "after" in fit.stdout and "success rate" in fit.stdout  # the table was printed


def test_success_rate_rises_off_policy_with_stale_lagged_rollouts(workspace):
    fit = run_cli(["fit", "--config", "configs/tiny_learn.yaml", *OFF_POLICY], workspace)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert_learned(summary_of(workspace), 60)


@pytest.mark.slow
def test_a_wrong_clip_fails_the_off_policy_assertion(workspace):
    """The control: the same off-policy run with the signs of eps swapped must not pass."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    fit = subprocess.run([sys.executable, "-c", WRONG_CLIP, "fit", "--config", "configs/tiny_learn.yaml",
                          *OFF_POLICY], cwd=workspace, env=env, capture_output=True, text=True, timeout=1200)
    assert fit.returncode == 0, fit.stderr[-3000:]
    with pytest.raises(AssertionError):
        assert_learned(summary_of(workspace), 60)
