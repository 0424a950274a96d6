"""From turns to the loss: grouping by sequence, aggregation over micro-batches, truncated IS."""

import math
import random

import pytest
import torch

from hieragent.objectives.update import (
    ObjectiveSettings,
    RoleTurns,
    chunk_loss,
    micro_batches,
    old_logprobs_of,
    retrieval_loss,
    role_turns,
    sample_minibatch,
)
from hieragent.objectives.losses import aggregation_weights
from hieragent.types import Batch, Retrieval, Trajectory, Turn


def make_batch(rng: random.Random, n_traj: int = 5) -> Batch:
    trajs = []
    for g in range(n_traj):
        turns = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 4)
            t = Turn(role="planner", prompt_ids=[1, 2], action_ids=[3] * n,
                     old_logprobs=[-rng.uniform(0.1, 2.0) for _ in range(n)], text="x",
                     advantage=rng.uniform(-1.5, 1.5))
            turns.append(t)
        turns[0].retrieval = Retrieval(query=[0.0], keys=[[0.0]], entry_ids=[0], chosen=[0],
                                       old_logprob=-rng.uniform(0.2, 1.0), temperature=1.0)
        turns.append(Turn(role="executor", prompt_ids=[1], action_ids=[2], old_logprobs=[-0.3], text="y"))
        trajs.append(Trajectory(turns=turns, group=g))
    return Batch(trajs)


def test_role_turns_gives_one_sequence_per_trajectory_and_turn_indices():
    b = make_batch(random.Random(0))
    items = role_turns([b, b], "planner")
    want_seq = [s for s, tr in enumerate(b.trajectories * 2) for _ in tr.of("planner")]
    assert items.sequence_ids == want_seq
    assert items.turn_index == [k for tr in b.trajectories * 2 for k in range(len(tr.of("planner")))]


def test_sequences_stay_whole_in_minibatches_and_micro_batches():
    b = make_batch(random.Random(1), n_traj=12)
    items = role_turns([b], "planner")
    sizes = {s: items.sequence_ids.count(s) for s in set(items.sequence_ids)}
    mini = sample_minibatch(items, 7, whole_sequences=True, generator=torch.Generator().manual_seed(0))
    assert 0 < len(mini.turns) <= 7
    assert all(mini.sequence_ids.count(s) == sizes[s] for s in set(mini.sequence_ids))
    for rows in micro_batches(items, 5, whole_sequences=True):
        seqs = {items.sequence_ids[r] for r in rows}
        assert sum(sizes[s] for s in seqs) == len(rows)
    flat = [r for rows in micro_batches(items, 5, whole_sequences=True) for r in rows]
    assert sorted(flat) == list(range(len(items.turns)))


@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_and_gradient_do_not_depend_on_micro_batching(level, aggregation):
    rng = random.Random(2)
    items = role_turns([make_batch(rng, n_traj=6)], "planner")
    settings = ObjectiveSettings(level=level, aggregation=aggregation, kl_coef=0.1, eps_low=0.05,
                                 eps_high=0.05, dual_clip=2.0)
    g = torch.Generator().manual_seed(3)
    n_tok = [len(old_logprobs_of(t)) for t in items.turns]
    params = [torch.randn(n, generator=g, dtype=torch.float64).requires_grad_(True) for n in n_tok]
    weights = aggregation_weights(torch.tensor(n_tok), torch.tensor(items.sequence_ids), aggregation)

    def logps(rows):
        return [torch.tensor(old_logprobs_of(items.turns[i]), dtype=torch.float64) + 0.4 * params[i] for i in rows]

    refs = lambda rows: [torch.tensor(items.turns[i].old_logprobs, dtype=torch.float64) - 0.1 for i in rows]  # noqa: E731
    every = list(range(len(items.turns)))
    whole = chunk_loss(logps(every), refs(every), items.turns, weights, settings, items.sequence_ids)
    grads_whole = torch.autograd.grad(whole.loss, params)
    parts = []
    for rows in micro_batches(items, 4, whole_sequences=True):
        sub = items.subset(rows)
        parts.append(chunk_loss(logps(rows), refs(rows), sub.turns, weights[rows], settings, sub.sequence_ids))
    split = sum(p.loss for p in parts)
    grads_split = torch.autograd.grad(split, params, allow_unused=True)
    assert split.item() == pytest.approx(whole.loss.item(), rel=1e-12)
    for a, b in zip(grads_whole, grads_split):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert sum(p.clipped for p in parts) == whole.clipped > 0


def test_truncated_is_clips_against_trainer_logprobs_and_weights_by_the_engine_gap():
    rng = random.Random(4)
    turns = []
    for _ in range(5):
        n = rng.randint(1, 4)
        engine = [-rng.uniform(0.1, 2) for _ in range(n)]
        trainer = [e + rng.gauss(0, 0.5) for e in engine]
        turns.append(Turn(role="executor", prompt_ids=[1], action_ids=[2] * n, old_logprobs=engine,
                          text="a", advantage=rng.uniform(-1, 1), trainer_logprobs=trainer))
    cap, eps = 1.3, 0.2
    settings = ObjectiveSettings(level="token", tis_cap=cap, eps_low=eps, eps_high=eps, kl_coef=0.0)
    current = [[lp + rng.gauss(0, 0.3) for lp in t.trainer_logprobs] for t in turns]
    n_tok = torch.tensor([len(t.old_logprobs) for t in turns])
    w = aggregation_weights(n_tok, None, "token-mean")
    got = chunk_loss([torch.tensor(c, dtype=torch.float64) for c in current], None, turns, w, settings)
    want, gaps = 0.0, []
    for t, cur in zip(turns, current):
        for lp, tr, en in zip(cur, t.trainer_logprobs, t.old_logprobs):
            r = math.exp(lp - tr)
            tis = min(math.exp(tr - en), cap)
            want += -tis * min(r * t.advantage, min(max(r, 1 - eps), 1 + eps) * t.advantage)
            gaps.append(abs(tr - en))
    want /= int(n_tok.sum())
    assert got.loss.item() == pytest.approx(want, rel=1e-12)
    assert got.gap_sum / got.tokens == pytest.approx(sum(gaps) / len(gaps), rel=1e-12)


def test_settings_reject_bad_values_naming_the_key():
    with pytest.raises(ValueError, match="model.objective.level"):
        ObjectiveSettings(level="episode")
    with pytest.raises(ValueError, match="model.objective.dual_clip"):
        ObjectiveSettings(dual_clip=0.5)
    with pytest.raises(ValueError, match="model.objective.tis_cap"):
        ObjectiveSettings(tis_cap=0.0)


def test_a_recomputed_row_of_another_length_is_refused_naming_the_turn():
    turns = [Turn(role="executor", prompt_ids=[1], action_ids=[2, 3], old_logprobs=[-0.3, -0.2], text="go on",
                  advantage=1.0, policy_version=4)]
    w = aggregation_weights(torch.tensor([2]), None, "token-mean")
    with pytest.raises(ValueError, match=r"executor turn 'go on' \(policy version 4\).*3 entries.*2"):
        chunk_loss([torch.tensor([-0.3, -0.2, -0.1])], None, turns, w, ObjectiveSettings(kl_coef=0.0))


@pytest.mark.parametrize("weighted", [True, False])
def test_kl_term_is_weighted_by_the_detached_ratio_of_stale_samples(weighted):
    rng = random.Random(6)
    turns = [Turn(role="executor", prompt_ids=[1], action_ids=[2] * n, text="a", advantage=rng.uniform(-1, 1),
                  old_logprobs=[-rng.uniform(0.1, 2) for _ in range(n)]) for n in (3, 1, 4)]
    current = [[lp + rng.gauss(0, 0.4) for lp in t.old_logprobs] for t in turns]
    refs = [[lp + rng.gauss(0, 0.4) for lp in t.old_logprobs] for t in turns]
    settings = ObjectiveSettings(level="turn", kl_coef=0.3, kl_estimator="k2", kl_importance_weight=weighted)
    w = aggregation_weights(torch.tensor([3, 1, 4]), None, "token-mean")
    got = chunk_loss([torch.tensor(c, dtype=torch.float64) for c in current],
                     [torch.tensor(r, dtype=torch.float64) for r in refs], turns, w, settings)
    want = 0.0
    for t, cur, ref in zip(turns, current, refs):
        r = math.exp(sum(c - o for c, o in zip(cur, t.old_logprobs)) / len(cur))  # the turn ratio (2)
        want += sum((r if weighted else 1.0) * 0.5 * (rf - c) ** 2 for c, rf in zip(cur, ref))
    assert got.kl_sum == pytest.approx(want / 8, rel=1e-12)


def test_the_retrieval_has_its_own_exact_ratio_clip_and_weight():
    """The query adapter's ordered choice: one ratio per retrieval, clipped, times retrieval_coef."""
    from hieragent.agents.policy import Planner
    from hieragent.memory.retrieval import retrieval_logprob

    g = torch.Generator().manual_seed(7)
    planner = Planner(embed_dim=4)
    turns = []
    for i in range(5):
        n = 3 + i % 2
        r = Retrieval(query=torch.randn(4, generator=g).tolist(), keys=torch.randn(n, 4, generator=g).tolist(),
                      entry_ids=list(range(n)), chosen=[i % n], old_logprob=0.0, temperature=0.5)
        turns.append(Turn(role="planner", prompt_ids=[1], action_ids=[2], old_logprobs=[-0.5], text="s",
                          advantage=float(torch.randn(1, generator=g)), retrieval=r))
    turns.append(Turn(role="planner", prompt_ids=[1], action_ids=[2], old_logprobs=[-0.5], text="s"))
    with torch.no_grad():  # behaviour: the adapter as it was, plus noise, so some ratios clip
        now = retrieval_logprob(planner.query_adapter, [t.retrieval for t in turns[:5]])
    for i, (t, lp) in enumerate(zip(turns, now.tolist())):
        # even turns: ratio exp(+-0.5) in the advantage's direction, so the clip binds; odd: inside
        t.retrieval.old_logprob = lp - math.copysign(0.5, t.advantage) if i % 2 == 0 else lp + 0.05
    settings = ObjectiveSettings(eps_low=0.1, eps_high=0.1, retrieval_coef=0.7)
    seen = []
    stats = retrieval_loss(planner, RoleTurns(turns, list(range(6)), [0] * 6), settings, seen.append)
    want = 0.0
    for t, lp in zip(turns, now.tolist()):
        ratio = math.exp(lp - t.retrieval.old_logprob)
        want += -min(ratio * t.advantage, min(max(ratio, 0.9), 1.1) * t.advantage)
    assert stats.turns == stats.tokens == 5 and stats.clipped == 3
    assert len(seen) == 1 and seen[0].item() == pytest.approx(0.7 * want / 5, rel=1e-5)
    assert stats.policy == pytest.approx(want / 5, rel=1e-5)
    assert 0 < stats.bias_sum and stats.adv_sum == pytest.approx(sum(abs(t.advantage) for t in turns[:5]), rel=1e-6)
    # the planner's own turns no longer carry the retrieval as a token
    assert all(old_logprobs_of(t) == [-0.5] for t in turns)


def test_settings_refuse_k1_as_a_loss_and_negative_clip_ranges():
    with pytest.raises(ValueError, match="kl_estimator 'k1'.*kl_mode: reward"):
        ObjectiveSettings(kl_estimator="k1", kl_mode="loss", kl_coef=0.1)
    ObjectiveSettings(kl_estimator="k1", kl_mode="reward", kl_coef=0.1)  # a number there: fine
    with pytest.raises(ValueError, match="eps_low and eps_high"):
        ObjectiveSettings(eps_low=-0.2)
    with pytest.raises(ValueError, match="retrieval_coef"):
        ObjectiveSettings(retrieval_coef=-1.0)
    assert ObjectiveSettings(aggregation="seq-mean-token-sum").whole_sequences
    assert ObjectiveSettings(level="sequence").whole_sequences
    assert not ObjectiveSettings().whole_sequences
