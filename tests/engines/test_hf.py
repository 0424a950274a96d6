"""The HF engine: cached and uncached log-probs agree (float64), the cache is used, and a
weight change under a new version invalidates it."""

import pytest
import torch

from hieragent.agents.scoring import continuation_logprobs
from hieragent.engines.base import EngineSettings, Request, Sampling
from hieragent.engines.hf import HFEngine
from hieragent.engines.prompting import Dialogue, Prompter

CANDIDATES = ["turn left", "turn right", "go forward", "pick up"]


def trainable(lm):
    return {n: p for n, p in lm.named_parameters() if "lora_" in n}


def engines(lm, tokenizer):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    cached = HFEngine(lm, pad, eos, EngineSettings(prefix_cache=True, cache_prompts=4))
    plain = HFEngine(lm, pad, eos, EngineSettings(prefix_cache=False))
    return cached, plain


def observation(g):
    return f"You see a ball {int(torch.randint(1, 9, (1,), generator=g))} steps forward."


def perturb(lm, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


@pytest.mark.parametrize("history", [0, 3])
def test_cached_scores_equal_uncached_over_turns_for_both_adapters(tiny_lm, tokenizer, history):
    lm = tiny_lm.double()
    cached, plain = engines(lm, tokenizer)
    prompter = Prompter(tokenizer, history)
    cand_ids = [list(tokenizer.encode(c, add_special_tokens=False)) + [tokenizer.eos_token_id]
                for c in CANDIDATES]
    g = torch.Generator().manual_seed(3)
    dialogues = {(a, e): Dialogue() for a in ("planner", "executor") for e in range(3)}
    for version in (0, 1):
        if version:
            perturb(lm, 7)
            cached.sync(trainable(lm), version)
        for turn in range(5):
            for adapter in ("planner", "executor"):
                built = [prompter.prompt(adapter, f"Mission: go to the ball {e}\n{observation(g)}", None,
                                         dialogues[adapter, e]) for e in range(3)]
                requests = [Request(p, adapter, episode=e) for e, (p, _) in enumerate(built)]
                got = cached.score(requests, [cand_ids] * 3)
                want = plain.score(requests, [cand_ids] * 3)
                for row_got, row_want, (p, _) in zip(got, want, built):
                    for c, a, b in zip(cand_ids, row_got, row_want):
                        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1e-5)
                        direct = _direct(lm, p, c)
                        torch.testing.assert_close(a.double(), direct, rtol=0, atol=1e-5)
                for e, (_, user) in enumerate(built):
                    prompter.remember(dialogues[adapter, e], user, cand_ids[turn % len(cand_ids)])
    assert cached.stats.reused > 0.3 * (cached.stats.reused + cached.stats.computed)
    assert plain.stats.reused == 0


def _direct(lm, prompt, cont):
    """float64 log-probs of ``cont`` after ``prompt`` from one unpadded forward."""
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + cont])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[len(prompt) - 1 + j, tok] for j, tok in enumerate(cont)]).float().double()


def test_cached_engine_agrees_with_a_float64_reference_to_rounding(tiny_lm, tokenizer):
    lm = tiny_lm.double()
    cached, _ = engines(lm, tokenizer)
    prompter = Prompter(tokenizer, history=4)
    dialogue = Dialogue()
    cand = [list(tokenizer.encode("go forward", add_special_tokens=False)) + [tokenizer.eos_token_id]]
    for turn in range(4):
        prompt, user = prompter.prompt("executor", f"Subgoal: explore\nstep {turn}", None, dialogue)
        got = cached.score([Request(prompt, "executor", episode=0)], [cand])[0][0]
        with torch.no_grad():
            want = continuation_logprobs(lm, [prompt], cand, [0], tokenizer.pad_token_id)[0]
        assert (got.double() - want.double()).abs().max() < 1e-6  # float32 outputs of float64 numbers
        prompter.remember(dialogue, user, cand[0])
    assert cached.stats.reused > cached.stats.computed


def test_stale_cache_after_a_weight_change_would_be_wrong_and_sync_drops_it(tiny_lm, tokenizer):
    lm = tiny_lm.double()
    cached, plain = engines(lm, tokenizer)
    prompter = Prompter(tokenizer)
    cand = [[tokenizer.eos_token_id]]
    first, _ = prompter.prompt("executor", "Subgoal: explore\nYou see a wall.", None)
    second, _ = prompter.prompt("executor", "Subgoal: explore\nYou see a door.", None)
    cached.score([Request(first, "executor", episode=0)], [cand])
    perturb(lm, 11)
    stale = cached.score([Request(second, "executor", episode=0)], [cand])[0][0]
    fresh = plain.score([Request(second, "executor", episode=0)], [cand])[0][0]
    assert (stale - fresh).abs().max() > 1e-4  # the reused prefix holds the old weights' K/V
    cached.sync(trainable(lm), 1)
    synced = cached.score([Request(second, "executor", episode=0)], [cand])[0][0]
    torch.testing.assert_close(synced, fresh, rtol=0, atol=1e-6)


def test_generate_records_tempered_logprobs_the_trainer_recomputes(tiny_lm, tokenizer):
    lm = tiny_lm.double()
    cached, _ = engines(lm, tokenizer)
    prompter = Prompter(tokenizer)
    prompts = [prompter.prompt("planner", f"Mission: open the door {i}", None)[0] for i in range(3)]
    sampling = Sampling(temperature=0.7, max_new_tokens=6)
    gens = cached.generate([Request(p, "planner", i, sampling) for i, p in enumerate(prompts)],
                           torch.Generator().manual_seed(0))
    for p, gen in zip(prompts, gens):
        assert 1 <= len(gen.ids) <= 6 and len(gen.logprobs) == len(gen.ids)
        assert gen.finish_reason == ("stop" if gen.ids[-1] == tokenizer.eos_token_id else "length")
        with torch.no_grad():
            lm.set_adapter("planner")
            want = continuation_logprobs(lm, [p], [gen.ids], [0], tokenizer.pad_token_id, 0.7)[0]
        torch.testing.assert_close(torch.tensor(gen.logprobs, dtype=torch.float64), want.double(),
                                   rtol=0, atol=1e-6)
    again = cached.generate([Request(p, "planner", i, sampling) for i, p in enumerate(prompts)],
                            torch.Generator().manual_seed(0))
    assert [g.ids for g in again] == [g.ids for g in gens]  # the cache changes nothing sampled


def test_one_batch_runs_one_adapter(tiny_lm, tokenizer):
    cached, _ = engines(tiny_lm, tokenizer)
    with pytest.raises(ValueError, match="one adapter"):
        cached.score([Request([1, 2], "planner"), Request([1, 2], "executor")], [[[3]], [[3]]])


def test_a_batch_mixing_cached_and_fresh_prompts_matches_uncached(tiny_lm, tokenizer):
    lm = tiny_lm.double()
    cached, plain = engines(lm, tokenizer)
    cached.settings = EngineSettings(prefix_cache=True, cache_prompts=0)  # own episode only
    prompter = Prompter(tokenizer)
    cand = [[tokenizer.eos_token_id], list(tokenizer.encode("go forward", add_special_tokens=False))]
    first = [prompter.prompt("executor", f"Subgoal: find key {e}\nYou see a wall.", None)[0] for e in range(2)]
    cached.score([Request(first[0], "executor", episode=0)], [cand])  # only episode 0 is cached
    second = [prompter.prompt("executor", f"Subgoal: find key {e}\nYou see a door {e}.", None)[0]
              for e in range(3)]
    requests = [Request(p, "executor", episode=e) for e, p in enumerate(second)]
    before = cached.stats.reused
    got, want = cached.score(requests, [cand] * 3), plain.score(requests, [cand] * 3)
    assert cached.stats.reused > before  # row 0 reused its prefix, rows 1 and 2 ran whole
    for row_got, row_want in zip(got, want):
        for a, b in zip(row_got, row_want):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
