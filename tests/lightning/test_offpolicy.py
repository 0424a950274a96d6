"""Off-policy training in a real Trainer run: lagged rollouts, replay, and the NaN guard."""

import csv

import lightning as L
import pytest
import torch

from hieragent.lightning.datamodule import RolloutDataModule
from hieragent.lightning.module import HierAgentModule
from hieragent.memory.settings import MemorySettings
from hieragent.models.lora import LoraSettings
from hieragent.objectives.advantages import AdvantageSettings
from hieragent.objectives.update import ObjectiveSettings
from hieragent.rollout.loop import RolloutSettings
from hieragent.rollout.replay import ReplaySettings

from fit_helpers import quiet_trainer


def tiny_module(cls=HierAgentModule, **overrides):
    kwargs = dict(model="tiny", lora=LoraSettings(r=4, alpha=8), score_reduction="mean",
                  rollout=RolloutSettings(hierarchical=True, max_subgoal_steps=4),
                  memory=MemorySettings(enabled=False), lr_planner=1e-2, lr_executor=1e-2)
    kwargs.update(overrides)
    return cls(**kwargs)


def fit(module, tmp_path, steps):
    L.seed_everything(0)
    data = RolloutDataModule(env="BabyAI-GoToObjS4-v0", max_episode_steps=6, seeds_per_batch=2,
                             group_size=2)
    trainer = quiet_trainer(tmp_path, steps)
    trainer.fit(module, datamodule=data)
    rows = list(csv.DictReader(open(next(tmp_path.glob("run/version_*/metrics.csv")))))
    return trainer, rows


def column(rows, key):
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


class Recorded(HierAgentModule):
    """The real module, noting the step each training batch was collected at and the
    versions its turns record."""

    def collect_train(self, pool, seeds, groups, generator=None):
        batch = super().collect_train(pool, seeds, groups, generator)
        self.__dict__.setdefault("served", []).append(
            (self.global_step, batch.policy_version, {t.policy_version for t in batch.turns()}))
        return batch


def test_lagged_rollouts_are_stale_off_policy_and_get_clipped(tmp_path):
    module = tiny_module(Recorded, replay=ReplaySettings(updates_per_batch=2, rollout_lag=1, max_staleness=2),
                         objective=ObjectiveSettings(kl_coef=0.0, eps_low=0.02, eps_high=0.02))
    trainer, rows = fit(module, tmp_path, steps=6)
    assert trainer.global_step == 6
    # the engine serves the weights one training step (two optimizer steps) behind
    assert module.served == [(0, 0, {0}), (2, 0, {0}), (4, 2, {2})]
    assert module.engine.versions == [4, 5, 6]
    stale = column(rows, "executor/staleness_max")
    # rollouts one training step (two updates) behind arrive 2 stale, 3 at their second update
    assert stale[:2] == [0, 1] and stale[2:] == [2, 3, 2, 3]
    assert max(column(rows, "executor/clip_frac")) > 0  # the data really was off-policy
    # a batch is kept while at most 2 stale when a step starts: b0 and b1 meet at step 2, then go
    assert column(rows, "replay/batches") == [1.0, 2.0, 1.0]
    assert column(rows, "replay/dropped_turns")[-1] > 0


class PoisonedAt(HierAgentModule):
    """The real module, with a NaN written into one behaviour log-prob of one batch."""

    poison_step = 2
    done = False

    def collect_train(self, pool, seeds, groups, generator=None):
        batch = super().collect_train(pool, seeds, groups, generator)
        if self.global_step == self.poison_step and not self.done:
            batch.turns("executor")[0].old_logprobs[0] = float("nan")
            self._poisoned = self.done = True
        return batch

    def _update(self, batches):
        if not getattr(self, "_poisoned", False):
            return super()._update(batches)
        self._poisoned = False
        weights = {n: p.detach().clone() for n, p in self.trainable_parameters().items()}
        opt = self.optimizers().optimizer
        state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        skip = super()._update(batches)
        self.unchanged = all(torch.equal(weights[n], p) for n, p in self.trainable_parameters().items())
        self.state_unchanged = all(torch.equal(state[id(p)][k], v) for p, s in opt.state.items()
                                   for k, v in s.items())
        return skip


class Planted(HierAgentModule):
    """The real module; at training step 1 one value of the newest batch is replaced, once."""

    plant: str = "log_ratio"
    planted_at = None

    def _update(self, batches):
        if self.global_step == 1 and self.planted_at is None:
            turn = batches[-1].turns("executor")[0]
            if self.plant == "log_ratio":
                turn.old_logprobs[0] = -1e4  # log-ratio ~ +1e4: exp overflows without the clamp
            else:
                turn.advantage = 1e39  # finite in Python, inf in the float32 loss
            self.planted_at = self.global_step
        return super()._update(batches)


def test_a_huge_log_ratio_trains_on_with_no_skipped_step(tmp_path):
    module = tiny_module(Planted, objective=ObjectiveSettings(kl_coef=0.0),
                         replay=ReplaySettings(updates_per_batch=2, max_staleness=4))
    trainer, rows = fit(module, tmp_path, steps=6)
    assert module.planted_at == 1 and trainer.global_step == 6
    assert column(rows, "train/skipped_step") == [0.0] * 6
    assert max(column(rows, "executor/ratio_max")) > 1e8  # it reached the clamp, exp(20)
    assert all(torch.isfinite(p).all() for p in module.trainable_parameters().values())


def test_a_skipped_step_drops_the_batch_that_caused_it_so_training_does_not_stall(tmp_path, caplog):
    """Finite data whose loss is not finite: kept, it would skip every update that reuses it."""
    Planted.plant = "advantage"
    try:
        module = tiny_module(Planted, objective=ObjectiveSettings(kl_coef=0.0),
                             replay=ReplaySettings(updates_per_batch=2, max_staleness=4))
        with caplog.at_level("WARNING"):
            trainer, rows = fit(module, tmp_path, steps=6)
    finally:
        Planted.plant = "log_ratio"
    skipped = column(rows, "train/skipped_step")
    # one skip, then on: every other update stepped (a skip is no optimizer step)
    assert skipped.count(1.0) == 1 and trainer.global_step == len(skipped) - 1 >= 6
    assert column(rows, "replay/dropped_batches") == [1.0]  # the poisoned batch, and only it
    assert "non-finite executor loss" in caplog.text


def test_off_policy_updates_fire_the_dual_clip_and_shrink_the_step_by_lambda_only_when_clipping(tmp_path):
    module = tiny_module(objective=ObjectiveSettings(kl_coef=0.0, eps_low=0.01, eps_high=0.01, dual_clip=1.05,
                                                     clip_normalization=True, clip_norm_strength=4.0),
                         replay=ReplaySettings(updates_per_batch=3, max_staleness=2))
    trainer, rows = fit(module, tmp_path, steps=9)
    rows = [r for r in rows if r.get("executor/clip_frac") not in (None, "")]
    assert len(rows) == 9
    for r in rows:
        clip, scale = float(r["executor/clip_frac"]), float(r["executor/clip_norm_scale"])
        # the scale is the step's learning-rate factor, of that role's group only
        assert float(r["executor/lr_scale"]) == scale
        assert (scale < 1.0) == (clip > 0), r
        assert float(r["executor/update_norm"]) > 0
        if r.get("value/lr_scale") not in (None, ""):
            assert float(r["value/lr_scale"]) == 1.0
    first = [r for i, r in enumerate(rows) if i % 3 == 0]  # each batch's first update is on-policy
    assert all(float(r["executor/clip_frac"]) == 0 and float(r["executor/clip_norm_scale"]) == 1.0 for r in first)
    assert max(float(r["executor/clip_norm_scale"]) for r in rows if r not in first) < 1.0
    assert max(float(r["executor/dual_clip_frac"]) for r in rows) > 0
    assert max(float(r["retrieval/clip_norm_scale"]) if r.get("retrieval/clip_norm_scale") else 1.0
               for r in rows) <= 1.0


def test_a_nan_log_prob_skips_the_step_and_leaves_weights_and_optimizer_state_alone(tmp_path, caplog):
    module = tiny_module(PoisonedAt, objective=ObjectiveSettings(kl_coef=0.0))
    with caplog.at_level("WARNING"):
        trainer, rows = fit(module, tmp_path, steps=4)
    assert module.unchanged and module.state_unchanged
    assert column(rows, "train/skipped_step").count(1.0) == 1
    assert "the step is skipped" in caplog.text
    # a skipped step is no optimizer step: training went on to 4 real ones
    assert trainer.global_step == 4 and len(column(rows, "train/skipped_step")) == 5
    assert all(torch.isfinite(p).all() for p in module.trainable_parameters().values())


@pytest.mark.parametrize("objective", [
    ObjectiveSettings(level="sequence", aggregation="seq-mean-token-sum", kl_mode="reward",
                      kl_estimator="k2", kl_coef=0.05),
    ObjectiveSettings(level="token", dual_clip=3.0, tis_cap=2.0, clip_normalization=True,
                      aggregation="seq-mean-token-mean", kl_estimator="k2", kl_coef=0.05),
], ids=["sequence-reward-kl", "token-dual-tis-norm"])
def test_every_objective_option_trains_in_a_real_run(tmp_path, objective):
    module = tiny_module(objective=objective, replay=ReplaySettings(updates_per_batch=2))
    trainer, rows = fit(module, tmp_path, steps=4)
    assert trainer.global_step == 4
    assert column(rows, "train/skipped_step") == [0.0] * 4
    if objective.tis_cap is not None:
        # the trainer's own forward agrees with the rollout's at the same weights
        assert max(column(rows, "executor/logprob_gap")) < 1e-4
        assert column(rows, "executor/clip_norm_scale")
    else:
        assert column(rows, "executor/kl_reward")


@pytest.mark.parametrize("advantage", [AdvantageSettings(estimator="gae", gae_normalize=True),
                                       AdvantageSettings(estimator="gigpo", normalize_by="joint"),
                                       AdvantageSettings(estimator="rloo", gamma=0.9)],
                         ids=["gae", "gigpo-joint", "rloo"])
def test_every_advantage_estimator_trains_in_a_real_run(tmp_path, advantage):
    module = tiny_module(advantage=advantage, objective=ObjectiveSettings(kl_coef=0.0))
    trainer, rows = fit(module, tmp_path, steps=3)
    assert trainer.global_step == 3
    assert column(rows, "train/skipped_step") == [0.0] * 3
    if advantage.estimator == "gae":
        assert len(column(rows, "value/loss")) == 3  # the critic trains with the policies
        assert any(k.startswith("value_head.") for k in module.trainable_parameters())


class PoisonedAlways(HierAgentModule):
    """Every update's loss is non-finite: no step would ever be taken."""

    def _update(self, batches):
        for b in batches:
            for turn in b.turns("executor"):
                turn.advantage = 1e39  # finite in Python, inf in the float32 loss
        return super()._update(batches)


def test_a_fit_whose_every_step_is_skipped_stops_with_a_clear_error(tmp_path):
    module = tiny_module(PoisonedAlways, objective=ObjectiveSettings(kl_coef=0.0, max_skipped_steps=3))
    with pytest.raises(ValueError, match=r"3 optimizer steps in a row were skipped, the last for non-finite "
                                         r"executor loss.*max_skipped_steps"):
        fit(module, tmp_path, steps=2)  # without the limit this fit would never end
    assert module.global_step == 0 and module._skipped_in_a_row == 3
