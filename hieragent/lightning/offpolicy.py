"""The off-policy side of a training step: lagged rollout weights, trainer log-probs, KL reward.

* ``AdapterSnapshots`` keeps the trainable weights of the last few training steps, so a
  rollout can use the weights of ``rollout_lag`` steps ago, as an asynchronous actor would.
* ``record_trainer_logprobs`` recomputes the behaviour log-probs with the trainer's own
  forward at the rollout weights (for truncated IS: the engine's can differ).
* ``subtract_kl_reward`` turns the KL to the reference into a per-turn reward penalty.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from hieragent.objectives.losses import KLEstimator, kl_penalty
from hieragent.objectives.update import pad_rows
from hieragent.types import Turn


class AdapterSnapshots:
    """Copies of the trainable parameters at recent policy versions (oldest first)."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self._snaps: deque[tuple[int, dict[str, torch.Tensor]]] = deque(maxlen=lag + 1)

    def push(self, version: int, params: dict[str, nn.Parameter]) -> None:
        if self.lag > 0:
            self._snaps.append((version, {n: p.detach().clone() for n, p in params.items()}))

    @contextmanager
    def lagged(self, version: int, params: dict[str, nn.Parameter]) -> Iterator[int]:
        """Run the body with the oldest kept weights swapped in; yields their version.

        Early in a run fewer than ``lag`` steps exist, and the oldest available is used.
        """
        if self.lag == 0 or not self._snaps:
            yield version
            return
        old_version, snap = self._snaps[0]
        current = {n: p.detach().clone() for n, p in params.items()}
        try:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(snap[n])
            yield old_version
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(current[n])


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
