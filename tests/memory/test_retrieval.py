"""Stochastic retrieval: Plackett–Luce log-probabilities, gradients, sampling, greedy choice."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from hieragent.memory.adapter import QueryAdapter
from hieragent.memory.bank import MemoryBank
from hieragent.memory.encoder import load_encoder
from hieragent.memory.retrieval import contrastive_loss, retrieval_logprob, sample_retrieval, sample_retrievals
from hieragent.objectives.advantages import normalise
from hieragent.objectives.losses import clipped_policy_loss
from hieragent.types import Retrieval

SKILLS = Path(__file__).resolve().parents[2] / "data" / "skills.jsonl"
D = 12


@pytest.fixture(scope="module")
def encoder():
    return load_encoder("minilm")


def unit(rng: np.random.Generator, n: int, d: int = D) -> np.ndarray:
    x = rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def random_adapter(seed: int, d: int = D, scale: float = 0.5) -> QueryAdapter:
    g = torch.Generator().manual_seed(seed)
    adapter = QueryAdapter(d)
    with torch.no_grad():
        adapter.weight.copy_(scale * torch.randn(d, d, generator=g))
        adapter.bias.copy_(scale * torch.randn(d, generator=g))
    return adapter


def random_bank(seed: int, n: int) -> MemoryBank:
    bank = MemoryBank(merge_threshold=1.5)
    bank.add([f"skill {i}" for i in range(n)], keys=unit(np.random.default_rng(seed), n))
    return bank


def adapted_f64(adapter: QueryAdapter, q: np.ndarray) -> np.ndarray:
    w, b = adapter.weight.detach().double().numpy(), adapter.bias.detach().double().numpy()
    a = q.astype(np.float64) + q.astype(np.float64) @ w.T + b
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def pl_logprob_f64(adapter: QueryAdapter, r: Retrieval) -> float:
    """Plackett–Luce by its definition: each draw a softmax over the entries not yet drawn."""
    s = np.asarray(r.keys, dtype=np.float64) @ adapted_f64(adapter, np.asarray(r.query)) / r.temperature
    remaining, total = list(range(len(s))), 0.0
    for c in r.chosen:
        total += s[c] - np.log(np.sum(np.exp(s[remaining])))
        remaining.remove(c)
    return total


def random_retrieval(rng: np.random.Generator, n: int, k: int, temperature: float) -> Retrieval:
    return Retrieval(
        query=unit(rng, 1)[0].tolist(),
        keys=unit(rng, n).tolist(),
        entry_ids=list(range(n)),
        chosen=rng.permutation(n)[:k].tolist(),
        old_logprob=0.0,
        temperature=temperature,
    )


def test_retrieval_logprob_matches_float64_plackett_luce_with_unequal_n():
    rng = np.random.default_rng(0)
    adapter = random_adapter(1)
    shapes = [(3, 2, 0.5), (7, 3, 0.1), (1, 1, 1.0), (5, 5, 0.3), (6, 1, 2.0)]  # (N, k, T)
    rs = [random_retrieval(rng, n, k, t) for n, k, t in shapes]
    want = np.array([pl_logprob_f64(adapter, r) for r in rs])
    assert np.all(want < 0) and np.ptp(want) > 0.5  # the reference is not trivially zero
    got32 = retrieval_logprob(adapter, rs)
    assert got32.shape == (5,) and got32.dtype == torch.float32
    np.testing.assert_allclose(got32.detach().numpy(), want, rtol=1e-5, atol=1e-4)
    got64 = retrieval_logprob(adapter.double(), rs)
    np.testing.assert_allclose(got64.detach().numpy(), want, rtol=1e-10, atol=1e-10)


def test_gradient_reaches_adapter_and_matches_finite_differences():
    rng = np.random.default_rng(2)
    rs = [random_retrieval(rng, n, k, 0.4) for n, k in [(4, 2), (6, 3), (2, 2)]]
    adapter = random_adapter(3, scale=0.3).double()
    retrieval_logprob(adapter, rs).sum().backward()
    assert adapter.weight.grad is not None and torch.isfinite(adapter.weight.grad).all()
    assert adapter.weight.grad.abs().sum() > 0 and adapter.bias.grad.abs().sum() > 0

    w0 = adapter.weight.detach().clone()

    def f(w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            adapter.weight.copy_(w)
        return retrieval_logprob(adapter, rs).sum()

    eps, (i, j) = 1e-6, (1, 5)
    w_plus, w_minus = w0.clone(), w0.clone()
    w_plus[i, j] += eps
    w_minus[i, j] -= eps
    fd = (f(w_plus) - f(w_minus)).item() / (2 * eps)
    assert adapter.weight.grad[i, j].item() == pytest.approx(fd, rel=1e-5, abs=1e-8)


def test_old_logprob_equals_recomputed_logprob_while_adapter_is_unchanged():
    bank, adapter = random_bank(4, 20), random_adapter(5)
    g = torch.Generator().manual_seed(0)
    queries = unit(np.random.default_rng(6), 8)
    out = sample_retrievals(bank, adapter, queries, n=6, k=3, temperature=0.3, generator=g)
    rs = [r for _, r in out]
    others = [random_retrieval(np.random.default_rng(7), 9, 4, 0.3)]  # a batch with wider N
    got = retrieval_logprob(adapter, rs + others)[:8].detach().numpy()
    np.testing.assert_allclose(got, [r.old_logprob for r in rs], atol=1e-6)
    np.testing.assert_allclose([pl_logprob_f64(adapter, r) for r in rs], [r.old_logprob for r in rs], atol=1e-4)


def test_candidates_are_top_n_by_adapted_similarity_and_greedy_takes_top_k():
    bank, adapter = random_bank(8, 25), random_adapter(9, scale=1.0)
    q = unit(np.random.default_rng(10), 1)
    sims = bank.keys(bank.ids()).astype(np.float64) @ adapted_f64(adapter, q)[0]  # [25]
    order = np.asarray(bank.ids())[np.argsort(-sims)]
    raw_order = np.asarray(bank.ids())[np.argsort(-(bank.keys(bank.ids()) @ q[0]))]
    assert list(order[:3]) != list(raw_order[:3])  # the adapter matters for this query
    texts, r = sample_retrieval(bank, adapter, q[0], n=8, k=3, temperature=0.2, greedy=True)
    assert r.entry_ids == order[:8].tolist()
    assert [r.entry_ids[c] for c in r.chosen] == order[:3].tolist()
    assert texts == bank.texts(order[:3])
    assert r.old_logprob == pytest.approx(pl_logprob_f64(adapter, r), abs=1e-4)


def test_sampling_frequencies_match_plackett_luce_probabilities():
    bank, adapter = random_bank(11, 4), random_adapter(12)
    q = np.repeat(unit(np.random.default_rng(13), 1), 6000, axis=0)  # one query, 6000 draws
    g = torch.Generator().manual_seed(123)
    out = sample_retrievals(bank, adapter, q, n=4, k=2, temperature=0.5, generator=g)
    first = out[0][1]
    counts = {p: 0 for p in itertools.permutations(range(4), 2)}
    for _, r in out:
        counts[tuple(r.chosen)] += 1
    for pair, c in counts.items():
        p = np.exp(pl_logprob_f64(adapter, Retrieval(first.query, first.keys, first.entry_ids, list(pair), 0.0, 0.5)))
        assert abs(c / 6000 - p) < 0.02, (pair, c / 6000, p)


def test_same_seed_gives_same_draws_and_k_is_capped_by_bank_size():
    bank, adapter = random_bank(14, 3), random_adapter(15)
    q = unit(np.random.default_rng(16), 5)
    a = sample_retrievals(bank, adapter, q, 5, 4, 1.0, torch.Generator().manual_seed(1))
    b = sample_retrievals(bank, adapter, q, 5, 4, 1.0, torch.Generator().manual_seed(1))
    assert [r.chosen for _, r in a] == [r.chosen for _, r in b]
    for texts, r in a:
        assert len(r.entry_ids) == 3 and sorted(r.chosen) == [0, 1, 2] and len(texts) == 3


def test_empty_bank_retrieves_nothing():
    assert sample_retrieval(MemoryBank(), QueryAdapter(D), np.ones(D), n=4, k=2, temperature=1.0) == ([], None)


def test_bad_arguments_are_refused():
    bank = random_bank(17, 3)
    with pytest.raises(ValueError, match="k <= n"):
        sample_retrieval(bank, None, unit(np.random.default_rng(0), 1)[0], n=2, k=3, temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        sample_retrieval(bank, None, unit(np.random.default_rng(0), 1)[0], n=2, k=1, temperature=0.0)


def test_text_queries_retrieve_matching_real_skills_in_one_encoder_call(encoder, monkeypatch):
    bank = MemoryBank()
    bank.seed_from_jsonl(SKILLS)
    calls = []
    real_embed = bank.embed
    monkeypatch.setattr(bank, "embed", lambda texts: calls.append(len(texts)) or real_embed(texts))
    adapter = QueryAdapter(384)  # identity at start: plain cosine search
    out = sample_retrievals(bank, adapter, ["go to the red ball", "open the red door"], n=4, k=1,
                            temperature=0.05, greedy=True)
    assert calls == [2]
    assert "go to the red ball" in out[0][0][0] and "open the red door" in out[1][0][0]
    texts, r = sample_retrieval(bank, adapter, "go to the red ball", n=4, k=2, temperature=0.05,
                                generator=torch.Generator().manual_seed(0))
    assert len(texts) == 2 and len(r.query) == 384 and len(r.keys) == 4


def contrastive_f64(adapter: QueryAdapter, r: Retrieval, p: np.ndarray, t: float, same_above: float) -> float:
    q = adapted_f64(adapter, np.asarray(r.query))
    keys = np.asarray(r.keys, dtype=np.float64)
    negatives = keys[keys @ p.astype(np.float64) < same_above]
    logits = np.concatenate([[q @ p], negatives @ q]) / t
    return float(np.log(np.sum(np.exp(logits))) - logits[0])


def test_contrastive_loss_matches_float64_infonce_and_leaves_out_the_positive_itself():
    rng = np.random.default_rng(11)
    adapter = random_adapter(12)
    retrievals, positives = [], []
    for n in (3, 6, 5):
        keys = unit(rng, n)
        positive = keys[1] if n == 6 else unit(rng, 1)[0]  # once, the positive is a candidate
        retrievals.append(Retrieval(query=unit(rng, 1)[0].tolist(), keys=keys.tolist(), entry_ids=list(range(n)),
                                    chosen=[0], old_logprob=0.0, temperature=1.0))
        positives.append(positive)
    got = contrastive_loss(adapter, retrievals, torch.from_numpy(np.stack(positives)), 0.3, 0.95)
    want = np.mean([contrastive_f64(adapter, r, p, 0.3, 0.95) for r, p in zip(retrievals, positives)])
    assert got.item() == pytest.approx(want, rel=1e-5)
    got.backward()
    assert adapter.weight.grad.abs().sum() > 0


TEMP = 0.2  # at this temperature P(right) is 0.74 when the adapted query equals the right key


def reinforce_right_entry(reward_right: bool, steps: int = 40) -> tuple[float, float, float, float]:
    """The synthetic task: 16 entries, one of which (id 11, far from every query) is the right
    one. The query adapter is trained by the planner's objective (turn-level clipped ratio of
    the retrieval log-probability, group-normalised advantages); returns P(right) before and
    after on the training queries, after on fresh queries, and the share of training queries
    whose greedy (top-1) retrieval is the right entry."""
    rng = np.random.default_rng(5)
    keys = unit(rng, 16)
    queries = unit(rng, 8)
    right = int(np.argmin((queries @ keys.T).mean(0)))  # the entry plain cosine likes least
    bank = MemoryBank(merge_threshold=1.5)
    bank.add([f"skill {i}" for i in range(16)], keys=keys)
    adapter = QueryAdapter(D)
    opt = torch.optim.Adam(adapter.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)

    def p_right(q: np.ndarray) -> float:
        with torch.no_grad():
            a = adapter(torch.from_numpy(q))
            return torch.softmax(a @ torch.from_numpy(keys).T / TEMP, dim=1)[:, right].mean().item()

    before = p_right(queries)
    for _ in range(steps):
        group = np.repeat(queries, 4, axis=0)  # 4 draws per query: one GRPO group per query
        picked = sample_retrievals(bank, adapter, group, n=16, k=1, temperature=TEMP, generator=gen)
        retrievals = [r for _, r in picked]
        hit = torch.tensor([float(r.entry_ids[r.chosen[0]] == right) for r in retrievals])
        rewards = hit if reward_right else torch.rand(len(hit), generator=gen)
        adv = torch.cat([normalise(g) for g in rewards.view(8, 4)])  # [32]
        old = torch.tensor([r.old_logprob for r in retrievals])[:, None]  # [32, 1]
        for _ in range(2):
            logp = retrieval_logprob(adapter, retrievals)[:, None]  # [32, 1]
            loss = clipped_policy_loss(logp, old, adv, torch.ones_like(logp)).per_token.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    greedy = sample_retrievals(bank, adapter, queries, n=16, k=1, temperature=TEMP, greedy=True)
    top1 = np.mean([r.entry_ids[r.chosen[0]] == right for _, r in greedy])
    return before, p_right(queries), p_right(unit(np.random.default_rng(6), 8)), float(top1)


def test_trained_adapter_moves_retrieval_toward_the_one_useful_entry():
    before, after, fresh, top1 = reinforce_right_entry(reward_right=True)
    assert before < 0.05  # plain cosine retrieval almost never picks it
    assert after > 0.7 and top1 == 1.0  # about as sure as a query on the key itself, and top-1 everywhere
    assert fresh > 0.6  # the affine map carries over to queries it never saw
    _, control, _, _ = reinforce_right_entry(reward_right=False)
    assert control < 0.15  # rewards that ignore the choice teach nothing about it
