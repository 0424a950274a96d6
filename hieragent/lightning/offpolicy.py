"""The off-policy side of a training step: trainer log-probs and the KL reward.

(Lagged rollout weights are the engine's: ``engines.base.Engine.lagged``.)

* ``record_trainer_logprobs`` recomputes the behaviour log-probs with the trainer's own
  forward at the rollout weights (for truncated IS: the engine's can differ).
* ``subtract_kl_reward`` turns the KL to the reference into a per-turn reward penalty.
"""

from __future__ import annotations

import torch

from hieragent.objectives.losses import KLEstimator, kl_penalty
from hieragent.objectives.update import pad_rows
from hieragent.types import Turn


@torch.no_grad()
def record_trainer_logprobs(policy, turns: list[Turn], micro_batch: int) -> None:
    """Fill ``Turn.trainer_logprobs`` with the trainer's log-probs at the current weights."""
    for start in range(0, len(turns), micro_batch):
        chunk = turns[start:start + micro_batch]
        for turn, lp in zip(chunk, policy.turn_logprobs(chunk)):
            turn.trainer_logprobs = lp[: len(turn.old_logprobs)].double().tolist()


@torch.no_grad()
def subtract_kl_reward(policy, turns: list[Turn], coef: float, estimator: KLEstimator,
                       micro_batch: int) -> float:
    """``reward -= coef * sum_t k(old_logprobs_t, ref_t)`` per turn; returns the mean penalty.

    The behaviour log-probs stand in for the policy's, as in RLHF's reward-side KL: the
    penalty is a number fixed at rollout time, not a gradient path.
    """
    total = 0.0
    for start in range(0, len(turns), micro_batch):
        chunk = turns[start:start + micro_batch]
        refs = policy.reference_logprobs(chunk)
        old, mask = pad_rows([torch.tensor(t.old_logprobs, dtype=torch.float64) for t in chunk])
        ref, _ = pad_rows([r.double().cpu() for r in refs], old.shape[1])
        per_turn = kl_penalty(old, ref, mask, estimator).sum(-1)  # [B]
        for turn, k in zip(chunk, per_turn.tolist()):
            turn.reward -= coef * k
            total += coef * k
    return total / max(len(turns), 1)
