"""The clipped policy objective, its importance-sampling levels, aggregation and KL.

Every function is plain tensor math on padded rows. Shapes: ``B`` rows (one *turn*,
a planner or executor output, each), ``T`` padded tokens; ``mask`` is 1 on real tokens.
Padding may hold anything, inf and nan included: it is removed with ``torch.where``
before any arithmetic, so it reaches neither a value nor a gradient.

Importance ratio. With ``logprobs`` under the policy being trained and ``old_logprobs``
under the behaviour policy, the log-ratio a token is weighted by is, per ``level``:

    token    (PPO, 1707.06347):   rho_t = log pi_theta(y_t) - log pi_old(y_t)                (1)
    turn     (SORL, 2511.20718):  rho_i = (1/|y_i|) sum_{t in i} rho_t, shared by the turn   (2)
    sequence (GSPO, 2507.18071):  rho_s = (1/sum_{i in s}|y_i|) sum_{i in s} sum_t rho_t     (3)

where a sequence ``s`` is one trajectory's turns of one role (``sequence_ids``); with one
turn per sequence (3) is (2), bitwise. The ratio is r_t = exp(clamp(rho, -20, 20)); padding
gets r = 1. The clamp (as in verl) keeps exp finite: an overflowed ratio times a zero
upstream gradient is nan in the backward pass, and that would stall training. Beyond the
clamp the gradient through rho is cut; such a token is far outside any clip range anyway.

Clipped objective, with clip-higher (DAPO, 2503.14476) and dual clip (Ye et al.,
1912.09729, c > 1, only for A_t < 0):

    l_t = -min( r_t A_t,  clip(r_t, 1 - eps_low, 1 + eps_high) A_t )                   (4)
    l_t = min( l_t, -c A_t )                                         if A_t < 0       (5)

A token is *clipped* where a bound of (4) or (5) is the active branch (its gradient is cut).

Truncated importance sampling for the rollout-engine / trainer mismatch (TIS, Yao et al.
2025, "Your efficient RL framework secretly brings you off-policy RL training"):

    w_t = min( exp(log pi_trainer(y_t) - log pi_engine(y_t)),  C ),   l_t <- w_t l_t    (6)
    gap = mean_t | log pi_trainer(y_t) - log pi_engine(y_t) |                           (7)

Clipping-triggered normalization (after ST-PPO / SORL, 2511.20718; that paper's exact
equations were not available, so this is our rule). The clip's bias on a token is the gap
between the unclipped importance-sampled loss -r_t A_t and the loss (4)-(5) actually used:

    b_t = | -r_t A_t - l_t |                                                            (8)

which is 0 on unclipped tokens, |A_t| |r_t - clip(r_t)| on tokens clipped by (4) (the
distance from r_t to the violated bound), and |A_t| (r_t - c) on tokens bounded by (5).
Summed over the whole update (b_t before the TIS weight of (6)), the loss is scaled by
(kappa is ``strength``)

    lambda = 1 / (1 + kappa * sum_t b_t / sum_t |A_t|)                                  (9)

exactly 1 when nothing is clipped, kappa = 0 or all advantages are 0; it falls towards 0
as clipping grows and is 0 (the limit) when the bias sum overflowed to inf. Being one
scalar, lambda may also multiply the accumulated gradient before the optimizer step.

Aggregation: L = sum_b w_b sum_t l_b,t, with S the number of sequences with tokens,
N the update's token count, n_s the tokens of row b's sequence s, and w_b = 0 for a row
without tokens:

    token-mean:          w_b = 1 / N                                                  (10)
    seq-mean-token-mean: w_b = 1 / (S n_s)                                            (11)
    seq-mean-token-sum:  w_b = 1 / S                                                  (12)

KL to the reference (Schulman, "Approximating KL divergence", 2020), d = log pi_ref -
log pi_theta:  k1 = -d,  k2 = d^2 / 2,  k3 = exp(d) - d - 1 >= 0.                    (13)

As *values* on samples y ~ pi_theta, k1 and k3 are unbiased estimates of KL(pi_theta||ref).
As *loss terms* differentiated through log pi_theta (samples held fixed, the usual "KL in
the loss" of GRPO), their expected gradients differ; with grad d = -grad log pi_theta and
E[grad log pi_theta] = 0:

    k1:  E[grad k1] = E[grad log pi_theta] = 0: noise only, no pull to the reference;
    k2:  E[grad k2] = E[(log pi_theta - log pi_ref) grad log pi_theta] = grad KL(pi_theta||ref);
    k3:  E[grad k3] = E[(1 - pi_ref/pi_theta) grad log pi_theta] = grad KL(ref||pi_theta).

So ``kl_mode: loss`` with k2 is the reverse-KL gradient, k3 the forward-KL one (mass-covering,
what GRPO and verl's ``low_var_kl`` use), and k1 is refused there. As a reward penalty
(``kl_mode: reward``) every estimator is a number, and k1 is the standard choice. With stale
samples y ~ pi_old each token's KL term is weighted by the detached ratio r_t, so it
estimates the expectation under pi_theta (TRL's ``use_bias_correction_kl``); on-policy r = 1.

Effective sample size of the ratios over n real tokens: (sum r)^2 / (n sum r^2).      (14)

In ``score`` mode a turn has one "token": the chosen candidate's log-probability under
the candidate softmax, so (2) is that softmax's ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

Level = Literal["token", "turn", "sequence"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]


def _choice(value: str, options, what: str) -> str:
    if value not in get_args(options):
        known = ", ".join(repr(o) for o in get_args(options))
        raise ValueError(f"unknown {what} {value!r}; expected one of {known}")
    return value


def _per_token(values: Tensor, mask: Tensor, fill: float) -> Tensor:
    """``[B]`` or ``[B, T]`` values as ``[B, T]``, with ``fill`` on padding."""
    real = mask > 0  # [B, T]
    values = values[:, None] if values.dim() == 1 else values
    return torch.where(real, values.expand(real.shape), fill)


def _group_ids(sequence_ids: Tensor | None, n_rows: int, device) -> Tensor:
    """Dense ids 0..S-1 of the rows' sequences; each row is its own without ids. ``[B]``"""
    if sequence_ids is None:
        return torch.arange(n_rows, device=device)
    return torch.unique(sequence_ids, return_inverse=True)[1]


MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8; beyond it the ratio is clamped (as in verl)


def turn_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Equation (2): the mean of a turn's token log-ratios. ``[B]``; 0 for an empty turn."""
    delta = _per_token(logprobs - old_logprobs, mask, 0.0)  # [B, T]
    n_tokens = (mask > 0).sum(-1).to(delta.dtype)  # [B]
    return delta.sum(-1) / n_tokens.clamp(min=1.0)


def log_ratio(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    level: Level = "turn",
    sequence_ids: Tensor | None = None,
) -> Tensor:
    """Equations (1)-(3): the log-ratio each token is weighted by, 0 on padding.

    Args:
        logprobs: ``[B, T]`` current policy.
        old_logprobs: ``[B, T]`` behaviour policy.
        mask: ``[B, T]`` 1 for real tokens, 0 for padding.
        level: ``"token"`` (1), ``"turn"`` (2) or ``"sequence"`` (3).
        sequence_ids: ``[B]`` the sequence of each row, for ``"sequence"``; ``None``
            makes every row its own sequence, which is ``"turn"``.

    Returns:
        ``[B, T]``.
    """
    _choice(level, Level, "importance-sampling level")
    real = mask > 0  # [B, T]
    delta = torch.where(real, logprobs - old_logprobs, 0.0)  # [B, T]
    if level == "token":
        return delta
    n_tokens = real.sum(-1).to(delta.dtype)  # [B]
    sums = delta.sum(-1)  # [B]
    if level == "sequence":
        group = _group_ids(sequence_ids, len(sums), sums.device)  # [B]
        n_groups = int(group.max()) + 1 if len(group) else 0
        sums = sums.new_zeros(n_groups).index_add(0, group, sums)[group]  # [B]
        n_tokens = n_tokens.new_zeros(n_groups).index_add(0, group, n_tokens)[group]  # [B]
    shared = sums / n_tokens.clamp(min=1.0)  # [B]
    return torch.where(real, shared[:, None], 0.0)


@dataclass
class LossTerms:
    """Per-token terms of the clipped objective and what the logs need.

    Attributes:
        per_token: ``[B, T]`` equations (4)-(6), zero on padding.
        ratio: ``[B, T]`` the ratio each token was weighted by, 1 on padding.
        clipped: ``[B, T]`` bool, where a bound of (4) or (5) was the active branch.
        dual_clipped: ``[B, T]`` bool, where the bound of (5) was the active branch.
        bias: ``[B, T]`` equation (8), zero on unclipped tokens and padding.
    """

    per_token: Tensor
    ratio: Tensor
    clipped: Tensor
    dual_clipped: Tensor
    bias: Tensor


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    level: Level = "turn",
    sequence_ids: Tensor | None = None,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
) -> LossTerms:
    """Equations (4)-(6) for every token, with the ratio of ``level`` (1)-(3).

    Args:
        logprobs: ``[B, T]``.
        old_logprobs: ``[B, T]``.
        advantages: ``[B]`` one per turn, or ``[B, T]`` one per token.
        mask: ``[B, T]``.
        eps_low: Lower clip range: ratios below ``1 - eps_low`` stop pushing down.
        eps_high: Upper clip range: ratios above ``1 + eps_high`` stop pushing up.
        level: ``"turn"``, ``"token"`` or ``"sequence"``; see ``log_ratio``.
        sequence_ids: ``[B]`` for ``level="sequence"``.
        dual_clip: ``c > 1`` of (5), bounding the loss of negative advantages; ``None``
            turns it off.
        is_weights: ``[B, T]`` truncated-IS weights of (6) (``truncated_is_weights``);
            treated as constants.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}; use None to turn it off")
    real = mask > 0  # [B, T]
    rho = log_ratio(logprobs, old_logprobs, mask, level, sequence_ids)  # [B, T]
    ratio = torch.exp(rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B, T]
    adv = _per_token(advantages.to(ratio.dtype), mask, 0.0)  # [B, T]
    unclipped = ratio * adv
    bounded = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, bounded)  # [B, T] (4)
    clipped = bounded < unclipped
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        floor = -dual_clip * adv
        dual = (adv < 0) & (floor < loss)
        loss = torch.where(dual, floor, loss)  # (5)
        clipped = clipped | dual
    clipped, dual = clipped & real, dual & real
    # where, not subtraction everywhere: an overflowed ratio times a zero advantage is nan
    bias = torch.where(clipped, (-unclipped - loss).abs(), 0.0).detach()  # [B, T] (8)
    if is_weights is not None:
        loss = loss * torch.where(real, is_weights.to(loss.dtype), 1.0).detach()  # (6)
    per_token = torch.where(real, loss, 0.0)
    return LossTerms(per_token=per_token, ratio=ratio, clipped=clipped, dual_clipped=dual, bias=bias)


def truncated_is_weights(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Equation (6)'s ``w_t``: detached, capped at ``cap``, 1 on padding. ``[B, T]``

    Args:
        trainer_logprobs: ``[B, T]`` the behaviour policy as the trainer computes it.
        engine_logprobs: ``[B, T]`` the same tokens as the rollout engine sampled them.
        mask: ``[B, T]``.
        cap: ``C``, the largest weight; TIS uses about 2.
    """
    if not cap > 0:
        raise ValueError(f"the truncated-IS cap must be > 0, got {cap}")
    delta = torch.where(mask > 0, trainer_logprobs - engine_logprobs, 0.0).detach()  # [B, T]
    return torch.exp(delta).clamp(max=cap)


def logprob_gap(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> float:
    """Equation (7): mean absolute log-prob difference over real tokens; 0 with none."""
    real = mask > 0  # [B, T]
    delta = torch.where(real, trainer_logprobs - engine_logprobs, 0.0).detach().double()  # [B, T]
    n = int(real.sum())
    return float(delta.abs().sum()) / n if n else 0.0


def clip_bias_sums(terms: LossTerms, advantages: Tensor, mask: Tensor) -> tuple[float, float]:
    """The two sums of (9) for one micro-batch: ``(sum_t b_t, sum_t |A_t|)`` over real tokens.

    Add them up over the micro-batches of an update, then call ``clip_normalization_scale``.
    """
    adv = _per_token(advantages.detach().double(), mask, 0.0)  # [B, T]
    return float(terms.bias.double().sum()), float(adv.abs().sum())


def clip_normalization_scale(bias_sum: float, adv_sum: float, strength: float = 1.0) -> float:
    """Equation (9): ``1 / (1 + strength * bias_sum / adv_sum)``, always finite, in [0, 1].

    Exactly 1.0 when ``bias_sum``, ``adv_sum`` or ``strength`` is 0; 0.0 (the limit)
    when ``bias_sum`` is inf, which only an overflowed ratio produces.
    """
    for name, value in (("bias_sum", bias_sum), ("adv_sum", adv_sum), ("strength", strength)):
        if math.isnan(value) or value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}; a nan usually means a nan loss upstream")
    if bias_sum == 0 or adv_sum == 0 or strength == 0:
        return 1.0
    if math.isinf(bias_sum):
        return 0.0
    return 1.0 / (1.0 + strength * (bias_sum / adv_sum))


def aggregation_weights(lengths: Tensor, sequence_ids: Tensor | None, mode: Aggregation) -> Tensor:
    """Equations (10)-(12): the weight ``w_b`` of each row's summed per-token loss.

    Compute them once for the whole update and slice them per micro-batch, so the loss
    does not depend on how the update is split.

    Args:
        lengths: ``[B]`` real tokens per row.
        sequence_ids: ``[B]`` the sequence of each row; ``None``: each row is one.
        mode: ``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum"``.

    Returns:
        ``[B]`` float64, 0 for rows without tokens.
    """
    _choice(mode, Aggregation, "loss aggregation")
    n = lengths.to(torch.float64)  # [B]
    has_tokens = n > 0
    if mode == "token-mean":
        weights = 1.0 / n.sum().clamp(min=1.0)
        return torch.where(has_tokens, weights, 0.0)
    group = _group_ids(sequence_ids, len(n), n.device)  # [B]
    n_groups = int(group.max()) + 1 if len(group) else 0
    seq_tokens = n.new_zeros(n_groups).index_add(0, group, n)  # [S_all]
    n_seqs = (seq_tokens > 0).sum().clamp(min=1).to(n.dtype)
    if mode == "seq-mean-token-mean":
        weights = 1.0 / (n_seqs * seq_tokens[group].clamp(min=1.0))  # [B]
    else:
        weights = (1.0 / n_seqs).expand_as(n)
    return torch.where(has_tokens, weights, 0.0)


def aggregate(per_token: Tensor, weights: Tensor) -> Tensor:
    """``L = sum_b w_b sum_t l_b,t`` of (10)-(12). ``per_token`` ``[B, T]`` is zero on padding."""
    return (per_token.sum(-1) * weights.to(per_token.dtype)).sum()


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Equation (13) per token, zero on padding. ``[B, T]``

    Args:
        logprobs: ``[B, T]`` the policy.
        ref_logprobs: ``[B, T]`` the reference.
        mask: ``[B, T]``.
        estimator: ``"k1"`` (unbiased, can be negative), ``"k2"`` or ``"k3"``
            (unbiased, >= 0, low variance). As a loss their gradients differ: see (13).
    """
    _choice(estimator, KLEstimator, "KL estimator")
    d = torch.where(mask > 0, ref_logprobs - logprobs, 0.0)  # [B, T]
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    return torch.exp(d) - d - 1.0


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``kl_penalty(..., "k3")``. ``[B, T]``"""
    return kl_penalty(logprobs, ref_logprobs, mask, "k3")


def effective_sample_size(ratio: Tensor, mask: Tensor) -> float:
    """Equation (14) over real tokens, in (0, 1]; 1.0 without tokens.

    Weights are divided by their largest first, so huge ratios do not overflow the square;
    0.0 if every ratio underflowed to 0, and (number of inf ratios) / n if any overflowed.
    """
    real = mask > 0  # [B, T]
    w = ratio.detach().double()[real]  # [n]
    if w.numel() == 0:
        return 1.0
    top = w.max()
    if not top > 0:
        return 0.0
    if math.isinf(top):
        return float((w == top).sum()) / w.numel()
    w = w / top
    return float(w.sum() ** 2 / (w.numel() * (w**2).sum()))
