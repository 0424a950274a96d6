"""Credit assignment and every advantage estimator against direct float64 computations."""

import math
import random
import statistics

import pytest
import torch

from hieragent.objectives.advantages import (
    AdvantageSettings,
    assign_advantages,
    batch_gae,
    discounted_to_go,
    gae_advantages,
    turn_credits,
)
from hieragent.types import Batch, Trajectory, Turn


def turn(role, reward, segment, n_old=1, rng=None):
    rng = rng or random.Random(0)
    return Turn(role=role, prompt_ids=[1], action_ids=[2], text="x", reward=reward, segment=segment,
                old_logprobs=[-rng.random() for _ in range(n_old)])


def test_discounted_to_go_matches_direct():
    rng = random.Random(1)
    rewards = [rng.uniform(-1, 1) for _ in range(7)]
    gamma = 0.9
    got = discounted_to_go(rewards, gamma)
    for t in range(7):
        assert got[t] == pytest.approx(sum(gamma ** (k - t) * rewards[k] for k in range(t, 7)))


def test_planner_gets_return_to_go_and_executor_its_segment_to_go():
    traj = Trajectory(turns=[
        turn("planner", 0.0, 0), turn("executor", 0.5, 0), turn("executor", 0.0, 0),
        turn("planner", 0.8, 1), turn("executor", 0.2, 1), turn("executor", 1.3, 1),
    ])
    credits = {id(t): c for t, c in turn_credits(traj, gamma=1.0)}
    p0, e0, e1, p1, e2, e3 = traj.turns
    assert credits[id(p0)] == pytest.approx(0.8)   # its segment (0) plus what followed (0.8)
    assert credits[id(p1)] == pytest.approx(0.8)
    assert credits[id(e0)] == pytest.approx(0.5)   # segment 0 only: 0.5 + 0.0
    assert credits[id(e1)] == pytest.approx(0.0)
    assert credits[id(e2)] == pytest.approx(1.5)
    assert credits[id(e3)] == pytest.approx(1.3)


def test_group_normalisation_per_group_and_role_matches_direct():
    rng = random.Random(2)
    trajs = []
    for group in range(3):
        for _ in range(4):
            turns = [turn("planner", rng.random(), 0)] + [turn("executor", rng.random(), 0) for _ in range(rng.randint(1, 4))]
            trajs.append(Trajectory(turns=turns, group=group))
    batch = assign_advantages(Batch(trajs), gamma=1.0, scale_by_std=True)
    for group in range(3):
        for role in ("planner", "executor"):
            pairs = [(t, c) for tr in trajs if tr.group == group for t, c in turn_credits(tr) if t.role == role]
            credits = [c for _, c in pairs]
            mu, sd = statistics.fmean(credits), statistics.pstdev(credits)
            for t, c in pairs:
                assert t.advantage == pytest.approx((c - mu) / (sd + 1e-6), rel=1e-9)


def test_equal_credits_give_zero_advantage_not_nan():
    trajs = [Trajectory(turns=[turn("executor", 1.0, 0)], group=0) for _ in range(4)]
    assign_advantages(Batch(trajs))
    assert all(t.advantage == 0.0 for tr in trajs for t in tr.turns)


# -- the estimator family, against plain Python ------------------------------------------

def make_turn(role, reward, segment, state_key="", prompt=(1,)):
    return Turn(role=role, prompt_ids=list(prompt), action_ids=[2], old_logprobs=[-0.5], text="x",
                reward=reward, segment=segment, state_key=state_key)


def random_trajectory(rng, group, flat=False, states=None):
    """Segments of one planner turn and 1-4 executor turns; ``states`` draws repeating keys."""
    turns = []
    for s in range(1 if flat else rng.randint(1, 3)):
        if not flat:
            key = f"Mission: m\n{rng.choice(states)}" if states else ""
            turns.append(make_turn("planner", rng.uniform(-1, 1), s, key, prompt=(1, rng.randint(0, 9))))
        for _ in range(rng.randint(1, 4)):
            key = f"Subgoal: g\n{rng.choice(states)}" if states else ""
            turns.append(make_turn("executor", rng.uniform(-1, 1), s, key, prompt=(2, rng.randint(0, 9))))
    return Trajectory(turns=turns, group=group)


ZERO_VAR, SINGLE = 10, 11


def random_batch(seed, states=None, sizes=(4, 2, 3, 5)):
    """Groups of unequal sizes, episodes of unequal lengths, one flat (executor-only) episode,
    a zero-variance group and a singleton group."""
    rng = random.Random(seed)
    trajs = [random_trajectory(rng, g, flat=(g == 2 and i == 0), states=states)
             for g, n in enumerate(sizes) for i in range(n)]
    # 0.1 is not a binary fraction: a mean of equal credits need not round back to 0.1
    trajs += [Trajectory(turns=[make_turn("planner", 0.1, 0, "Mission: z\nv"),
                                make_turn("executor", 0.1, 0, "Subgoal: z\nv")], group=ZERO_VAR)
              for _ in range(3)]
    trajs.append(Trajectory(turns=[make_turn("planner", rng.uniform(0.2, 1), 0),
                                   make_turn("executor", rng.uniform(0.2, 1), 0)], group=SINGLE))
    return Batch(trajs)


def direct_credits(traj, gamma):
    """Planner: return-to-go over the episode's planner turns; executor: within its segment."""
    out = {}
    chains = [[t for t in traj.turns if t.role == "planner"]]
    for seg in sorted({t.segment for t in traj.turns}):
        chains.append([t for t in traj.turns if t.role == "executor" and t.segment == seg])
    for chain in chains:
        for i, t in enumerate(chain):
            out[id(t)] = math.fsum(gamma ** (k - i) * chain[k].reward for k in range(i, len(chain)))
    return out


def direct_grpo(xs, scale):
    if max(xs) == min(xs):
        return [0.0] * len(xs)
    mu = math.fsum(xs) / len(xs)
    sd = math.sqrt(math.fsum((x - mu) ** 2 for x in xs) / len(xs))
    return [(x - mu) / (sd + 1e-6) if scale else x - mu for x in xs]


def rows(batch, gamma, by):
    """(turn, credit, episode, pool) for every turn."""
    out = []
    for e, tr in enumerate(batch.trajectories):
        credit = direct_credits(tr, gamma)
        for t in tr.turns:
            out.append((t, credit[id(t)], e, (tr.group, t.role) if by == "role" else (tr.group,)))
    return out


def pools_of(items, key):
    pools = {}
    for item in items:
        pools.setdefault(key(item), []).append(item)
    return pools


def check(batch, expected):
    """``expected``: id(turn) -> advantage, for every turn of the batch."""
    assert len(expected) == len(batch.turns())
    for t in batch.turns():
        want = expected[id(t)]
        assert not math.isnan(t.advantage)
        assert t.advantage == pytest.approx(want, rel=1e-9, abs=1e-12)


def assert_zero_and_singleton_groups_are_zero(batch, singleton=True):
    """``singleton=False``: joint pools, where the singleton group's two turns share a pool."""
    for tr in batch.trajectories:
        if tr.group == ZERO_VAR or (singleton and tr.group == SINGLE):
            assert all(t.advantage == 0.0 for t in tr.turns)


@pytest.mark.parametrize("by", ["role", "joint"])
@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_normalises_credits_per_pool(seed, scale, by):
    batch = random_batch(seed)
    gamma = 0.9
    assign_advantages(batch, settings=AdvantageSettings("grpo", gamma, scale, by))
    expected = {}
    for pool in pools_of(rows(batch, gamma, by), lambda r: r[3]).values():
        expected.update(zip([id(r[0]) for r in pool], direct_grpo([r[1] for r in pool], scale)))
    check(batch, expected)
    assert_zero_and_singleton_groups_are_zero(batch, singleton=by == "role")


def test_default_call_is_grpo_per_group_and_role():
    a, b = random_batch(3), random_batch(3)
    assign_advantages(a, 0.8, False)
    assign_advantages(b, settings=AdvantageSettings(gamma=0.8, scale_by_std=False))
    assert [t.advantage for t in a.turns()] == [t.advantage for t in b.turns()]
    assert AdvantageSettings() == AdvantageSettings("grpo", 1.0, True, "role")


def test_role_and_joint_pools_differ():
    role, joint = random_batch(4), random_batch(4)
    assign_advantages(role, settings=AdvantageSettings(normalize_by="role"))
    assign_advantages(joint, settings=AdvantageSettings(normalize_by="joint"))
    assert any(abs(a.advantage - b.advantage) > 1e-3 for a, b in zip(role.turns(), joint.turns()))


@pytest.mark.parametrize("by", ["role", "joint"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_leaves_out_the_turns_own_episode(seed, by):
    batch = random_batch(seed)
    gamma = 0.95
    assign_advantages(batch, settings=AdvantageSettings("rloo", gamma, normalize_by=by))
    expected = {}
    for pool in pools_of(rows(batch, gamma, by), lambda r: r[3]).values():
        equal = max(r[1] for r in pool) == min(r[1] for r in pool)
        for t, c, e, _ in pool:
            others = [c2 for _, c2, e2, _ in pool if e2 != e]
            expected[id(t)] = 0.0 if equal or not others else c - math.fsum(others) / len(others)
    check(batch, expected)
    assert_zero_and_singleton_groups_are_zero(batch)


def test_rloo_with_one_turn_per_episode_is_the_papers_leave_one_out():
    rng = random.Random(5)
    rewards = [rng.uniform(-1, 1) for _ in range(5)]
    batch = Batch([Trajectory(turns=[make_turn("executor", r, 0)]) for r in rewards])
    assign_advantages(batch, settings=AdvantageSettings("rloo"))
    n = len(rewards)
    for t, r in zip(batch.turns(), rewards):
        assert t.advantage == pytest.approx(r - (sum(rewards) - r) / (n - 1), rel=1e-12)
        assert t.advantage == pytest.approx(n / (n - 1) * (r - sum(rewards) / n), rel=1e-9)


def direct_gigpo(batch, gamma, scale, by, omega):
    items = rows(batch, gamma, by)
    episode = {}  # (episode, role) -> A^E
    returns = {}
    for t, _, e, pool in items:
        returns.setdefault((e, t.role, pool), []).append(t.reward)
    by_pool = pools_of(list(returns), lambda k: k[2])
    for keys in by_pool.values():
        for k, a in zip(keys, direct_grpo([math.fsum(returns[k]) for k in keys], scale)):
            episode[k[:2]] = a
    step = {}
    anchors = pools_of(items, lambda r: (batch.trajectories[r[2]].group, r[0].role,
                                         r[0].state_key or tuple(r[0].prompt_ids)))
    for pool in anchors.values():
        step.update(zip([id(r[0]) for r in pool], direct_grpo([r[1] for r in pool], scale)))
    return {id(t): episode[(e, t.role)] + omega * step[id(t)] for t, _, e, _ in items}, step


STATES = ["a red ball ahead", "a wall left", "a door right"]


@pytest.mark.parametrize("by", ["role", "joint"])
@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_gigpo_adds_omega_times_anchor_state_advantage_to_episode_advantage(seed, scale, by):
    batch = random_batch(seed, states=STATES)
    gamma, omega = 0.9, 0.7
    assign_advantages(batch, settings=AdvantageSettings("gigpo", gamma, scale, by, gigpo_weight=omega))
    expected, step = direct_gigpo(batch, gamma, scale, by, omega)
    check(batch, expected)
    assert_zero_and_singleton_groups_are_zero(batch, singleton=by == "role")
    assert sum(abs(a) > 1e-6 for a in step.values()) > 10  # states did repeat


def test_gigpo_step_term_is_the_difference_of_two_omegas():
    lo, hi = random_batch(6, states=STATES), random_batch(6, states=STATES)
    assign_advantages(lo, settings=AdvantageSettings("gigpo", gigpo_weight=0.0))
    assign_advantages(hi, settings=AdvantageSettings("gigpo", gigpo_weight=2.0))
    _, step = direct_gigpo(hi, 1.0, True, "role", 0.0)
    for a, b in zip(lo.turns(), hi.turns()):
        assert b.advantage - a.advantage == pytest.approx(2.0 * step[id(b)], rel=1e-9, abs=1e-12)


def test_gigpo_anchor_groups_span_episodes_but_not_groups_or_roles():
    def traj(group, keys_rewards):
        return Trajectory(group=group, turns=[make_turn(role, r, 0, key) for role, key, r in keys_rewards])

    e0 = traj(0, [("planner", "s", 1.0), ("executor", "s", 0.5), ("executor", "u", 0.0)])
    e1 = traj(0, [("planner", "s", 0.0), ("executor", "t", 0.3), ("executor", "u", 0.2)])
    e2 = traj(1, [("planner", "s", 0.4), ("executor", "s", 0.1), ("executor", "u", 0.7)])
    batch = Batch([e0, e1, e2])
    assign_advantages(batch, settings=AdvantageSettings("gigpo", scale_by_std=False, gigpo_weight=1.0))
    # group 0, planner: returns 1.0 vs 0.0 -> A^E = +-0.5; anchor "s" holds both -> A^S = +-0.5
    assert e0.turns[0].advantage == pytest.approx(1.0)
    assert e1.turns[0].advantage == pytest.approx(-1.0)
    # executor returns 0.5 vs 0.5: A^E = 0. "s" (executor) is a singleton: the planner's "s" and
    # group 1's "s" are other anchors. "u": credits 0.0 and 0.2 -> -+0.1
    assert e0.turns[1].advantage == 0.0
    assert e1.turns[1].advantage == 0.0  # "t": singleton
    assert e0.turns[2].advantage == pytest.approx(-0.1)
    assert e1.turns[2].advantage == pytest.approx(0.1)
    assert all(t.advantage == 0.0 for t in e2.turns)  # a group of one


def test_gigpo_falls_back_to_prompt_ids_without_state_key():
    e0 = Trajectory(turns=[make_turn("executor", 1.0, 0, prompt=(5, 6))])
    e1 = Trajectory(turns=[make_turn("executor", 0.0, 0, prompt=(5, 6))])
    e2 = Trajectory(turns=[make_turn("executor", 0.5, 0, prompt=(7,))])
    batch = Batch([e0, e1, e2])
    assign_advantages(batch, settings=AdvantageSettings("gigpo", scale_by_std=False, gigpo_weight=1.0))
    assert e0.turns[0].advantage == pytest.approx(0.5 + 0.5)
    assert e1.turns[0].advantage == pytest.approx(-0.5 - 0.5)
    assert e2.turns[0].advantage == pytest.approx(0.0)


def direct_gae(rewards, values, gamma, lam):
    """A_k = sum_l (gamma lam)^l delta_{k+l}, written out as the sum, not the recursion."""
    K = len(rewards)
    v = list(values) + [0.0]
    delta = [rewards[k] + gamma * v[k + 1] - v[k] for k in range(K)]
    return [math.fsum((gamma * lam) ** (j - k) * delta[j] for j in range(k, K)) for k in range(K)]


@pytest.mark.parametrize("lam", [0.0, 0.6, 1.0])
def test_gae_matches_the_sum_of_discounted_td_errors(lam):
    g = torch.Generator().manual_seed(7)
    r = torch.randn(9, generator=g, dtype=torch.float64)
    v = torch.randn(9, generator=g, dtype=torch.float64)
    got = gae_advantages(r, v, 0.9, lam)
    for k, want in enumerate(direct_gae(r.tolist(), v.tolist(), 0.9, lam)):
        assert got[k].item() == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_gae_lambda_one_is_return_minus_value_and_lambda_zero_is_td_error():
    g = torch.Generator().manual_seed(8)
    r = torch.rand(6, generator=g, dtype=torch.float64) - 0.3
    v = torch.rand(6, generator=g, dtype=torch.float64)
    gamma = 0.8
    ret = torch.tensor(discounted_to_go(r.tolist(), gamma), dtype=torch.float64)
    torch.testing.assert_close(gae_advantages(r, v, gamma, 1.0), ret - v, rtol=1e-12, atol=1e-12)
    v_next = torch.cat([v[1:], v.new_zeros(1)])
    torch.testing.assert_close(gae_advantages(r, v, gamma, 0.0), r + gamma * v_next - v,
                               rtol=1e-12, atol=1e-12)
    bootstrapped = gae_advantages(r, v, gamma, 0.0, next_value=2.0)
    assert bootstrapped[-1].item() == pytest.approx(r[-1].item() + gamma * 2.0 - v[-1].item())


@pytest.mark.parametrize("normalize", [False, True])
def test_gae_runs_along_planner_and_per_segment_executor_chains(normalize):
    batch = random_batch(9)
    rng = random.Random(10)
    values = [rng.uniform(-1, 1) for _ in batch.turns()]
    v_of = {id(t): v for t, v in zip(batch.turns(), values)}
    for tr in batch.trajectories:  # equal values in the zero-variance group
        if tr.group == ZERO_VAR:
            for t in tr.turns:
                v_of[id(t)] = 0.05
    values = [v_of[id(t)] for t in batch.turns()]
    gamma, lam = 0.9, 0.7
    settings = AdvantageSettings("gae", gamma, gae_lambda=lam, gae_normalize=normalize)
    assign_advantages(batch, settings=settings, values=values)
    raw = {}
    for tr in batch.trajectories:
        chains = [[t for t in tr.turns if t.role == "planner"]]
        chains += [[t for t in tr.turns if t.role == "executor" and t.segment == s]
                   for s in sorted({t.segment for t in tr.turns})]
        for chain in chains:
            adv = direct_gae([t.reward for t in chain], [v_of[id(t)] for t in chain], gamma, lam)
            raw.update(zip(map(id, chain), adv))
    expected = dict(raw)
    if normalize:
        for pool in pools_of(rows(batch, gamma, "role"), lambda r: r[3]).values():
            expected.update(zip([id(r[0]) for r in pool], direct_grpo([raw[id(r[0])] for r in pool], True)))
        assert_zero_and_singleton_groups_are_zero(batch)
    check(batch, expected)
    torch.testing.assert_close(batch_gae(batch, values, gamma, lam),
                               torch.tensor([raw[id(t)] for t in batch.turns()], dtype=torch.float64))


def test_gae_without_values_says_what_to_pass():
    with pytest.raises(ValueError, match="needs values"):
        assign_advantages(random_batch(0), settings=AdvantageSettings("gae"))
    with pytest.raises(ValueError, match="one per turn"):
        assign_advantages(random_batch(0), settings=AdvantageSettings("gae"), values=[0.0])


def test_settings_reject_unknown_names_and_doubled_arguments():
    with pytest.raises(ValueError, match="known: grpo, rloo, gigpo, gae"):
        AdvantageSettings("ppo")
    with pytest.raises(ValueError, match="known: role, joint"):
        AdvantageSettings(normalize_by="agent")
    with pytest.raises(ValueError, match="inside settings"):
        assign_advantages(random_batch(0), gamma=0.5, settings=AdvantageSettings())
