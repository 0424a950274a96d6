"""Turn advantages: credit per policy, compared within groups, four estimators.

Several rollouts share an environment seed and form a group (``Trajectory.group``). Every
turn first gets a *credit*, its discounted return-to-go along its *credit chain*:

  * planner turn s of an episode with segment returns R_0..R_S (the extrinsic reward
    collected while its subgoal was pursued):  c_s = sum_{s' >= s} gamma^(s'-s) R_s'.
    A subgoal is credited with the return of its segment and of what it led to; with a
    sparse final reward, "return of its segment" alone would leave every earlier
    subgoal with zero credit.
  * executor turn t inside a segment, with rewards r_t = extrinsic + intrinsic subgoal
    reward:  c_t = sum_{t' >= t, same segment} gamma^(t'-t) r_t'. The executor is
    conditioned on its subgoal, so its episode is the segment.

Credits are compared within a *pool* P. ``normalize_by="role"`` pools (group, role): the
agent-wise normalisation of Dr. MAS (Feng et al. 2026, arXiv 2602.08847), which shows that
one baseline shared by agents with different reward distributions (here segment returns
vs. step rewards with a subgoal bonus) destabilises the gradient. ``"joint"`` pools all
turns of a group regardless of role.

  grpo   GRPO (Shao et al. 2024, arXiv 2402.03300, Sec. 4.1.2), per turn:
             A_i = (c_i - mean_P c) / (std_P c + eps)          (mean-only: scale_by_std=False)
         Intended as the paper defines it: a pool holds every turn of its (group, role), so
         the mean and std include turn i itself and the other turns of i's own episode,
         whose credits follow from i's action. The baseline is then correlated with the
         action (a bias that shrinks as 1/|P|); ``rloo`` is the estimator that leaves i's
         whole episode out of its baseline and has none.
  rloo   REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740):
             A_i = c_i - mean { c_j : j in P, episode(j) != episode(i) }
         We leave out i's whole *episode*, not only turn i: the later turns of i's episode
         follow from i's action, and a baseline must not depend on it. With one turn per
         episode in the pool this is the paper's c_i - 1/(n-1) sum_{j != i} c_j.
         No std scaling (scale_by_std does not apply).
  gigpo  Group-in-Group PO (Feng et al. 2025, arXiv 2505.10978):  A_i = A^E + omega A^S_i
         A^E  episode level: GRPO over the episodes' returns R(tau) = sum of the role's
              turn rewards, within P; every turn of the episode gets its episode's A^E.
         A^S  step level: a role's turns in one group whose ``state_key`` is equal form an
              anchor-state group; GRPO over their credits c_i within it (a singleton: 0).
              Anchor groups are always per role: a planner and an executor state are never
              the same decision, whatever ``normalize_by`` says.
  gae    GAE (Schulman et al. 2016, arXiv 1506.02438, Eq. 16) along each credit chain,
         with a turn-level critic V (``value.py``):
             delta_k = r_k + gamma V_{k+1} - V_k,   V_K = 0 after the chain's last turn
             A_k = sum_{l >= 0} (gamma lam)^l delta_{k+l}
         optionally centred (and scaled) within P (``gae_normalize``).

Every estimator gives exact zeros to a pool whose values are all equal (every episode
succeeded, say), and 0 to a pool of one; never NaN.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from hieragent.types import Batch, Trajectory, Turn

Estimator = Literal["grpo", "rloo", "gigpo", "gae"]
Normalization = Literal["role", "joint"]
ESTIMATORS: tuple[Estimator, ...] = ("grpo", "rloo", "gigpo", "gae")
NORMALIZATIONS: tuple[Normalization, ...] = ("role", "joint")


@dataclass
class AdvantageSettings:
    """How turn advantages are estimated (see the module docstring for the equations).

    Attributes:
        estimator: ``grpo`` (default), ``rloo``, ``gigpo`` or ``gae`` (needs a value head).
        gamma: Discount of turn credits along a credit chain.
        scale_by_std: Divide centred values by the pool's std (GRPO) or only centre them;
            used by ``grpo``, both terms of ``gigpo`` and ``gae`` with ``gae_normalize``.
        normalize_by: ``role``: each role's turns in their own (group, role) pool
            (Dr. MAS agent-wise normalisation); ``joint``: all turns of a group together.
        gigpo_weight: GiGPO's omega, the weight of the step-level (anchor-state) term.
        gae_lambda: GAE's lambda: 1 is the return minus the value, 0 the one-turn TD error.
        gae_normalize: Centre (and with ``scale_by_std`` scale) GAE advantages in their pool.
    """

    estimator: Estimator = "grpo"
    gamma: float = 1.0
    scale_by_std: bool = True
    normalize_by: Normalization = "role"
    gigpo_weight: float = 1.0
    gae_lambda: float = 0.95
    gae_normalize: bool = False

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator '{self.estimator}'; "
                             f"known: {', '.join(ESTIMATORS)}")
        if self.normalize_by not in NORMALIZATIONS:
            raise ValueError(f"unknown normalize_by '{self.normalize_by}'; "
                             f"known: {', '.join(NORMALIZATIONS)}")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError(f"gamma and gae_lambda must lie in [0, 1]; got gamma={self.gamma}, "
                             f"gae_lambda={self.gae_lambda}")


def discounted_to_go(rewards: list[float], gamma: float) -> list[float]:
    """``out[t] = sum_{t' >= t} gamma^(t'-t) rewards[t']``."""
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def credit_chains(trajectory: Trajectory) -> list[list[Turn]]:
    """The sequences credit flows along: the planner's turns, then each segment's executor turns."""
    by_segment: dict[int, list[Turn]] = defaultdict(list)
    for turn in trajectory.of("executor"):
        by_segment[turn.segment].append(turn)
    return [chain for chain in [trajectory.of("planner"), *by_segment.values()] if chain]


def turn_credits(trajectory: Trajectory, gamma: float = 1.0) -> list[tuple[Turn, float]]:
    """Pair every turn of an episode with its credit (see the module docstring)."""
    return [pair for chain in credit_chains(trajectory)
            for pair in zip(chain, discounted_to_go([t.reward for t in chain], gamma))]


def _all_equal(values: Tensor) -> bool:
    return values.numel() == 0 or bool((values == values[0]).all())


def normalise(values: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Centre (and scale) one pool's values; equal values give exact zeros."""
    if _all_equal(values):
        return torch.zeros_like(values)
    centred = values - values.mean()
    if not scale_by_std:
        return centred
    std = values.std(unbiased=False)
    if std < 1e-8:
        return torch.zeros_like(values)
    return centred / (std + eps)


def leave_one_out(values: Tensor, episodes: Sequence[int]) -> Tensor:
    """RLOO in one pool: ``values[i]`` minus the mean of the values from other episodes. ``[n]``"""
    if _all_equal(values):
        return torch.zeros_like(values)
    episode = torch.as_tensor(list(episodes))
    others = (episode[:, None] != episode[None, :]).to(values.dtype)  # [n, n]
    n_others = others.sum(dim=1)  # [n]
    baseline = (others @ values) / n_others.clamp(min=1.0)  # [n]
    return torch.where(n_others > 0, values - baseline, torch.zeros_like(values))


def gae_advantages(rewards: Tensor, values: Tensor, gamma: float, lam: float,
                   next_value: float = 0.0) -> Tensor:
    """GAE along one chain (Schulman et al. 2016, Eq. 16). ``[K]``

    Args:
        rewards: ``r_k`` of the chain's turns. ``[K]``
        values: ``V(s_k)`` of the same turns, treated as constants. ``[K]``
        next_value: ``V`` of the state after the last turn; 0 when the chain ended, which
            every credit chain does (an episode, or a segment for the executor).
    """
    values = values.detach()
    adv = torch.zeros_like(values)  # [K]
    running, v_next = values.new_zeros(()), values.new_tensor(next_value)
    for k in range(len(values) - 1, -1, -1):
        delta = rewards[k] + gamma * v_next - values[k]
        running = delta + gamma * lam * running
        adv[k] = running
        v_next = values[k]
    return adv


def aligned_values(batch: Batch, values: Sequence[float] | Tensor | None) -> Tensor:
    """``values`` checked to hold one ``V`` per turn of ``batch.turns()``. ``[N]`` float64, CPU"""
    n = len(batch.turns())
    if values is None:
        raise ValueError("estimator 'gae' needs values: one V per turn of batch.turns(), in "
                         "that order (see hieragent.objectives.value.turn_values)")
    if isinstance(values, Tensor):
        out = values.detach().to("cpu", torch.float64).reshape(-1)  # [N]
    else:
        out = torch.tensor(list(values), dtype=torch.float64)  # [N]
    if len(out) != n:
        raise ValueError(f"values has {len(out)} entries but the batch has {n} turns; pass one "
                         "per turn of batch.turns(), in that order")
    return out


def batch_gae(batch: Batch, values: Sequence[float] | Tensor, gamma: float, lam: float) -> Tensor:
    """GAE of every turn along its credit chain, aligned with ``batch.turns()``. ``[N]``"""
    v = aligned_values(batch, values)  # [N]
    index = {id(t): i for i, t in enumerate(batch.turns())}
    adv = torch.zeros_like(v)  # [N]
    for trajectory in batch.trajectories:
        for chain in credit_chains(trajectory):
            idx = torch.tensor([index[id(t)] for t in chain])
            rewards = torch.tensor([t.reward for t in chain], dtype=torch.float64)  # [K]
            adv[idx] = gae_advantages(rewards, v[idx], gamma, lam)
    return adv


def _within(keys: list[Hashable], values: Tensor,
            fn: Callable[[Tensor, list[int]], Tensor]) -> Tensor:
    """Apply ``fn`` to the values of each key's pool; ``fn`` also gets the pool's indices."""
    pools: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        pools[key].append(i)
    out = torch.zeros_like(values)
    for idx in pools.values():
        out[idx] = fn(values[idx], idx)
    return out


def assign_advantages(batch: Batch, gamma: float = 1.0, scale_by_std: bool = True,
                      settings: AdvantageSettings | None = None,
                      values: Sequence[float] | Tensor | None = None) -> Batch:
    """Set ``Turn.advantage`` for every turn of the batch.

    Without ``settings`` this is GRPO with ``gamma`` and ``scale_by_std``, per (group, role).
    With ``settings``, leave ``gamma`` and ``scale_by_std`` at their defaults and set them
    there. ``values`` (estimator ``gae`` only): one ``V(s)`` per turn of ``batch.turns()``,
    in that order.
    """
    if settings is None:
        settings = AdvantageSettings(gamma=gamma, scale_by_std=scale_by_std)
    elif gamma != 1.0 or scale_by_std is not True:
        raise ValueError("pass gamma and scale_by_std inside settings, not next to it")
    s = settings
    turns, credits, episodes = [], [], []
    for e, trajectory in enumerate(batch.trajectories):
        credit = {id(t): c for t, c in turn_credits(trajectory, s.gamma)}
        for t in trajectory.turns:
            turns.append(t)
            credits.append(credit[id(t)])
            episodes.append(e)
    c = torch.tensor(credits, dtype=torch.float64)  # [N]
    groups = [batch.trajectories[e].group for e in episodes]
    pools = [(g, t.role) if s.normalize_by == "role" else (g,) for g, t in zip(groups, turns)]

    def grpo(v: Tensor, _: list[int]) -> Tensor:
        return normalise(v, s.scale_by_std)

    if s.estimator == "grpo":
        adv = _within(pools, c, grpo)
    elif s.estimator == "rloo":
        adv = _within(pools, c, lambda v, idx: leave_one_out(v, [episodes[i] for i in idx]))
    elif s.estimator == "gigpo":
        # episode level: one return per (episode, role), normalised over the pool's episodes
        returns: dict[tuple[int, str], float] = defaultdict(float)
        for t, e in zip(turns, episodes):
            returns[(e, t.role)] += t.reward
        items = list(returns)
        item_pools = [(batch.trajectories[e].group, role) if s.normalize_by == "role"
                      else (batch.trajectories[e].group,) for e, role in items]
        episode_adv = _within(item_pools, torch.tensor([returns[k] for k in items],
                                                       dtype=torch.float64), grpo)
        by_item = dict(zip(items, episode_adv.tolist()))
        a_episode = torch.tensor([by_item[(e, t.role)] for t, e in zip(turns, episodes)],
                                 dtype=torch.float64)  # [N]
        # step level: anchor-state groups within (group, role)
        anchors = [(g, t.role, t.state_key or tuple(t.prompt_ids)) for g, t in zip(groups, turns)]
        a_step = _within(anchors, c, grpo)  # [N]
        adv = a_episode + s.gigpo_weight * a_step
    else:
        adv = batch_gae(batch, values, s.gamma, s.gae_lambda)
        if s.gae_normalize:
            adv = _within(pools, adv, grpo)
    for t, a in zip(turns, adv.tolist()):
        t.advantage = a
    return batch
