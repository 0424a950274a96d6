"""From recorded turns to the loss of one role: padding, grouping, the objective, statistics.

This is the glue between ``Turn`` lists and the tensor math of ``losses.py``; it never
touches an optimizer. One update of a role:

  * picks the role's turns (a minibatch, whole sequences when the level needs them), each
    with its *sequence*: the trajectory it belongs to (GSPO's "whole response");
  * computes per-row aggregation weights once for the whole update, so the loss does not
    depend on how the turns are split into micro-batches;
  * per micro-batch: recomputes log-probs of the recorded token ids, the clipped loss with
    the configured IS level, dual clip and truncated-IS weights, the KL when it is a loss
    term, and hands the scalar to ``backward``;
  * returns sums for the logs and the clipping-bias sums of the normalization.

A planner turn's memory retrieval is a decision of its own (the query adapter's ordered
Plackett-Luce choice of k entries among the FAISS top-n). It is *not* a token of the
planner turn: folded in as one, its weight would depend on the turn's length (1/2 of a
score-mode turn, about 1/13 of a generated one). ``retrieval_loss`` gives it its own ratio
(exact: one probability per retrieval), its own clip, its own clipping-bias sums and the
planner turn's advantage, weighted by ``retrieval_coef`` against the planner's term. The
proposal set (the top-n entries FAISS returned for the adapted query) is treated as fixed:
the ratio is that of the choice within it, not of the set itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import Tensor

from hieragent.objectives.losses import (
    Aggregation,
    KLEstimator,
    Level,
    aggregate,
    aggregation_weights,
    clip_bias_sums,
    clipped_policy_loss,
    effective_sample_size,
    kl_penalty,
    logprob_gap,
    truncated_is_weights,
)
from hieragent.types import Batch, Role, Turn

TURN_INDEX_BUCKETS = 4  # clip fraction is logged for turn 0, 1, 2 and 3+ of each role


@dataclass
class ObjectiveSettings:
    """The RL objective.

    Attributes:
        level: Importance-sampling level: ``turn`` (default, ST-PPO), ``token`` (PPO) or
            ``sequence`` (GSPO: one ratio per trajectory and role).
        eps_low: Lower clip range of the ratio.
        eps_high: Upper clip range of the ratio (clip-higher when above ``eps_low``).
        dual_clip: Dual-clip bound ``c > 1`` for negative advantages; ``None`` is off.
        tis_cap: Truncated importance sampling for the rollout-engine/trainer gap: the
            trainer recomputes the behaviour log-probs at the rollout weights, clips its
            ratio against those and weights each token by ``min(pi_trainer / pi_engine,
            tis_cap)``. ``None`` is off (the engine's log-probs are the behaviour).
        clip_normalization: Clipping-triggered normalization (after ST-PPO): a role's
            optimizer step shrinks by ``lambda = 1 / (1 + strength * bias)``, where ``bias``
            measures what the clip removed (``losses.clip_normalization_scale``). lambda
            multiplies the learning rate of the role's adapter for that step (the retrieval's
            own lambda that of the query adapter), so the parameter change itself shrinks by
            lambda; scaling the gradient instead would be undone by Adam's normalisation.
            No clip, no change.
        clip_norm_strength: ``strength`` above.
        aggregation: ``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum``.
        kl_coef: Weight of the KL to the reference policy (``model.kl_reference``).
        kl_estimator: ``k1``, ``k2`` or ``k3``. As a loss, k2's gradient is that of
            KL(pi||ref) and k3's that of KL(ref||pi); k1's averages to zero, so it is
            refused with ``kl_mode: loss`` (see ``losses``, equation (13)).
        kl_mode: ``loss`` (a term of the loss) or ``reward`` (subtracted from each turn's
            reward before advantages, from the behaviour log-probs).
        kl_importance_weight: ``kl_mode: loss`` on stale samples: weight each token's KL
            term by its detached importance ratio, so it estimates the KL under the current
            policy, not the behaviour one (TRL's ``use_bias_correction_kl``); 1 on-policy.
        retrieval_coef: Weight of the memory retrieval's own clipped term (one ratio per
            planner turn that retrieved) against the planner's policy term; 0 stops the
            query adapter from learning from reward.
        minibatch_turns: Turns per optimizer step, sampled per role (per rank across
            processes); ``None`` uses all.
        micro_batch_turns: Turns per forward pass (memory only; the gradient is the same).
        max_grad_norm: Gradient clipping by norm, per optimizer param group (each adapter,
            the query adapter, the value head), so one group's large gradient never
            shrinks another's step; ``0`` turns it off.
        max_skipped_steps: Consecutive skipped optimizer steps (non-finite losses or
            gradients, or nothing to step on) after which ``fit`` stops with an error. A
            skipped step is no optimizer step, so a run in which every step is skipped would
            never reach ``trainer.max_steps``; ``0`` never stops.
    """

    level: Level = "turn"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    tis_cap: float | None = None
    clip_normalization: bool = False
    clip_norm_strength: float = 1.0
    aggregation: Aggregation = "token-mean"
    kl_coef: float = 0.01
    kl_estimator: KLEstimator = "k3"
    kl_mode: Literal["loss", "reward"] = "loss"
    kl_importance_weight: bool = True
    retrieval_coef: float = 1.0
    minibatch_turns: int | None = None
    micro_batch_turns: int = 32
    max_grad_norm: float = 1.0
    max_skipped_steps: int = 20

    def __post_init__(self) -> None:
        if self.max_skipped_steps < 0:
            raise ValueError(f"model.objective.max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        if self.level not in ("token", "turn", "sequence"):
            raise ValueError(f"model.objective.level must be token, turn or sequence, got {self.level!r}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"model.objective.dual_clip must be > 1 (or null), got {self.dual_clip}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"model.objective.tis_cap must be > 0 (or null), got {self.tis_cap}")
        if self.micro_batch_turns < 1:
            raise ValueError(f"model.objective.micro_batch_turns must be >= 1, got {self.micro_batch_turns}")
        if not (self.eps_low >= 0 and self.eps_high >= 0):
            raise ValueError(f"model.objective.eps_low and eps_high must be >= 0, got {self.eps_low} "
                             f"and {self.eps_high}")
        if self.retrieval_coef < 0:
            raise ValueError(f"model.objective.retrieval_coef must be >= 0, got {self.retrieval_coef}")
        if self.kl_in_loss and self.kl_estimator == "k1":
            raise ValueError("model.objective.kl_estimator 'k1' has zero expected gradient as a loss; use "
                             "k2 (grad of KL(pi||ref)) or k3 with kl_mode: loss, or k1 with kl_mode: reward")

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and self.kl_mode == "loss"

    @property
    def whole_sequences(self) -> bool:
        """Whether minibatches and micro-batches must keep a trajectory's turns together:
        the sequence ratio (3) needs all of them, and the per-sequence aggregations (11)-(12)
        weight rows by their sequence, computed once per update over the minibatch drawn."""
        return self.level == "sequence" or self.aggregation != "token-mean"


# -- which turns, grouped how ----------------------------------------------------------------
@dataclass
class RoleTurns:
    """One role's turns for an update, each with its sequence id and turn index."""

    turns: list[Turn] = field(default_factory=list)
    sequence_ids: list[int] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)

    def subset(self, rows: list[int]) -> RoleTurns:
        return RoleTurns([self.turns[i] for i in rows], [self.sequence_ids[i] for i in rows],
                         [self.turn_index[i] for i in rows])


def role_turns(batches: list[Batch], role: Role) -> RoleTurns:
    """Every turn of ``role`` in ``batches``; a trajectory is one sequence."""
    out, seq = RoleTurns(), 0
    for batch in batches:
        for trajectory in batch.trajectories:
            for k, turn in enumerate(trajectory.of(role)):
                out.turns.append(turn)
                out.sequence_ids.append(seq)
                out.turn_index.append(k)
            seq += 1
    return out


def sample_minibatch(items: RoleTurns, size: int | None, whole_sequences: bool,
                     generator: torch.Generator | None = None) -> RoleTurns:
    """At most ``size`` turns, drawn uniformly; whole sequences when the level needs them."""
    if size is None or len(items.turns) <= size:
        return items
    if not whole_sequences:
        picks = torch.randperm(len(items.turns), generator=generator)[:size].tolist()
        return items.subset(sorted(picks))
    rows_of: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(items.sequence_ids):
        rows_of[s].append(i)
    order = torch.randperm(len(rows_of), generator=generator).tolist()
    seqs, rows = list(rows_of), []
    for j in order:
        if rows and len(rows) + len(rows_of[seqs[j]]) > size:
            continue
        rows.extend(rows_of[seqs[j]])
    return items.subset(sorted(rows))


def micro_batches(items: RoleTurns, size: int, whole_sequences: bool) -> list[list[int]]:
    """Row indices per forward pass; a sequence is never split when ``whole_sequences``."""
    if not whole_sequences:
        return [list(range(a, min(a + size, len(items.turns)))) for a in range(0, len(items.turns), size)]
    rows_of: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(items.sequence_ids):
        rows_of[s].append(i)
    out: list[list[int]] = []
    for rows in rows_of.values():
        if out and len(out[-1]) + len(rows) <= size:
            out[-1].extend(rows)
        else:
            out.append(list(rows))
    return out


def old_logprobs_of(turn: Turn, trainer: bool = False) -> list[float]:
    """Behaviour log-probs aligned with ``Policy.turn_logprobs`` (the retrieval is not one).

    ``trainer=True`` gives the trainer's recomputation at the rollout weights where the
    rollout recorded one (truncated IS), else the engine's own.
    """
    own = turn.trainer_logprobs if trainer and turn.trainer_logprobs is not None else turn.old_logprobs
    return list(own)


def count_tokens(turns: list[Turn]) -> int:
    return sum(len(old_logprobs_of(t)) for t in turns)


def normaliser(items: RoleTurns, settings: ObjectiveSettings) -> int:
    """What the aggregation divides a role's loss by (equations (10)-(12)): its tokens for
    ``token-mean``, its sequences with tokens otherwise. Across processes the loss is
    normalised by the sum over ranks, passed to ``role_loss`` as ``weight_scale``."""
    if settings.aggregation == "token-mean":
        return count_tokens(items.turns)
    return len({s for s, t in zip(items.sequence_ids, items.turns) if old_logprobs_of(t)})


def retrieval_count(items: RoleTurns, settings: ObjectiveSettings) -> int:
    """The retrievals ``retrieval_loss`` averages over."""
    return 0 if settings.retrieval_coef == 0 else sum(t.retrieval is not None for t in items.turns)


# -- the loss of a micro-batch -----------------------------------------------------------------
@dataclass
class ChunkLoss:
    """One micro-batch's contribution to the loss, and its sums for logging."""

    loss: Tensor
    policy_sum: float
    kl_sum: float
    clipped: int
    dual_clipped: int
    tokens: int
    ratios: Tensor  # [n] the real tokens' ratios, detached
    bias_sum: float
    adv_sum: float
    gap_sum: float
    clipped_rows: list[int]  # clipped tokens per row
    tokens_rows: list[int]  # real tokens per row


def chunk_loss(logprobs: list[Tensor], ref_logprobs: list[Tensor] | None, turns: list[Turn],
               row_weights: Tensor, settings: ObjectiveSettings,
               sequence_ids: list[int] | None = None) -> ChunkLoss:
    """Clipped loss (+ KL) of a micro-batch: ``sum_b w_b * sum_t l_b,t``.

    Args:
        logprobs: Per turn, the current log-probs (``Policy.turn_logprobs``).
        ref_logprobs: Per turn, reference log-probs of the policy's own tokens (a retrieval
            has no reference and is left out of the KL), or ``None``.
        turns: The turns, whose ``advantage`` is already assigned.
        row_weights: ``[B]`` aggregation weights of these rows (``aggregation_weights``
            over the whole update, sliced).
        sequence_ids: Per turn, its sequence (for ``level: sequence``).
    """
    for lp_row, turn in zip(logprobs, turns):
        if len(lp_row) != len(old_logprobs_of(turn)):
            raise ValueError(f"{turn.role} turn {turn.text!r} (policy version {turn.policy_version}): the "
                             f"recomputed log-probs have {len(lp_row)} entries, its behaviour log-probs "
                             f"{len(old_logprobs_of(turn))}; the recorded ids and the recomputation disagree")
    lp, mask = pad_rows(logprobs)  # [B, T]
    as_tensor = lambda rows: pad_rows(  # noqa: E731
        [torch.tensor(r, dtype=lp.dtype, device=lp.device) for r in rows], lp.shape[1])[0]
    engine = as_tensor([old_logprobs_of(t) for t in turns])  # [B, T]
    old, is_weights, gap = engine, None, 0.0
    if settings.tis_cap is not None:
        old = as_tensor([old_logprobs_of(t, trainer=True) for t in turns])  # [B, T]
        is_weights = truncated_is_weights(old, engine, mask, settings.tis_cap)
        gap = logprob_gap(old, engine, mask) * float(mask.sum())
    adv = torch.tensor([t.advantage for t in turns], dtype=lp.dtype, device=lp.device)  # [B]
    seq = torch.tensor(sequence_ids, device=lp.device) if sequence_ids is not None else None
    terms = clipped_policy_loss(lp, old, adv, mask, settings.eps_low, settings.eps_high,
                                settings.level, seq, settings.dual_clip, is_weights)
    policy = aggregate(terms.per_token, row_weights)
    kl = lp.new_zeros(())
    if ref_logprobs is not None:
        ref, ref_mask = pad_rows([r.to(lp.dtype) for r in ref_logprobs], lp.shape[1])  # [B, T]
        per_token_kl = kl_penalty(lp, ref, ref_mask, settings.kl_estimator)  # [B, T]
        if settings.kl_importance_weight:  # samples came from pi_old: weight to pi_theta
            per_token_kl = per_token_kl * terms.ratio.detach()
        kl = aggregate(per_token_kl, row_weights)
    loss = policy + settings.kl_coef * kl
    real = mask > 0
    bias_sum, adv_sum = clip_bias_sums(terms, adv, mask)
    return ChunkLoss(
        loss=loss, policy_sum=float(policy.detach()), kl_sum=float(kl.detach()),
        clipped=int(terms.clipped.sum()), dual_clipped=int(terms.dual_clipped.sum()),
        tokens=int(real.sum()), ratios=terms.ratio.detach()[real].double().cpu(),
        bias_sum=bias_sum, adv_sum=adv_sum, gap_sum=gap,
        clipped_rows=terms.clipped.sum(-1).tolist(), tokens_rows=real.sum(-1).tolist(),
    )


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


# -- one role, all micro-batches ---------------------------------------------------------------
@dataclass
class RoleStats:
    """Sums over one role's update, for the logs and the normalization."""

    finite: bool = True
    policy: float = 0.0
    kl: float = 0.0
    clipped: int = 0
    dual_clipped: int = 0
    tokens: int = 0
    ratios: list[Tensor] = field(default_factory=list)
    bias_sum: float = 0.0
    adv_sum: float = 0.0
    gap_sum: float = 0.0
    turns: int = 0
    bad_turns: list[Turn] = field(default_factory=list)  # the micro-batch whose loss was not finite
    clipped_by_index: list[int] = field(default_factory=lambda: [0] * TURN_INDEX_BUCKETS)
    tokens_by_index: list[int] = field(default_factory=lambda: [0] * TURN_INDEX_BUCKETS)

    def add(self, part: ChunkLoss, turn_index: list[int]) -> None:
        self.policy += part.policy_sum
        self.kl += part.kl_sum
        self.clipped += part.clipped
        self.dual_clipped += part.dual_clipped
        self.tokens += part.tokens
        self.ratios.append(part.ratios)
        self.bias_sum += part.bias_sum
        self.adv_sum += part.adv_sum
        self.gap_sum += part.gap_sum
        for k, c, n in zip(turn_index, part.clipped_rows, part.tokens_rows):
            b = min(k, TURN_INDEX_BUCKETS - 1)
            self.clipped_by_index[b] += int(c)
            self.tokens_by_index[b] += int(n)

    def logged(self, role: str) -> dict[str, float]:
        n = max(self.tokens, 1)
        ratios = torch.cat(self.ratios) if self.ratios else torch.ones(0, dtype=torch.float64)  # [n]
        out = {f"{role}/loss": self.policy, f"{role}/kl": self.kl, f"{role}/clip_frac": self.clipped / n,
               f"{role}/dual_clip_frac": self.dual_clipped / n,
               f"{role}/ratio_mean": float(ratios.mean()) if ratios.numel() else 1.0,
               f"{role}/ratio_max": float(ratios.max()) if ratios.numel() else 1.0,
               f"{role}/ratio_min": float(ratios.min()) if ratios.numel() else 1.0,
               # Kish effective sample size of the IS weights, as a fraction of the tokens
               f"{role}/ess": effective_sample_size(ratios, torch.ones_like(ratios)),
               f"{role}/turns": float(self.turns)}
        for b in range(TURN_INDEX_BUCKETS):
            if self.tokens_by_index[b]:
                name = f"{b}" if b < TURN_INDEX_BUCKETS - 1 else f"{b}plus"
                out[f"{role}/clip_frac_turn{name}"] = self.clipped_by_index[b] / self.tokens_by_index[b]
        return out


def role_loss(policy, items: RoleTurns, settings: ObjectiveSettings,
              backward: Callable[[Tensor], None], weight_scale: float = 1.0) -> RoleStats:
    """Forward and backward over one role's turns; stops at the first non-finite loss.

    ``weight_scale`` multiplies the aggregation weights: across processes, this rank's
    ``normaliser`` over the sum of all ranks', so the ranks' summed gradients are those of
    one process holding every rank's turns.
    """
    stats = RoleStats(turns=len(items.turns))
    whole = settings.whole_sequences
    lengths = torch.tensor([len(old_logprobs_of(t)) for t in items.turns])
    weights = aggregation_weights(lengths, torch.tensor(items.sequence_ids), settings.aggregation) * weight_scale
    for rows in micro_batches(items, settings.micro_batch_turns, whole):
        chunk = items.subset(rows)
        ref = policy.reference_logprobs(chunk.turns) if settings.kl_in_loss else None
        part = chunk_loss(policy.turn_logprobs(chunk.turns), ref, chunk.turns, weights[rows],
                          settings, chunk.sequence_ids)
        if not torch.isfinite(part.loss):
            stats.finite, stats.bad_turns = False, chunk.turns
            return stats
        backward(part.loss)
        stats.add(part, chunk.turn_index)
    return stats


def retrieval_loss(planner, items: RoleTurns, settings: ObjectiveSettings,
                   backward: Callable[[Tensor], None], weight_scale: float = 1.0) -> RoleStats:
    """The retrieval's own clipped term over the planner turns that retrieved (see the top).

    One row per retrieval, one "token" each: the log-probability of the ordered choice, so
    every IS level gives the same exact ratio. Rows are averaged and weighted by
    ``retrieval_coef``; the advantage is the planner turn's. No KL: a retrieval has no
    reference, and no truncated IS: the trainer computes it exactly as the rollout did.
    ``weight_scale``: as in ``role_loss``, over ``retrieval_count``.
    """
    turns = [t for t in items.turns if t.retrieval is not None]
    stats = RoleStats(turns=len(turns))
    if not turns or settings.retrieval_coef == 0:
        return stats
    lp = planner.retrieval_logprobs(turns)[:, None]  # [R, 1]
    old = torch.tensor([[t.retrieval.old_logprob] for t in turns], dtype=lp.dtype, device=lp.device)  # [R, 1]
    adv = torch.tensor([t.advantage for t in turns], dtype=lp.dtype, device=lp.device)  # [R]
    mask = torch.ones_like(lp)  # [R, 1]
    terms = clipped_policy_loss(lp, old, adv, mask, settings.eps_low, settings.eps_high, "token",
                                None, settings.dual_clip)
    policy = aggregate(terms.per_token, aggregation_weights(torch.ones(len(turns)), None, "token-mean"))
    if not torch.isfinite(policy):
        stats.finite, stats.bad_turns = False, turns
        return stats
    backward(settings.retrieval_coef * weight_scale * policy)
    stats.policy = float(policy.detach())
    stats.clipped, stats.dual_clipped = int(terms.clipped.sum()), int(terms.dual_clipped.sum())
    stats.tokens = len(turns)
    stats.ratios.append(terms.ratio.detach()[:, 0].double().cpu())
    stats.bias_sum, stats.adv_sum = clip_bias_sums(terms, adv, mask)
    return stats
