"""The clipped turn-level objective against a direct float64 computation."""

import math

import pytest
import torch

from hieragent.objectives.losses import clipped_policy_loss, kl_k3, turn_log_ratio


def random_turns(seed: int, lengths: list[int]):
    """Random log-probs with garbage in the padding, so a mask bug cannot hide."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logprobs + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    pad = mask == 0
    logprobs = logprobs.masked_fill(pad, 123.0)
    old = old.masked_fill(pad, -77.0)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logprobs, old, mask, adv, lengths


LENGTHS = [5, 1, 3, 0, 7, 2]


def direct_turn_ratio(lp, old, n):
    if n == 0:
        return 1.0
    return math.exp(sum(lp[t] - old[t] for t in range(n)) / n)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turn_ratio_is_geometric_mean_of_token_ratios(seed):
    lp, old, mask, _, lengths = random_turns(seed, LENGTHS)
    got = torch.exp(turn_log_ratio(lp, old, mask))
    for i, n in enumerate(lengths):
        token_ratios = [math.exp(lp[i, t].item() - old[i, t].item()) for t in range(n)]
        geo = math.prod(token_ratios) ** (1 / n) if n else 1.0
        assert got[i].item() == pytest.approx(geo, rel=1e-12)
        assert got[i].item() == pytest.approx(direct_turn_ratio(lp[i].tolist(), old[i].tolist(), n), rel=1e-12)


def direct_loss(lp, old, adv, lengths, eps_low, eps_high, level):
    """Equation (2) token by token with Python floats."""
    out, clipped = {}, set()
    for i, n in enumerate(lengths):
        r_turn = direct_turn_ratio(lp[i], old[i], n)
        for t in range(n):
            r = r_turn if level == "turn" else math.exp(lp[i][t] - old[i][t])
            a = adv[i]
            unclipped, clip = r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a
            out[(i, t)] = -min(unclipped, clip)
            if clip < unclipped:
                clipped.add((i, t))
    return out, clipped


@pytest.mark.parametrize("level", ["turn", "token"])
@pytest.mark.parametrize("seed", [3, 4])
def test_clipped_loss_matches_direct_float64(level, seed):
    lp, old, mask, adv, lengths = random_turns(seed, LENGTHS)
    eps_low, eps_high = 0.1, 0.25
    terms = clipped_policy_loss(lp, old, adv, mask, eps_low, eps_high, level)
    want, want_clipped = direct_loss(lp.tolist(), old.tolist(), adv.tolist(), lengths, eps_low, eps_high, level)
    for i, n in enumerate(lengths):
        for t in range(lp.shape[1]):
            if t < n:
                assert terms.per_token[i, t].item() == pytest.approx(want[(i, t)], rel=1e-12, abs=1e-15)
                assert bool(terms.clipped[i, t]) == ((i, t) in want_clipped)
            else:
                assert terms.per_token[i, t].item() == 0.0
                assert not terms.clipped[i, t]
    # the random inputs must exercise both branches, or the test proves little
    assert 0 < len(want_clipped) < sum(lengths)


def test_turn_level_gradient_is_shared_by_the_turns_tokens():
    """Unclipped: d/d logp_{i,t} of the turn's summed loss is -r_i A_i for every token."""
    lp, old, mask, adv, lengths = random_turns(5, [4, 2, 6])
    lp = lp.clone().requires_grad_(True)
    terms = clipped_policy_loss(lp, old, adv, mask, eps_low=10.0, eps_high=10.0, level="turn")
    terms.per_token.sum().backward()
    for i, n in enumerate(lengths):
        r = direct_turn_ratio(lp[i].tolist(), old[i].tolist(), n)
        for t in range(n):
            assert lp.grad[i, t].item() == pytest.approx(-r * adv[i].item(), rel=1e-10)
        assert torch.all(lp.grad[i, n:] == 0)


def test_clipped_tokens_get_no_gradient():
    lp, old, mask, adv, lengths = random_turns(6, [3, 3, 3, 3])
    lp = lp.clone().requires_grad_(True)
    terms = clipped_policy_loss(lp, old, adv, mask, 0.01, 0.01, level="token")
    terms.per_token.sum().backward()
    assert terms.clipped.any()
    assert torch.all(lp.grad[terms.clipped] == 0)
    assert torch.all(lp.grad[~terms.clipped & (mask > 0)] != 0)


def test_k3_matches_direct_and_is_nonnegative():
    lp, _, mask, _, lengths = random_turns(7, LENGTHS)
    g = torch.Generator().manual_seed(8)
    ref = lp - torch.randn(lp.shape, generator=g, dtype=torch.float64)
    got = kl_k3(lp, ref, mask)
    for i, n in enumerate(lengths):
        for t in range(n):
            d = ref[i, t].item() - lp[i, t].item()
            assert got[i, t].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-12)
        assert torch.all(got[i, n:] == 0)
    assert torch.all(got >= 0)


def test_unknown_level_is_refused():
    lp, old, mask, adv, _ = random_turns(9, [2, 2])
    with pytest.raises(ValueError, match="importance-sampling level 'sentence'"):
        clipped_policy_loss(lp, old, adv, mask, level="sentence")
