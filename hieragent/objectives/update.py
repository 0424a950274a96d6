"""From recorded turns to a scalar loss: padding, the clipped objective, KL, statistics.

This is the glue between ``Turn`` lists and the tensor math of ``losses.py``; it never
touches an optimizer. The loss of one role is a token-mean over *all* of that role's
turns in the update, even when the turns are fed in micro-batches: each micro-batch's
sum is divided by the role's total token count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from hieragent.objectives.losses import clipped_policy_loss, kl_k3
from hieragent.types import Turn


@dataclass
class ObjectiveSettings:
    """The RL objective.

    Attributes:
        level: Importance-sampling level: ``turn`` (default) or ``token`` (PPO).
        eps_low: Lower clip range of the ratio.
        eps_high: Upper clip range of the ratio (clip-higher when above ``eps_low``).
        kl_coef: Weight of the k3 KL to the reference (the LM with adapters disabled).
        gamma: Discount of turn credits.
        scale_by_std: Divide group-centred credits by the group's std (GRPO) or not.
        updates_per_batch: Optimizer steps per rollout batch; after the first they are
            off-policy and the clip does its work.
        minibatch_turns: Turns per optimizer step, sampled from the batch per role;
            ``None`` uses every turn.
        micro_batch_turns: Turns per forward pass (memory only; the gradient is the same).
        max_grad_norm: Gradient clipping by global norm; ``0`` turns it off.
    """

    level: Literal["turn", "token"] = "turn"
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.01
    gamma: float = 1.0
    scale_by_std: bool = True
    updates_per_batch: int = 1
    minibatch_turns: int | None = None
    micro_batch_turns: int = 32
    max_grad_norm: float = 1.0


def pad_rows(rows: list[Tensor], width: int | None = None) -> tuple[Tensor, Tensor]:
    """Stack 1-D tensors into ``[B, T]`` with a ``[B, T]`` mask (zeros on padding)."""
    width = max([1, *(len(r) for r in rows)]) if width is None else width
    ref = rows[0] if rows else torch.zeros(0)
    out = ref.new_zeros((len(rows), width))
    mask = ref.new_zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
        mask[i, : len(r)] = 1.0
    return out, mask


def old_logprobs_of(turn: Turn) -> list[float]:
    """Behaviour log-probs aligned with ``Planner.turn_logprobs``: retrieval comes last."""
    extra = [turn.retrieval.old_logprob] if turn.retrieval is not None else []
    return list(turn.old_logprobs) + extra


def count_tokens(turns: list[Turn]) -> int:
    return sum(len(old_logprobs_of(t)) for t in turns)


@dataclass
class ChunkLoss:
    """One micro-batch's contribution to the loss, and its sums for logging."""

    loss: Tensor
    policy_sum: float
    kl_sum: float
    clipped: int
    tokens: int
    ratio_sum: float
    ratio_max: float
    ratio_min: float


def chunk_loss(
    logprobs: list[Tensor],
    ref_logprobs: list[Tensor] | None,
    turns: list[Turn],
    settings: ObjectiveSettings,
    denominator: int,
) -> ChunkLoss:
    """Clipped turn-level loss (+ KL) of a micro-batch, scaled by the role's token count.

    Args:
        logprobs: Per turn, the current log-probs (``Policy.turn_logprobs``).
        ref_logprobs: Per turn, the reference log-probs of the policy's own tokens (the
            retrieval has no reference and is left out of the KL), or ``None``.
        turns: The turns, whose ``advantage`` is already assigned.
        denominator: Total tokens of this role in the update (token-mean aggregation).
    """
    lp, mask = pad_rows(logprobs)  # [B, T]
    old = [torch.tensor(old_logprobs_of(t), dtype=lp.dtype, device=lp.device) for t in turns]
    old_lp, _ = pad_rows(old, lp.shape[1])  # [B, T]
    adv = torch.tensor([t.advantage for t in turns], dtype=lp.dtype, device=lp.device)  # [B]
    terms = clipped_policy_loss(lp, old_lp, adv, mask, settings.eps_low, settings.eps_high,
                                settings.level)
    policy = terms.per_token.sum()
    kl = lp.new_zeros(())
    if ref_logprobs is not None and settings.kl_coef > 0:
        ref, ref_mask = pad_rows([r.to(lp.dtype) for r in ref_logprobs], lp.shape[1])  # [B, T]
        kl = kl_k3(lp, ref, ref_mask).sum()
    loss = (policy + settings.kl_coef * kl) / max(denominator, 1)
    real = mask > 0
    ratios = terms.ratio.detach()[real]
    return ChunkLoss(
        loss=loss,
        policy_sum=float(policy.detach()),
        kl_sum=float(kl.detach()),
        clipped=int(terms.clipped.sum()),
        tokens=int(real.sum()),
        ratio_sum=float(ratios.sum()) if ratios.numel() else 0.0,
        ratio_max=float(ratios.max()) if ratios.numel() else 1.0,
        ratio_min=float(ratios.min()) if ratios.numel() else 1.0,
    )
