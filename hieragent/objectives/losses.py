"""Turn-level importance sampling with clipping, and the KL to the reference.

A *turn* is one planner or executor output. With per-token log-probabilities
``logprobs`` under the policy being trained and ``old_logprobs`` under the behaviour
policy that produced the rollout, the turn's importance ratio is the geometric mean of
its token ratios (after SORL / ST-PPO, arXiv 2511.20718):

    r_i = exp( (1/|y_i|) * sum_t (log pi_theta(y_i,t) - log pi_old(y_i,t)) )        (1)

Every token of the turn shares r_i in a PPO clip with separate low and high epsilon
(the "clip-higher" of DAPO, arXiv 2503.14476):

    l_i,t = -min( r_i * A_i,  clip(r_i, 1 - eps_low, 1 + eps_high) * A_i )         (2)

``level="token"`` uses each token's own ratio instead (PPO), and ``level="sequence"``
takes the mean of (1) over a whole response (GSPO, arXiv 2507.18071); with one turn per
sequence it equals ``turn``. In ``score`` mode a turn has one "token": the chosen
candidate's log-probability under the candidate softmax, so (1) is that softmax's ratio.

The KL to the reference uses the k3 estimator (Schulman, "Approximating KL divergence"):

    k3 = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1 >= 0      (3)

Shapes: ``B`` turns, ``T`` padded tokens per turn; ``mask`` is 1 on real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Level = Literal["token", "turn"]


def turn_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Log of equation (1): the mean over a turn's real tokens of the log-ratio.

    Args:
        logprobs: ``[B, T]`` current policy.
        old_logprobs: ``[B, T]`` behaviour policy.
        mask: ``[B, T]`` 1 for real tokens, 0 for padding.

    Returns:
        ``[B]``; 0 for a turn without tokens.
    """
    mask = mask.to(logprobs.dtype)
    n_tokens = mask.sum(-1).clamp(min=1.0)  # [B]
    return ((logprobs - old_logprobs) * mask).sum(-1) / n_tokens


@dataclass
class LossTerms:
    """Per-token terms of the clipped objective and what the logs need.

    Attributes:
        per_token: ``[B, T]`` equation (2), zero on padding.
        ratio: ``[B, T]`` the ratio each token was weighted by.
        clipped: ``[B, T]`` bool, where the clipped branch was the active one.
    """

    per_token: Tensor
    ratio: Tensor
    clipped: Tensor


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    level: Level = "turn",
) -> LossTerms:
    """Equation (2) for every token, with the ratio shared per turn (or per token).

    Args:
        logprobs: ``[B, T]``.
        old_logprobs: ``[B, T]``.
        advantages: ``[B]`` one per turn.
        mask: ``[B, T]``.
        eps_low: Lower clip range: ratios below ``1 - eps_low`` stop pushing down.
        eps_high: Upper clip range: ratios above ``1 + eps_high`` stop pushing up.
        level: ``"turn"`` (equation 1) or ``"token"`` (PPO).
    """
    if level == "turn":
        log_ratio = turn_log_ratio(logprobs, old_logprobs, mask)[:, None].expand_as(logprobs)
    elif level == "token":
        log_ratio = logprobs - old_logprobs
    else:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected 'turn' or 'token'")
    ratio = torch.exp(log_ratio)  # [B, T]
    adv = advantages[:, None].to(ratio.dtype)  # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    mask = mask.to(ratio.dtype)
    per_token = -torch.minimum(unclipped, clipped) * mask
    active = (clipped < unclipped) & (mask > 0)
    return LossTerms(per_token=per_token, ratio=ratio, clipped=active)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Equation (3) per token, zero on padding. ``[B, T]``."""
    delta = ref_logprobs - logprobs
    return (torch.exp(delta) - delta - 1.0) * mask.to(logprobs.dtype)
