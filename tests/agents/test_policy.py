"""Policies record behaviour log-probs that training recomputes exactly from the same ids."""

import pytest
import torch

from hieragent.agents.policy import Executor, Planner
from hieragent.agents.scoring import token_logprobs
from acting_helpers import act_on, prompt_ids


def test_score_mode_ratio_is_one_at_the_rollout_weights(tiny_lm, tokenizer):
    ex = Executor(mode="score")
    ex.bind(tiny_lm, tokenizer)
    prompts = [prompt_ids(ex, "Subgoal: go to the red ball\nYou see a red ball 2 steps forward."),
               prompt_ids(ex, "Subgoal: explore\nYou see a wall 1 step left.")]
    opts = [["turn left", "turn right", "go forward"], ["go forward", "toggle"]]
    turns = act_on(ex, prompts, opts, generator=torch.Generator().manual_seed(0))
    new = ex.turn_logprobs(turns)
    for t, o, lp in zip(turns, opts, new):
        assert t.text == o[t.chosen]
        assert t.action_ids == t.candidate_ids[t.chosen]
        assert t.prompt_ids in prompts
        assert lp.shape == (1,)
        assert abs(lp.item() - t.old_logprobs[0]) < 1e-5


def test_adapters_are_distinct_policies_and_reference_disables_them(tiny_lm, tokenizer):
    planner, executor = Planner(), Executor()
    for p in (planner, executor):
        p.bind(tiny_lm, tokenizer)
    prompt = [prompt_ids(executor, "Subgoal: go to the red ball")]
    opts = [["turn left", "go forward", "pick up"]]
    turns = act_on(executor, prompt, opts, greedy=True)
    as_executor = executor.turn_logprobs(turns)[0]
    with planner.active():
        as_planner = executor._recorded_logprobs(turns)[0]
    reference = executor.reference_logprobs(turns)[0]
    assert not torch.allclose(as_executor, as_planner)
    assert not torch.allclose(as_executor, reference)


def test_generate_mode_carries_sampled_ids_and_their_logprobs(tiny_lm, tokenizer):
    torch.manual_seed(0)
    ex = Executor(mode="generate", max_new_tokens=5)
    ex.bind(tiny_lm, tokenizer)
    prompts = [prompt_ids(ex, "Subgoal: go to the red ball"), prompt_ids(ex, "Subgoal: explore the room now")]
    turns = act_on(ex, prompts, [[], []])
    new = ex.turn_logprobs(turns)
    for t, lp in zip(turns, new):
        assert 1 <= len(t.action_ids) <= 5
        assert len(t.old_logprobs) == len(t.action_ids) == len(lp)
        # generation (cached, left-padded) and training (prefix-cached) agree on the same ids
        torch.testing.assert_close(lp, torch.tensor(t.old_logprobs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_generate_mode_behaviour_and_training_logprobs_agree_at_any_temperature(tiny_lm, tokenizer, temperature):
    torch.manual_seed(1)
    ex = Executor(mode="generate", max_new_tokens=6, temperature=temperature)
    ex.bind(tiny_lm, tokenizer)
    prompts = [prompt_ids(ex, "Subgoal: go to the red ball"), prompt_ids(ex, "Subgoal: open the door")]
    turns = act_on(ex, prompts, [[], []])
    new = ex.turn_logprobs(turns)
    for t, lp in zip(turns, new):
        torch.testing.assert_close(lp, torch.tensor(t.old_logprobs), rtol=1e-4, atol=1e-4)
    # and both are the tempered distribution, written out in float64 from a plain forward
    t = turns[0]
    ids = torch.tensor([t.prompt_ids + t.action_ids])
    with ex.active(), torch.no_grad():
        logits = tiny_lm(input_ids=ids).logits[0].double()  # [P + N, V]
    pred = logits[len(t.prompt_ids) - 1: -1]  # [N, V]: position j predicts action token j
    want = torch.log_softmax(pred / temperature, -1).gather(-1, torch.tensor(t.action_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(t.old_logprobs, dtype=torch.float64), want, rtol=1e-4, atol=1e-4)


def test_token_logprobs_is_the_tempered_log_softmax():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 11, generator=g) * 3
    ids = torch.randint(0, 11, (3, 4), generator=g)
    for temperature in (0.5, 1.0, 1.5):
        want = torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids[..., None])[..., 0]
        torch.testing.assert_close(token_logprobs(logits, ids, temperature).double(), want, rtol=1e-5, atol=1e-6)
