"""GRPO-style group-normalised advantages, with credit assigned per policy.

Several rollouts share an environment seed and form a group (GRPO, arXiv 2402.03300).
Each turn first gets a *credit*, then credits are normalised within (group, role):

  * planner turn s of an episode with segment returns R_0..R_S (the extrinsic reward
    collected while its subgoal was pursued):  c_s = sum_{s' >= s} gamma^(s'-s) R_s'.
    A subgoal is credited with the return of its segment and of what it led to; with a
    sparse final reward, "return of its segment" alone would leave every earlier
    subgoal with zero credit.
  * executor turn t inside a segment, with rewards r_t = extrinsic + intrinsic subgoal
    reward:  c_t = sum_{t' >= t, same segment} gamma^(t'-t) r_t'.

    A_i = (c_i - mean_g(c)) / (std_g(c) + eps)      (mean-only when scale_by_std=False)

A group whose credits are all equal (every episode succeeded, say) gets zero advantage,
never NaN.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from hieragent.types import ROLES, Batch, Trajectory, Turn


def discounted_to_go(rewards: list[float], gamma: float) -> list[float]:
    """``out[t] = sum_{t' >= t} gamma^(t'-t) rewards[t']``."""
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def turn_credits(trajectory: Trajectory, gamma: float = 1.0) -> list[tuple[Turn, float]]:
    """Pair every turn of an episode with its credit (see the module docstring)."""
    planner = trajectory.of("planner")
    credits: list[tuple[Turn, float]] = list(
        zip(planner, discounted_to_go([t.reward for t in planner], gamma))
    )
    by_segment: dict[int, list[Turn]] = defaultdict(list)
    for turn in trajectory.of("executor"):
        by_segment[turn.segment].append(turn)
    for turns in by_segment.values():
        credits.extend(zip(turns, discounted_to_go([t.reward for t in turns], gamma)))
    return credits


def normalise(values: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Centre (and scale) one group's credits; equal credits give exact zeros."""
    centred = values - values.mean()
    if not scale_by_std:
        return centred
    std = values.std(unbiased=False)
    if std < 1e-8:
        return torch.zeros_like(values)
    return centred / (std + eps)


def assign_advantages(batch: Batch, gamma: float = 1.0, scale_by_std: bool = True) -> Batch:
    """Set ``Turn.advantage`` for every turn of the batch, normalised per (group, role)."""
    pools: dict[tuple[int, str], list[tuple[Turn, float]]] = defaultdict(list)
    for trajectory in batch.trajectories:
        for turn, credit in turn_credits(trajectory, gamma):
            pools[(trajectory.group, turn.role)].append((turn, credit))
    for (_, role), pairs in pools.items():
        assert role in ROLES
        adv = normalise(torch.tensor([c for _, c in pairs], dtype=torch.float64), scale_by_std)
        for (turn, _), a in zip(pairs, adv.tolist()):
            turn.advantage = a
    return batch
