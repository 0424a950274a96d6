"""The clipped objective, its levels, aggregation and KL against direct float64 computations.

The direct computations use Python floats and ``math`` only, token by token.
"""

import math

import pytest
import torch

from hieragent.objectives.losses import (
    aggregate,
    aggregation_weights,
    clip_bias_sums,
    clip_normalization_scale,
    MAX_LOG_RATIO,
    clipped_policy_loss,
    effective_sample_size,
    kl_k3,
    kl_penalty,
    log_ratio,
    logprob_gap,
    truncated_is_weights,
    turn_log_ratio,
)


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


# --- inputs with non-finite padding, and the direct (Python float) computations ---------

GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e30, -3e4]
LENGTHS_SEQ = [5, 1, 3, 0, 7, 2, 4, 1]
SEQ_IDS = [10, 10, 4, 7, 7, 7, 4, 99]  # sequence 7 holds an empty row; 99 a one-token row


def with_garbage(x, mask, seed):
    """``x`` with its padding replaced by nan, inf, -inf and huge values."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(GARBAGE), x.shape, generator=g)
    junk = torch.tensor(GARBAGE, dtype=x.dtype)[pick]
    return torch.where(mask > 0, x, junk)


def random_batch(seed, lengths, spread=0.6, dtype=torch.float64):
    """Log-probs, behaviour log-probs, mask and [B] advantages; padding is garbage."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = torch.zeros(B, T, dtype=dtype)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    lp = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.01
    old = lp + torch.randn(B, T, generator=g, dtype=dtype) * spread
    adv = torch.randn(B, generator=g, dtype=dtype)
    return with_garbage(lp, mask, seed + 1), with_garbage(old, mask, seed + 2), mask, adv


def direct_log_ratios(lp, old, lengths, level, seq_ids=None):
    """{(i, t): rho} of equations (1)-(3) for real tokens."""
    seq_ids = list(range(len(lengths))) if seq_ids is None else seq_ids
    out = {}
    for i, n in enumerate(lengths):
        if level == "token":
            rows = [i]
        elif level == "turn":
            rows = [i]
        else:
            rows = [j for j in range(len(lengths)) if seq_ids[j] == seq_ids[i]]
        deltas = [lp[j][t] - old[j][t] for j in rows for t in range(lengths[j])]
        for t in range(n):
            out[(i, t)] = lp[i][t] - old[i][t] if level == "token" else sum(deltas) / len(deltas)
    return out


def direct_terms(lp, old, adv, lengths, eps_low, eps_high, level, seq_ids=None, dual=None, w=None):
    """{(i, t): (loss, clipped, bias)} with the piecewise definitions of (4), (5), (8)."""
    rho = direct_log_ratios(lp, old, lengths, level, seq_ids)
    out = {}
    for (i, t), lr in rho.items():
        r, a = math.exp(lr), adv[i]
        lo, hi = 1 - eps_low, 1 + eps_high
        clipped_r = min(max(r, lo), hi)
        loss, clipped, bias = -min(r * a, clipped_r * a), False, 0.0
        if clipped_r * a < r * a:
            clipped, bias = True, abs(a) * abs(r - clipped_r)  # distance to the violated bound
        if dual is not None and a < 0 and -dual * a < loss:
            loss, clipped, bias = -dual * a, True, abs(a) * (r - dual)
        if w is not None:
            loss *= w[i][t]
        out[(i, t)] = (loss, clipped, bias)
    return out


def assert_zero_padding(x, lengths):
    for i, n in enumerate(lengths):
        assert torch.all(x[i, n:] == 0)


# --- importance-sampling levels ------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
@pytest.mark.parametrize("seed", [11, 12])
def test_log_ratio_matches_direct_at_every_level(level, seed):
    lp, old, mask, _ = random_batch(seed, LENGTHS_SEQ)
    ids = torch.tensor(SEQ_IDS)
    got = log_ratio(lp, old, mask, level, ids)
    want = direct_log_ratios(lp.tolist(), old.tolist(), LENGTHS_SEQ, level, SEQ_IDS)
    for (i, t), value in want.items():
        assert got[i, t].item() == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert_zero_padding(got, LENGTHS_SEQ)


def test_sequence_level_shares_one_ratio_over_all_turns_of_a_sequence():
    lp, old, mask, _ = random_batch(13, LENGTHS_SEQ)
    got = log_ratio(lp, old, mask, "sequence", torch.tensor(SEQ_IDS))
    # rows 0 and 1 are one sequence: 6 tokens, the one-token row counts 1/6, not 1/2
    deltas = [lp[0, t].item() - old[0, t].item() for t in range(5)] + [lp[1, 0].item() - old[1, 0].item()]
    assert got[0, 0].item() == pytest.approx(sum(deltas) / 6, rel=1e-12)
    assert got[1, 0].item() == got[0, 4].item()
    turn = log_ratio(lp, old, mask, "turn")
    assert got[1, 0].item() != pytest.approx(turn[1, 0].item())


@pytest.mark.parametrize("ids", [None, [5, 0, 9, 2, 7, 1, 3, 8]])
def test_sequence_level_with_one_turn_per_sequence_is_turn_level_bitwise(ids):
    lp, old, mask, adv = random_batch(14, LENGTHS_SEQ)
    ids = None if ids is None else torch.tensor(ids)
    assert torch.equal(log_ratio(lp, old, mask, "sequence", ids), log_ratio(lp, old, mask, "turn"))
    grads = []
    for level in ("sequence", "turn"):
        x = lp.clone().requires_grad_(True)
        terms = clipped_policy_loss(x, old, adv, mask, 0.1, 0.3, level, ids, dual_clip=2.0)
        terms.per_token.sum().backward()
        grads.append((terms.per_token, terms.clipped, terms.bias, x.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_turn_log_ratio_is_the_row_value_of_the_turn_level():
    lp, old, mask, _ = random_batch(15, LENGTHS_SEQ)
    per_row = turn_log_ratio(lp, old, mask)
    per_token = log_ratio(lp, old, mask, "turn")
    for i, n in enumerate(LENGTHS_SEQ):
        assert torch.all(per_token[i, :n] == per_row[i])
        if n == 0:
            assert per_row[i] == 0


# --- the clipped objective -----------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
@pytest.mark.parametrize("dual", [None, 1.6])
@pytest.mark.parametrize("weighted", [False, True])
def test_clipped_loss_with_dual_clip_and_is_weights_matches_direct(level, dual, weighted):
    lp, old, mask, adv = random_batch(16, LENGTHS_SEQ, spread=0.9)
    g = torch.Generator().manual_seed(17)
    w = with_garbage(torch.rand(lp.shape, generator=g, dtype=lp.dtype) * 2, mask, 18) if weighted else None
    ids = torch.tensor(SEQ_IDS)
    terms = clipped_policy_loss(lp, old, adv, mask, 0.15, 0.3, level, ids, dual, w)
    want = direct_terms(lp.tolist(), old.tolist(), adv.tolist(), LENGTHS_SEQ, 0.15, 0.3, level, SEQ_IDS,
                        dual, None if w is None else w.tolist())
    for (i, t), (loss, clipped, bias) in want.items():
        assert terms.per_token[i, t].item() == pytest.approx(loss, rel=1e-12, abs=1e-15)
        assert bool(terms.clipped[i, t]) == clipped
        assert terms.bias[i, t].item() == pytest.approx(bias, rel=1e-12, abs=1e-15)
    for x in (terms.per_token, terms.bias, terms.clipped):
        assert_zero_padding(x, LENGTHS_SEQ)
    assert torch.all(terms.ratio[mask == 0] == 1)
    n_clipped = sum(c for _, c, _ in want.values())
    assert 0 < n_clipped < len(want)


def test_dual_clip_is_active_on_the_token_level_inputs_above():
    """The parametrised test above must see the dual bound at work, or it proves little."""
    lp, old, mask, adv = random_batch(16, LENGTHS_SEQ, spread=0.9)
    ppo = direct_terms(lp.tolist(), old.tolist(), adv.tolist(), LENGTHS_SEQ, 0.15, 0.3, "token")
    dual = direct_terms(lp.tolist(), old.tolist(), adv.tolist(), LENGTHS_SEQ, 0.15, 0.3, "token", dual=1.6)
    assert sum(ppo[k][0] != dual[k][0] for k in ppo) >= 2


def test_dual_clip_bounds_the_loss_of_negative_advantages_and_cuts_their_gradient():
    # r = e, e^-1, e, 1.1 ; A = -1, -1, +1, -1 ; c = 2
    lp = torch.tensor([[1.0, -1.0, 1.0, math.log(1.1)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    terms = clipped_policy_loss(lp, old, adv, torch.ones(1, 4), 0.2, 0.2, "token", dual_clip=2.0)
    terms.per_token.sum().backward()
    assert terms.per_token[0].tolist() == pytest.approx([2.0, 0.8, -1.2, 1.1])
    assert terms.clipped[0].tolist() == [True, True, True, False]
    assert terms.bias[0].tolist() == pytest.approx([math.e - 2, 0.8 - math.exp(-1), math.e - 1.2, 0.0])
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 1.1])
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clipped_policy_loss(lp, old, adv, torch.ones(1, 4), dual_clip=1.0)


def test_is_weights_scale_loss_and_gradient_but_get_none():
    lp, old, mask, adv = random_batch(19, [4, 2, 5])
    g = torch.Generator().manual_seed(20)
    w = (torch.rand(lp.shape, generator=g, dtype=lp.dtype) + 0.5).requires_grad_(True)
    x, y = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    plain = clipped_policy_loss(x, old, adv, mask, level="token")
    weighted = clipped_policy_loss(y, old, adv, mask, level="token", is_weights=w)
    plain.per_token.sum().backward()
    weighted.per_token.sum().backward()
    real = mask > 0
    assert torch.allclose(weighted.per_token[real], (plain.per_token * w)[real], rtol=1e-13)
    assert torch.allclose(y.grad[real], (x.grad * w)[real], rtol=1e-13)
    assert w.grad is None
    assert torch.equal(weighted.bias, plain.bias)  # the clip's bias is taken before the TIS weight


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
def test_non_finite_padding_reaches_neither_loss_nor_gradient(level):
    lp, old, mask, _ = random_batch(21, LENGTHS_SEQ)
    g = torch.Generator().manual_seed(22)
    adv = with_garbage(torch.randn(lp.shape, generator=g, dtype=lp.dtype), mask, 23)  # [B, T]
    w = with_garbage(torch.rand(lp.shape, generator=g, dtype=lp.dtype), mask, 24)
    ref = with_garbage(lp.detach() - 0.3, mask, 25)
    x = lp.clone().requires_grad_(True)
    terms = clipped_policy_loss(x, old, adv, mask, level=level, sequence_ids=torch.tensor(SEQ_IDS),
                                dual_clip=3.0, is_weights=w)
    kl = kl_penalty(x, ref, mask)
    weights = aggregation_weights(mask.sum(-1), torch.tensor(SEQ_IDS), "seq-mean-token-mean")
    loss = aggregate(terms.per_token + kl, weights)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(torch.isfinite(x.grad))
    assert torch.all(x.grad[mask == 0] == 0)
    assert torch.all(torch.isfinite(terms.ratio)) and torch.all(torch.isfinite(terms.bias))


@pytest.mark.parametrize("level", ["turn", "sequence"])
def test_gradient_matches_float64_finite_differences(level):
    lp, old, mask, adv = random_batch(26, [4, 1, 3, 0, 2], spread=0.5)
    ids = torch.tensor([0, 0, 1, 2, 2])
    weights = aggregation_weights(mask.sum(-1), ids, "seq-mean-token-mean")

    def loss_of(x):
        terms = clipped_policy_loss(x, old, adv, mask, 0.1, 0.2, level, ids, dual_clip=1.5)
        return aggregate(terms.per_token, weights), terms

    x = lp.clone().requires_grad_(True)
    loss, terms = loss_of(x)
    loss.backward()
    assert terms.clipped.any() and (~terms.clipped & (mask > 0)).any()
    h = 1e-6
    for i, t in (mask > 0).nonzero().tolist():
        up, down = lp.clone(), lp.clone()
        up[i, t] += h
        down[i, t] -= h
        fd = (loss_of(up)[0].item() - loss_of(down)[0].item()) / (2 * h)
        assert x.grad[i, t].item() == pytest.approx(fd, rel=1e-6, abs=1e-9)
    assert torch.all(x.grad[mask == 0] == 0)


def test_turn_gradient_is_analytic_on_a_small_example():
    """Unclipped row of n tokens, token-mean over N: L_i = -n r_i A_i / N and d r_i / d logp_t
    = r_i / n, so every token of the row gets d L / d logp_{i,t} = -r_i A_i / N."""
    lp = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.6, -0.8, -2.3], [-0.2, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    adv = torch.tensor([0.7, -1.3], dtype=torch.float64)
    terms = clipped_policy_loss(lp, old, adv, mask, 0.2, 0.2, "turn")
    aggregate(terms.per_token, aggregation_weights(mask.sum(-1), None, "token-mean")).backward()
    r0, r1 = math.exp((0.1 - 0.2 + 0.3) / 3), math.exp(-0.1)
    assert lp.grad[0].tolist() == pytest.approx([-r0 * 0.7 / 4] * 3, rel=1e-12)
    assert lp.grad[1].tolist() == pytest.approx([r1 * 1.3 / 4, 0.0, 0.0], rel=1e-12)


# --- truncated IS and the trainer / engine gap --------------------------------------------


def test_truncated_is_weights_and_logprob_gap_match_direct():
    trainer, engine, mask, _ = random_batch(27, LENGTHS_SEQ, spread=0.5)
    trainer = trainer.requires_grad_(True)
    w = truncated_is_weights(trainer, engine, mask, cap=1.5)
    assert not w.requires_grad
    gaps = []
    for i, n in enumerate(LENGTHS_SEQ):
        for t in range(n):
            d = trainer[i, t].item() - engine[i, t].item()
            assert w[i, t].item() == pytest.approx(min(math.exp(d), 1.5), rel=1e-12)
            gaps.append(abs(d))
        assert torch.all(w[i, n:] == 1)
    assert (w == 1.5).any() and (w < 1).any()
    assert logprob_gap(trainer, engine, mask) == pytest.approx(sum(gaps) / len(gaps), rel=1e-12)
    assert logprob_gap(trainer, engine, torch.zeros_like(mask)) == 0.0
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(trainer, engine, mask, cap=0.0)


# --- clipping-triggered normalization ------------------------------------------------------


def test_clip_bias_sums_match_direct():
    lp, old, mask, adv = random_batch(28, LENGTHS_SEQ, spread=0.9)
    terms = clipped_policy_loss(lp, old, adv, mask, 0.1, 0.2, "token", dual_clip=2.0)
    want = direct_terms(lp.tolist(), old.tolist(), adv.tolist(), LENGTHS_SEQ, 0.1, 0.2, "token", dual=2.0)
    bias_sum, adv_sum = clip_bias_sums(terms, adv, mask)
    assert bias_sum == pytest.approx(sum(b for _, _, b in want.values()), rel=1e-12)
    assert adv_sum == pytest.approx(sum(abs(adv[i].item()) * n for i, n in enumerate(LENGTHS_SEQ)), rel=1e-12)
    assert bias_sum > 0
    assert clip_normalization_scale(bias_sum, adv_sum, 0.5) == pytest.approx(1 / (1 + 0.5 * bias_sum / adv_sum))


def test_normalization_scale_is_exactly_one_without_clipping():
    lp, old, mask, adv = random_batch(29, LENGTHS_SEQ)
    terms = clipped_policy_loss(lp, old, adv, mask, 100.0, 100.0, "token")
    assert not terms.clipped.any()
    assert clip_normalization_scale(*clip_bias_sums(terms, adv, mask)) == 1.0
    assert clip_normalization_scale(0.0, 3.0) == 1.0
    assert clip_normalization_scale(2.0, 0.0) == 1.0
    assert clip_normalization_scale(2.0, 3.0, strength=0.0) == 1.0


def test_normalization_scale_falls_as_more_turns_are_clipped():
    """Same advantages and ratios; rows move one by one from on- to far off-policy."""
    g = torch.Generator().manual_seed(30)
    B, T = 6, 4
    adv = torch.rand(B, generator=g, dtype=torch.float64) + 0.1  # > 0: high ratios are clipped
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T)
    scales = []
    for k in range(B + 1):
        shift = torch.zeros(B, 1, dtype=torch.float64)
        shift[:k] = 1.0  # ratio e on the first k rows, 1 on the others
        terms = clipped_policy_loss(lp, lp - shift, adv, mask, 0.2, 0.28, "turn")
        assert int(terms.clipped.sum()) == k * T
        scales.append(clip_normalization_scale(*clip_bias_sums(terms, adv, mask), strength=2.0))
    assert scales[0] == 1.0
    assert all(a > b for a, b in zip(scales, scales[1:]))
    assert all(0 < s <= 1 for s in scales)


@pytest.mark.parametrize("dtype,log_r", [(torch.float32, 700.0), (torch.float64, 700.0),
                                         (torch.float64, math.log(1e30)), (torch.float32, -700.0)])
def test_normalization_scale_stays_finite_on_extreme_ratios(dtype, log_r):
    lp = torch.full((2, 3), -1.0, dtype=dtype)
    old = lp - log_r
    adv = torch.tensor([1.0, -2.0], dtype=dtype)
    mask = torch.ones(2, 3)
    mask[1, 2] = 0
    terms = clipped_policy_loss(lp, old, adv, mask, level="token", dual_clip=3.0)
    bias_sum, adv_sum = clip_bias_sums(terms, adv, mask)
    scale = clip_normalization_scale(bias_sum, adv_sum)
    assert math.isfinite(scale) and 0 <= scale <= 1
    assert adv_sum == pytest.approx(7.0)
    if log_r > 0:  # the ratio is clamped at exp(MAX_LOG_RATIO) ~ 5e8: lambda ~ 1 / (1 + 5e8)
        assert scale < 1e-8
    zero = clip_bias_sums(clipped_policy_loss(lp, old, adv * 0, mask, level="token"), adv * 0, mask)
    assert zero == (0.0, 0.0) and clip_normalization_scale(*zero) == 1.0


def test_normalization_scale_limits_and_refusals():
    assert clip_normalization_scale(float("inf"), 1.0) == 0.0
    assert clip_normalization_scale(1e300, 1e-300) == 0.0
    assert clip_normalization_scale(1.0, float("inf")) == 1.0
    assert clip_normalization_scale(3.0, 1.0, 1.0) == 0.25
    for bad in [(float("nan"), 1.0), (1.0, -1.0), (1.0, 1.0, float("nan"))]:
        with pytest.raises(ValueError, match="must be >= 0"):
            clip_normalization_scale(*bad)


# --- aggregation ---------------------------------------------------------------------------


def direct_weights(lengths, seq_ids, mode):
    seq_ids = list(range(len(lengths))) if seq_ids is None else seq_ids
    tokens = {}
    for n, s in zip(lengths, seq_ids):
        tokens[s] = tokens.get(s, 0) + n
    n_seqs = sum(1 for v in tokens.values() if v > 0)
    out = []
    for n, s in zip(lengths, seq_ids):
        if n == 0:
            out.append(0.0)
        elif mode == "token-mean":
            out.append(1 / sum(lengths))
        elif mode == "seq-mean-token-mean":
            out.append(1 / (n_seqs * tokens[s]))
        else:
            out.append(1 / n_seqs)
    return out


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LENGTHS_AGG = [5, 1, 3, 0, 7, 2, 4, 1, 0]
SEQ_AGG = [10, 10, 4, 7, 7, 7, 4, 99, 5]  # sequence 5 has no tokens and is not counted in S


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ids", [None, SEQ_AGG])
def test_aggregation_weights_match_direct(mode, ids):
    got = aggregation_weights(torch.tensor(LENGTHS_AGG), None if ids is None else torch.tensor(ids), mode)
    assert got.tolist() == pytest.approx(direct_weights(LENGTHS_AGG, ids, mode), rel=1e-15)


def test_aggregated_loss_matches_direct_formulas():
    lp, old, mask, adv = random_batch(31, LENGTHS_AGG)
    per_token = clipped_policy_loss(lp, old, adv, mask, level="token").per_token
    rows = [sum(per_token[i, :n].tolist()) for i, n in enumerate(LENGTHS_AGG)]
    ids = torch.tensor(SEQ_AGG)
    seqs = sorted({s for s, n in zip(SEQ_AGG, LENGTHS_AGG) if n})
    seq_sum = {s: sum(r for r, q in zip(rows, SEQ_AGG) if q == s) for s in seqs}
    seq_len = {s: sum(n for n, q in zip(LENGTHS_AGG, SEQ_AGG) if q == s) for s in seqs}
    want = {
        "token-mean": sum(rows) / sum(LENGTHS_AGG),
        "seq-mean-token-mean": sum(seq_sum[s] / seq_len[s] for s in seqs) / len(seqs),
        "seq-mean-token-sum": sum(seq_sum.values()) / len(seqs),
    }
    for mode, value in want.items():
        got = aggregate(per_token, aggregation_weights(mask.sum(-1), ids, mode))
        assert got.item() == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_does_not_depend_on_micro_batching(mode, level):
    lp, old, mask, adv = random_batch(32, LENGTHS_AGG)
    ids = torch.tensor(SEQ_AGG)
    weights = aggregation_weights(mask.sum(-1), ids, mode)  # once, for the whole update

    def loss(rows, weights=weights):
        rows = torch.tensor(rows)
        terms = clipped_policy_loss(lp[rows], old[rows], adv[rows], mask[rows], level=level,
                                    sequence_ids=ids[rows])
        return aggregate(terms.per_token, weights[rows])

    whole = loss(range(len(LENGTHS_AGG)))
    # a sequence-level ratio needs all of a sequence's turns in one chunk: these splits keep them
    for chunks in ([[0, 1, 2, 6], [3, 4, 5, 7, 8]], [[0, 1, 7], [2, 6, 8], [3, 4, 5]]):
        assert sum(loss(c) for c in chunks).item() == pytest.approx(whole.item(), rel=1e-12)
    # weighting each chunk by itself and averaging the chunks is another loss
    def own(rows):
        w = aggregation_weights(mask[torch.tensor(rows)].sum(-1), ids[torch.tensor(rows)], mode)
        return loss(rows, weights.new_zeros(len(weights)).index_copy(0, torch.tensor(rows), w))

    naive = (own([0, 1]) + own([2, 3, 4, 5, 6, 7, 8])) / 2  # 1 and 3 sequences, 6 and 17 tokens
    assert naive.item() != pytest.approx(whole.item(), rel=1e-6)


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="loss aggregation 'seq-sum'"):
        aggregation_weights(torch.tensor([1, 2]), None, "seq-sum")


# --- KL and effective sample size ----------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_direct(estimator):
    lp, _, mask, _ = random_batch(33, LENGTHS_SEQ)
    g = torch.Generator().manual_seed(34)
    ref = with_garbage(lp - torch.randn(lp.shape, generator=g, dtype=lp.dtype), mask, 35)
    got = kl_penalty(lp, ref, mask, estimator)
    formulas = {"k1": lambda d: -d, "k2": lambda d: 0.5 * d * d, "k3": lambda d: math.exp(d) - d - 1}
    for i, n in enumerate(LENGTHS_SEQ):
        for t in range(n):
            d = ref[i, t].item() - lp[i, t].item()
            assert got[i, t].item() == pytest.approx(formulas[estimator](d), rel=1e-12, abs=1e-15)
    assert_zero_padding(got, LENGTHS_SEQ)
    if estimator == "k3":
        assert torch.equal(got, kl_k3(lp, ref, mask))
    with pytest.raises(ValueError, match="KL estimator 'k4'"):
        kl_penalty(lp, ref, mask, "k4")


def test_effective_sample_size_matches_direct():
    lp, old, mask, adv = random_batch(36, LENGTHS_SEQ)
    terms = clipped_policy_loss(lp, old, adv, mask, level="token")
    ratios = [math.exp(lp[i, t].item() - old[i, t].item()) for i, n in enumerate(LENGTHS_SEQ) for t in range(n)]
    want = sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios))
    got = effective_sample_size(terms.ratio, mask)
    assert got == pytest.approx(want, rel=1e-12)
    assert 0 < got < 1
    assert effective_sample_size(torch.full((2, 3), 1.7), torch.ones(2, 3)) == pytest.approx(1.0, rel=1e-15)
    assert effective_sample_size(terms.ratio, torch.zeros_like(mask)) == 1.0
    huge = torch.tensor([[1e300, 1.0, 1e300, 1.0]], dtype=torch.float64)
    assert effective_sample_size(huge, torch.ones(1, 4)) == pytest.approx(0.5)


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient(level, dual_clip):
    """Unclamped, exp(1e4) is inf and its backward inf * 0 = nan: every step would skip."""
    g = torch.Generator().manual_seed(11)
    lp = (-torch.rand(3, 4, generator=g, dtype=torch.float32) - 0.1).requires_grad_(True)
    old = lp.detach() - 0.05 * torch.randn(3, 4, generator=g)
    old[0, 1] = -1e4  # a planted behaviour log-prob: log-ratio ~ +1e4
    old[2, 0] = 1e4  # and one of ~ -1e4
    adv = torch.tensor([1.0, -0.5, -2.0])
    mask = torch.ones(3, 4)
    terms = clipped_policy_loss(lp, old, adv, mask, level=level, sequence_ids=torch.tensor([0, 0, 1]),
                                dual_clip=dual_clip)
    loss = terms.per_token.sum()
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert float(terms.ratio.detach().max()) == pytest.approx(math.exp(MAX_LOG_RATIO), rel=1e-6)
    assert math.isfinite(clip_normalization_scale(*clip_bias_sums(terms, adv, mask)))
