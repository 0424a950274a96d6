"""The turn-level critic: features from the frozen encoder, lambda-return targets, training."""

import math
import random

import pytest
import torch

from hieragent.memory.encoder import load_encoder
from hieragent.objectives.advantages import AdvantageSettings, assign_advantages
from hieragent.objectives.value import TurnValueHead, turn_features, turn_values, value_loss, value_targets
from hieragent.types import Batch, Trajectory, Turn


@pytest.fixture(scope="module")
def encoder():
    return load_encoder("minilm")


def make_turn(role, reward, segment, state_key):
    return Turn(role=role, prompt_ids=[1], action_ids=[2], old_logprobs=[-0.5], text="x",
                reward=reward, segment=segment, state_key=state_key)


VIEWS = ["You see a red ball 2 steps forward.", "You see a wall 1 step left.",
         "You see a closed door 3 steps right.", "You see a blue key 1 step forward."]


def random_batch(seed):
    rng = random.Random(seed)
    trajs = []
    for group, n in enumerate([3, 2]):
        for _ in range(n):
            turns = []
            for s in range(rng.randint(1, 3)):
                turns.append(make_turn("planner", rng.uniform(-1, 1), s,
                                       f"Mission: go to the red ball\n{rng.choice(VIEWS)}"))
                turns += [make_turn("executor", rng.uniform(-1, 1), s,
                                    f"Subgoal: go to the red ball\n{rng.choice(VIEWS)}")
                          for _ in range(rng.randint(1, 4))]
            trajs.append(Trajectory(turns=turns, group=group))
    return Batch(trajs)


def direct_lambda_returns(rewards, values, gamma, lam):
    """G_k = r_k + gamma ((1 - lam) V_{k+1} + lam G_{k+1}), G_K = V_K = 0: the recursive form."""
    out, g_next, v_next = [0.0] * len(rewards), 0.0, 0.0
    for k in range(len(rewards) - 1, -1, -1):
        out[k] = rewards[k] + gamma * ((1 - lam) * v_next + lam * g_next)
        g_next, v_next = out[k], values[k]
    return out


def test_value_targets_are_lambda_returns_along_credit_chains():
    batch = random_batch(0)
    rng = random.Random(1)
    values = [rng.uniform(-1, 1) for _ in batch.turns()]
    v_of = {id(t): v for t, v in zip(batch.turns(), values)}
    gamma, lam = 0.9, 0.8
    got = value_targets(batch, torch.tensor(values, dtype=torch.float64), gamma, lam)
    want = {}
    for tr in batch.trajectories:
        chains = [[t for t in tr.turns if t.role == "planner"]]
        chains += [[t for t in tr.turns if t.role == "executor" and t.segment == s]
                   for s in sorted({t.segment for t in tr.turns})]
        for chain in chains:
            g = direct_lambda_returns([t.reward for t in chain], [v_of[id(t)] for t in chain], gamma, lam)
            want.update(zip(map(id, chain), g))
    assert got.dtype == torch.float64
    for t, g in zip(batch.turns(), got.tolist()):
        assert g == pytest.approx(want[id(t)], rel=1e-10, abs=1e-12)


def test_value_targets_at_lambda_one_are_the_turn_credits():
    from hieragent.objectives.advantages import turn_credits

    batch = random_batch(2)
    values = torch.randn(len(batch.turns()), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = value_targets(batch, values, 0.95, 1.0)
    credit = {id(t): c for tr in batch.trajectories for t, c in turn_credits(tr, 0.95)}
    torch.testing.assert_close(got, torch.tensor([credit[id(t)] for t in batch.turns()],
                                                 dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_head_gives_one_value_per_turn_from_its_roles_output():
    head = TurnValueHead(dim=8, hidden=4)
    features = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    got = head(features, ["planner", "executor", "planner"])
    both = head.out(torch.tanh(head.hidden(features)))  # [3, 2]
    assert got.shape == (3,)
    torch.testing.assert_close(got, torch.stack([both[0, 0], both[1, 1], both[2, 0]]))


def test_value_loss_is_mse_and_sends_no_gradient_into_targets():
    predicted = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    targets = torch.tensor([1.0, 0.0, 2.5], requires_grad=True)
    loss = value_loss(predicted, targets)
    assert loss.item() == pytest.approx((0.25 + 1.0 + 0.25) / 3)
    loss.backward()
    assert targets.grad is None
    torch.testing.assert_close(predicted.grad, 2 * (predicted - targets).detach() / 3)


def test_features_need_a_state_key(encoder):
    with pytest.raises(ValueError, match="1 of 2 turns have no state_key"):
        turn_features([make_turn("planner", 0.0, 0, "Mission: x\nv"), make_turn("planner", 0.0, 0, "")],
                      encoder)


def test_value_head_learns_a_tiny_regression_on_minilm_features(encoder):
    """A fixed target per (role, view): the head must fit it from the frozen embeddings."""
    target_of = {view: v for view, v in zip(VIEWS, [1.0, -0.5, 0.25, -1.0])}
    turns = [make_turn(role, 0.0, 0, f"{prefix}\n{view}")
             for role, prefix in [("planner", "Mission: go to the red ball"),
                                  ("executor", "Subgoal: open the door")] for view in VIEWS]
    targets = torch.tensor([target_of[t.state_key.split("\n")[1]] + (0.5 if t.role == "planner" else 0.0)
                            for t in turns])  # [8]
    features = turn_features(turns, encoder)  # [8, 384]
    assert features.shape == (8, 384) and features.dtype == torch.float32
    torch.testing.assert_close(features.norm(dim=1), torch.ones(8))
    torch.manual_seed(0)
    head = TurnValueHead(dim=384, hidden=32)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    roles = [t.role for t in turns]
    losses = []
    for _ in range(100):
        loss = value_loss(head(features, roles), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.01 * losses[0]


def test_one_gae_step_through_the_api_lowers_the_value_loss(encoder):
    batch = random_batch(5)
    turns = batch.turns()
    features = turn_features(turns, encoder)  # [N, D]
    same = [i for i, t in enumerate(turns) if t.state_key == turns[0].state_key]
    assert len(same) > 1 and all(torch.equal(features[i], features[0]) for i in same)
    torch.manual_seed(0)
    head = TurnValueHead(dim=384, hidden=32)
    roles = [t.role for t in turns]
    settings = AdvantageSettings("gae", gamma=0.9, gae_lambda=0.9)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        with torch.no_grad():
            values = head(features, roles)  # [N]; features are embedded once per batch
        assign_advantages(batch, settings=settings, values=values)
        targets = value_targets(batch, values, settings.gamma, settings.gae_lambda)
        loss = value_loss(head(features, roles), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    # the advantages are GAE with the head's values: at a chain's last turn, r - V
    values = turn_values(head, turns, encoder)  # [N]
    assert not values.requires_grad
    torch.testing.assert_close(values, head(features, roles).detach())
    assign_advantages(batch, settings=settings, values=values)
    index = {id(t): i for i, t in enumerate(turns)}
    for tr in batch.trajectories:
        t = tr.turns[-1]
        assert t.advantage == pytest.approx(t.reward - values[index[id(t)]].item(), rel=1e-6, abs=1e-6)
