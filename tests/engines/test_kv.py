"""The HF engine's KV arena: slots kept in place across calls give the numbers of whole
prompts (float64, tiny model), in every way a call can meet them: rows out of slot order,
new episodes taking a free slot or another's prefix, completions reused by the next turn;
and the grouped attention it runs equals attention with repeated K/V."""

import numpy as np
import pytest
import torch

from hieragent.engines.base import EngineSettings, Request, Sampling
from hieragent.engines.hf import HFEngine
from hieragent.engines.kv import _grouped, grouped_attention
from hieragent.engines.prompting import Dialogue, Prompter


def pair(lm, tokenizer, keep_free=4):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    return (HFEngine(lm, pad, eos, EngineSettings(prefix_cache=True, cache_prompts=keep_free)),
            HFEngine(lm, pad, eos, EngineSettings(prefix_cache=False)))


def cands(tokenizer):
    eos = tokenizer.eos_token_id
    return [[eos]] + [list(tokenizer.encode(t, add_special_tokens=False)) + [eos]
                      for t in ("turn left", "go forward", "pick up the key")]


def assert_same(got, want):
    for row_got, row_want in zip(got, want):
        for a, b in zip(row_got, row_want):
            torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1e-6)


def test_rows_out_of_slot_order_and_subsets_match_whole_prompts(tiny_lm, tokenizer):
    lm = tiny_lm.double()
    cached, plain = pair(lm, tokenizer)
    prompter = Prompter(tokenizer, history=3)
    dialogues = {e: Dialogue() for e in range(4)}
    options = cands(tokenizer)
    for turn, order in enumerate([[0, 1, 2, 3], [2, 0], [3, 1, 0], [1, 3], [0, 1, 2, 3]]):
        built = {e: prompter.prompt("executor", f"Subgoal: go to key {e}\nturn {turn}, wall {e + turn}", None,
                                    dialogues[e]) for e in order}
        requests = [Request(built[e][0], "executor", episode=e) for e in order]
        assert_same(cached.score(requests, [options] * len(order)), plain.score(requests, [options] * len(order)))
        for e in order:
            prompter.remember(dialogues[e], built[e][1], options[(e + turn) % len(options)])
    arena = cached._arenas["executor", 0]
    assert arena.slots == 4  # one per live episode, however the calls ordered them
    assert cached.stats.reused > cached.stats.computed


def test_new_episodes_reuse_a_free_slot_or_copy_a_live_prefix(tiny_lm, tokenizer):
    lm = tiny_lm.double()
    cached, plain = pair(lm, tokenizer)
    prompter = Prompter(tokenizer)
    options = cands(tokenizer)

    def prompt(e):
        return prompter.prompt("executor", f"Subgoal: open the door\nYou see door {e}.", None)[0]

    for rnd in range(6):  # two episodes at a time, ended after one turn each
        requests = [Request(prompt(10 * rnd + i), "executor", episode=10 * rnd + i) for i in range(2)]
        assert_same(cached.score(requests, [options] * 2), plain.score(requests, [options] * 2))
        cached.end_episodes([r.episode for r in requests])
    arena = cached._arenas["executor", 0]
    assert arena.slots == 2 and arena.copied == 0  # free slots taken over, with the prefix they hold
    system = len(prompter.system_ids("executor", None))
    assert cached.stats.reused >= 10 * system
    live = Request(prompt(100), "executor", episode=100)
    cached.score([live], [options])
    cached.score([Request(prompt(101), "executor", episode=101)], [options])  # episode 100 is live
    newcomer = Request(prompt(102), "executor", episode=102)
    assert_same(cached.score([newcomer, live], [options] * 2), plain.score([newcomer, live], [options] * 2))
    assert arena.copied > 0  # a prefix of a live slot was copied into a fresh one


def test_generate_reuses_its_own_completion_on_the_next_turn(tiny_lm, tokenizer):
    lm = tiny_lm.double()
    cached, plain = pair(lm, tokenizer)
    prompter = Prompter(tokenizer, history=4)
    dialogues = {e: Dialogue() for e in range(3)}
    sampling = Sampling(temperature=0.8, max_new_tokens=5)
    previous = {}
    for turn in range(4):
        built = {e: prompter.prompt("planner", f"Mission: find ball {e}\nturn {turn}", None, dialogues[e])
                 for e in range(3)}
        requests = [Request(built[e][0], "planner", e, sampling) for e in range(3)]
        before = cached.stats.reused
        got = cached.generate(requests, torch.Generator().manual_seed(turn))
        want = plain.generate(requests, torch.Generator().manual_seed(turn))
        assert [g.ids for g in got] == [w.ids for w in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-6)
        if turn:  # the previous prompt and every token of the reply it fed back were kept
            assert cached.stats.reused - before >= sum(len(p) + len(g.ids) - 1 for p, g in previous.values())
        previous = {}
        for e, g in enumerate(got):
            previous[e] = (built[e][0], g)
            prompter.remember(dialogues[e], built[e][1], g.ids)


@pytest.mark.parametrize("layout", ["native", "stacked", "causal"])
def test_grouped_attention_equals_attention_with_repeated_keys_in_float64(layout):
    """Each layout ``_grouped`` takes (SDPA's own GQA under a mask, the query heads stacked
    under a mask as off the CPU, and SDPA's causal flag where transformers drops the mask)
    against attention written out with every KV head repeated per query head."""
    g = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, dim = 2, 6, 2, 8
    q_len, k_len = (7, 7) if layout == "causal" else (5, 9)
    q = torch.randn(batch, heads, q_len, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, k_len, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, k_len, dim, generator=g, dtype=torch.float64)
    if layout == "causal":
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril().expand(batch, 1, q_len, k_len)
        out, _ = grouped_attention(None, q, k, v, None, scaling=0.3)  # [B, Q, H, D]
    else:
        mask = torch.rand(batch, 1, q_len, k_len, generator=g) > 0.4
        mask[..., 0] = True
        out, _ = _grouped(q, k, v, mask, 0.0, 0.3, native=layout == "native")
    group = heads // kv_heads
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # head h reads KV head h // group
    scores = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    want = (torch.softmax(scores, -1) @ vr).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_sleep_hands_the_arenas_back_and_acting_resumes_unchanged(tiny_lm, tokenizer):
    lm = tiny_lm.double()
    cached, plain = pair(lm, tokenizer)
    prompter = Prompter(tokenizer)
    requests = [Request(prompter.prompt("executor", f"Subgoal: explore\nwall {e}", None)[0], "executor", episode=e)
                for e in range(2)]
    options = cands(tokenizer)
    first = cached.score(requests, [options] * 2)
    assert cached._arenas["executor", 0].keys[0].numel() > 0
    cached.sleep()
    assert cached._arenas == {}  # nothing held while the trainer updates
    cached.wake()
    assert_same(cached.score(requests, [options] * 2), first)
    assert_same(first, plain.score(requests, [options] * 2))
