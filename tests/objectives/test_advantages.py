"""Credit assignment and group normalisation against direct computations."""

import random
import statistics

import pytest
import torch

from hieragent.objectives.advantages import assign_advantages, discounted_to_go, turn_credits
from hieragent.objectives.update import ObjectiveSettings, chunk_loss, count_tokens
from hieragent.types import Batch, Retrieval, Trajectory, Turn


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


def test_micro_batches_give_the_same_loss_and_gradient_as_one_batch():
    """Token-mean over a role holds however the turns are split into micro-batches."""
    rng = random.Random(3)
    turns = [turn("planner", 0.0, 0, n_old=rng.randint(1, 4), rng=rng) for _ in range(7)]
    turns[2].retrieval = Retrieval(query=[0.0], keys=[[0.0]], entry_ids=[0], chosen=[0],
                                   old_logprob=-0.3, temperature=1.0)
    for t in turns:
        t.advantage = rng.uniform(-1, 1)
    g = torch.Generator().manual_seed(4)
    n_tok = [len(t.old_logprobs) + (t.retrieval is not None) for t in turns]
    params = [torch.randn(n, generator=g, dtype=torch.float64).requires_grad_(True) for n in n_tok]
    settings = ObjectiveSettings(kl_coef=0.1, eps_low=0.05, eps_high=0.05)
    denominator = count_tokens(turns)
    assert denominator == sum(n_tok)

    def logps():
        return [torch.tensor(t.old_logprobs + ([t.retrieval.old_logprob] if t.retrieval else []),
                             dtype=torch.float64) + 0.3 * p for t, p in zip(turns, params)]

    refs = [torch.tensor(t.old_logprobs, dtype=torch.float64) - 0.1 for t in turns]
    whole = chunk_loss(logps(), refs, turns, settings, denominator).loss
    grads_whole = torch.autograd.grad(whole, params)
    lp = logps()
    parts = [chunk_loss(lp[a:b], refs[a:b], turns[a:b], settings, denominator).loss
             for a, b in ((0, 3), (3, 4), (4, 7))]
    split = sum(parts)
    grads_split = torch.autograd.grad(split, params)
    assert split.item() == pytest.approx(whole.item(), rel=1e-12)
    for a, b in zip(grads_whole, grads_split):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
