"""The families added for the field's benchmarks (ScienceWorld, Crafter as text, TextArena)
train unchanged: one real Trainer step of the tiny model (planner, executor and skill bank)
on each, in process; the CLI's own fit is covered on BabyAI in ``tests/lightning``."""

import csv
import math

import lightning as L
import pytest

from hieragent.envs.base import env_class
from hieragent.lightning.datamodule import RolloutDataModule
from hieragent.lightning.module import HierAgentModule
from hieragent.memory.settings import MemorySettings
from hieragent.models.lora import LoraSettings
from hieragent.rollout.loop import RolloutSettings

from fit_helpers import quiet_trainer


def fit(env, tmp_path, **module_kwargs):
    L.seed_everything(0)
    module = HierAgentModule(model="tiny", lora=LoraSettings(r=4, alpha=8), score_reduction="mean",
                             rollout=RolloutSettings(hierarchical=True, max_subgoal_steps=2),
                             memory=MemorySettings(enabled=True, seed_file="data/skills.jsonl"),
                             lr_planner=1e-2, lr_executor=1e-2, **module_kwargs)
    data = RolloutDataModule(env=env, max_episode_steps=4, seeds_per_batch=1, group_size=2)
    trainer = quiet_trainer(tmp_path, 1)
    trainer.fit(module, datamodule=data)
    with open(next(tmp_path.glob("run/version_*/metrics.csv")), newline="") as f:
        logged = {k: float(v) for r in csv.DictReader(f) for k, v in r.items() if v not in (None, "")}
    return module, trainer, logged


# Sudoku lists no moves (a list would give the solution away): its executor must generate
@pytest.mark.parametrize("env, mode", [("ScienceWorld-find-plant-v0", "score"), ("Crafter-v0", "score"),
                                       ("TextArena-Sudoku-v0-very-easy", "generate")])
def test_one_training_step_of_the_tiny_model_on_each_new_family(env, mode, tmp_path):
    module, trainer, logged = fit(env, tmp_path, executor_mode=mode)
    assert trainer.global_step == 1
    assert logged["train/env_steps"] > 0 and math.isfinite(logged["executor/loss"])
    # the prompts named this family's world, not BabyAI's grid world
    assert ("executor", env_class(env).world) in module.prompter._system


def test_an_env_with_no_move_list_in_score_mode_says_to_generate(tmp_path):
    with pytest.raises(ValueError, match="the env offered none .*model.executor_mode: generate"):
        fit("TextArena-Sudoku-v0-very-easy", tmp_path)


def test_the_cli_fits_a_new_family_by_name(tmp_path):
    from cli_helpers import make_workspace, run_cli

    work = make_workspace(tmp_path)
    out = run_cli(["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "1",
                   "--data.env", "TextArena-TowerOfHanoi-v0", "--data.test_envs", "[TextArena-TowerOfHanoi-v0]"], work)
    assert out.returncode == 0, out.stderr[-3000:]
    assert next(work.glob("lightning_logs/**/metrics.csv"), None) is not None
