"""The guarded optimizer step shared by RL updates and the supervised warm start.

One call per update, after every backward:

  * each param group's gradient is clipped by its *own* norm (``max_grad_norm``), so a
    large value or contrastive loss never shrinks a policy's step;
  * a non-finite norm in any group skips the step: gradients are zeroed and neither the
    weights nor the optimizer state are touched;
  * otherwise the step runs with each group's learning rate multiplied by its
    ``lr_scales`` entry for this step only. With AdamW the parameter change is then exactly
    ``scale`` times the unscaled one (decoupled weight decay included), which is what the
    clipping-triggered normalization needs; a scaled *gradient* would be undone by Adam's
    division by its running RMS.

Groups are named by the ``"name"`` key of their param group (``executor``, ``planner``,
``query_adapter``, ``value``).

Across processes ``agree_on_step`` runs first, so that every rank takes the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hieragent.lightning.distributed import all_sum, sum_gradients
from hieragent.objectives.losses import clip_normalization_scale

# the param group each clipped loss term steps (its clipping-triggered normalization)
LOSS_GROUPS = {"planner": "planner", "executor": "executor", "retrieval": "query_adapter"}


@dataclass
class StepResult:
    """What one guarded step did.

    Attributes:
        skipped: Why the step was skipped, or ``None`` if it ran.
        grad_norms: Pre-clip gradient norm per group that had gradients.
        update_norms: ``||theta_after - theta_before||`` per group (0 when skipped).
        lr_scales: The learning-rate factor applied to each group (1 when not scaled).
    """

    skipped: str | None = None
    grad_norms: dict[str, float] = field(default_factory=dict)
    update_norms: dict[str, float] = field(default_factory=dict)
    lr_scales: dict[str, float] = field(default_factory=dict)

    @property
    def grad_norm(self) -> float:
        """The global pre-clip norm over all groups (nan without gradients)."""
        if not self.grad_norms:
            return math.nan
        return math.sqrt(sum(n * n for n in self.grad_norms.values()))


def guarded_step(optimizer, max_grad_norm: float, lr_scales: dict[str, float] | None = None,
                 skip: str | None = None) -> StepResult:
    """Clip per group, skip on non-finite, step with scaled learning rates; see the module doc.

    Args:
        optimizer: A torch optimizer (or Lightning's wrapper) whose param groups have names.
        max_grad_norm: Largest gradient norm of one group; ``0`` turns clipping off.
        lr_scales: Learning-rate factor per group name for this step; others get 1.
        skip: A reason found earlier (a non-finite loss, say): skip without looking.
    """
    lr_scales = lr_scales or {}
    for name, scale in lr_scales.items():
        if not 0.0 <= scale <= 1.0:
            raise ValueError(f"learning-rate scale of group '{name}' must lie in [0, 1], got {scale}")
    result = StepResult(skipped=skip)
    groups = [(g.get("name", str(i)), g, [p for p in g["params"] if p.grad is not None])
              for i, g in enumerate(optimizer.param_groups)]
    groups = [(name, g, params) for name, g, params in groups if params]
    if result.skipped is None and not groups:
        result.skipped = "no gradients to step on"
    if result.skipped is None:
        limit = max_grad_norm if max_grad_norm > 0 else math.inf
        for name, _, params in groups:
            norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
            result.grad_norms[name] = norm
            if not math.isfinite(norm):
                result.skipped = f"non-finite gradient norm in param group '{name}'"
    if result.skipped is not None:
        optimizer.zero_grad()  # a NaN or inf never reaches the weights or the optimizer state
        return result
    before = {name: [p.detach().clone() for p in params] for name, _, params in groups}
    base_lr = {name: g["lr"] for name, g, _ in groups}
    for name, g, _ in groups:
        scale = float(lr_scales.get(name, 1.0))
        result.lr_scales[name] = scale
        g["lr"] = base_lr[name] * scale
    try:
        optimizer.step()
    finally:
        for name, g, _ in groups:
            g["lr"] = base_lr[name]
    for name, _, params in groups:
        sq = sum(float((p.detach() - b).double().pow(2).sum()) for p, b in zip(params, before[name]))
        result.update_norms[name] = math.sqrt(sq)
    return result


def agree_on_step(optimizer, skip: str | None, sums: dict[str, tuple[float, float]],
                  clip_normalization: bool, strength: float,
                  stats: dict[str, float]) -> tuple[str | None, dict[str, float]]:
    """The same step on every rank; in one process, what that process found.

    A skip if any rank skips; gradients summed over ranks, where a parameter that no rank
    touched keeps ``None`` (so AdamW leaves it and its state alone, as in one process); and
    the clipping-triggered normalization from the clipping sums ``(bias, adv)`` of every
    rank, per loss term of ``LOSS_GROUPS``, logged into ``stats``. Returns the skip and the
    learning-rate scales for ``guarded_step``.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    local = [float(skip is not None)] + [float(p.grad is not None) for p in params]
    for name in LOSS_GROUPS:
        local += list(sums.get(name, (0.0, 0.0)))
    total = all_sum(local, "update stats").tolist()
    if skip is None and total[0] > 0:
        skip = "non-finite loss on another rank"
    if skip is not None:
        return skip, {}
    touched = [bool(n) for n in total[1:1 + len(params)]]
    for p, anywhere in zip(params, touched):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)
    sum_gradients([p for p, anywhere in zip(params, touched) if anywhere])
    scales: dict[str, float] = {}
    if clip_normalization:
        at = 1 + len(params)
        for k, (name, group) in enumerate(LOSS_GROUPS.items()):
            bias, adv = total[at + 2 * k], total[at + 2 * k + 1]
            if name not in sums and bias == 0 and adv == 0:
                continue  # no rank had this term
            scales[group] = clip_normalization_scale(bias, adv, strength)
            stats[f"{name}/clip_norm_scale"] = scales[group]
            stats[f"{name}/clip_norm_triggered"] = float(scales[group] < 1.0)
    return skip, scales
