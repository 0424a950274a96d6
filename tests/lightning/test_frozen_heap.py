"""``callbacks.FrozenHeap`` in real Trainer runs: frozen while training steps run, thawed after,
on failure too, and added by ``hieragent fit`` unless the config gives one."""

import gc
import sys

import lightning as L
import pytest

from hieragent.lightning.callbacks import FrozenHeap
from hieragent.lightning.datamodule import RolloutDataModule
from hieragent.lightning.module import HierAgentModule
from hieragent.memory.settings import MemorySettings
from hieragent.models.lora import LoraSettings
from hieragent.rollout.loop import RolloutSettings

from fit_helpers import quiet_trainer


class Seen(L.Callback):
    """The frozen object count at each training step's start; fails the run at ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.counts: list[int] = []
        self.fail_at = fail_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counts.append(gc.get_freeze_count())
        if batch_idx == self.fail_at:
            raise RuntimeError("the run fails here")


def fit(tmp_path, *callbacks, steps=2):
    L.seed_everything(0)
    module = HierAgentModule(model="tiny", lora=LoraSettings(r=4, alpha=8), score_reduction="mean",
                             rollout=RolloutSettings(hierarchical=True, max_subgoal_steps=2),
                             memory=MemorySettings(enabled=True, seed_file="data/skills.jsonl"),
                             lr_planner=1e-2, lr_executor=1e-2)
    data = RolloutDataModule(env="BabyAI-GoToObjS4-v0", max_episode_steps=4, seeds_per_batch=1, group_size=2)
    trainer = quiet_trainer(tmp_path, steps, callbacks)
    trainer.fit(module, datamodule=data)
    return module


@pytest.fixture(autouse=True)
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_training_steps_run_on_a_frozen_heap_and_fit_thaws_it(tmp_path):
    frozen, seen = FrozenHeap(), Seen()
    module = fit(tmp_path, frozen, seen)
    # every step ran with the model, the bank and the imports frozen: hundreds of thousands of objects
    assert len(seen.counts) == 2 and min(seen.counts) > 100_000
    assert gc.get_freeze_count() == 0 and frozen.frozen == 0
    assert any(o is module.bank for o in gc.get_objects())  # given back to the collector's walks


def test_off_it_freezes_nothing_and_a_failed_run_thaws_too(tmp_path):
    seen = Seen()
    fit(tmp_path, FrozenHeap(enabled=False), seen, steps=1)
    assert seen.counts == [0]
    failing = Seen(fail_at=0)
    with pytest.raises(RuntimeError, match="the run fails here"):
        fit(tmp_path, FrozenHeap(), failing, steps=1)
    assert failing.counts[0] > 100_000 and gc.get_freeze_count() == 0


OFF = ["--trainer.callbacks+=hieragent.lightning.callbacks.FrozenHeap", "--trainer.callbacks.enabled=false"]


@pytest.mark.parametrize("given, enabled", [([], True), (OFF, False)])
def test_the_cli_adds_one_unless_the_config_gives_it(given, enabled, monkeypatch):
    from cli_helpers import REPO
    from hieragent.cli import HierAgentCLI

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["hieragent"])  # the arguments go to the CLI, as LightningCLI asks
    cli = HierAgentCLI(HierAgentModule, RolloutDataModule, run=False, seed_everything_default=0,
                       args=["--config", "configs/tiny.yaml", *given])
    heaps = [c for c in cli.trainer.callbacks if isinstance(c, FrozenHeap)]
    assert len(heaps) == 1 and heaps[0].enabled is enabled
