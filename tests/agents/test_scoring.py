"""Cached, padded scoring equals plain unpadded forward passes."""

import pytest
import torch
from transformers import LlamaForCausalLM

from hieragent.agents.scoring import candidate_logprobs, continuation_logprobs
from hieragent.engines.kv import GROUPED
from hieragent.models.loading import load_causal_lm, tiny_config


def direct(lm, prompt, cont):
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + cont])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[len(prompt) - 1 + j, tok] for j, tok in enumerate(cont)])


def test_prefix_cached_scoring_matches_one_sequence_at_a_time(tiny_lm, tokenizer):
    g = torch.Generator().manual_seed(1)
    V = len(tokenizer)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 2, 5)]
    conts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 1, 4, 2, 6)]
    rows = [0, 0, 1, 2, 2]
    with torch.no_grad():
        got = continuation_logprobs(tiny_lm, prompts, conts, rows, tokenizer.pad_token_id)
    for c, r, g_lp in zip(conts, rows, got):
        torch.testing.assert_close(g_lp, direct(tiny_lm, prompts[r], c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_candidate_softmax_matches_direct_scores(tiny_lm, tokenizer, reduction):
    prompts = [[5, 6, 7, 8], [9, 10]]
    cands = [[[11, 12], [13], [14, 15, 16]], [[17], [18, 19]]]
    with torch.no_grad():
        got = candidate_logprobs(tiny_lm, prompts, cands, tokenizer.pad_token_id, 0.7, reduction)
    for p, cs, lp in zip(prompts, cands, got):
        scores = torch.stack([getattr(direct(tiny_lm, p, c).double(), reduction)() for c in cs])
        want = torch.log_softmax(scores / 0.7, -1)
        torch.testing.assert_close(lp.double(), want, rtol=1e-5, atol=1e-5)
        assert lp.exp().sum().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("lengths", [(6, 6), (9, 3)], ids=["unpadded", "left-padded"])
def test_grouped_attention_gives_sdpas_scores_and_gradients_in_float64(tokenizer, lengths):
    """The trainer's forwards run ``grouped_attention`` (``load_causal_lm``): the same
    log-probabilities and gradients as transformers' SDPA, with padding (a mask) and without
    (no mask: SDPA's causal flag)."""
    torch.manual_seed(3)
    lm = LlamaForCausalLM(tiny_config(len(tokenizer))).double()
    g = torch.Generator().manual_seed(4)
    V = len(tokenizer)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    cands = [[torch.randint(0, V, (k,), generator=g).tolist() for k in ks] for ks in ((2, 1, 3), (4, 2))]
    weights = [torch.randn(len(c), generator=g, dtype=torch.float64) for c in cands]

    def run(impl):
        lm.config._attn_implementation = impl
        lm.zero_grad()
        lps = candidate_logprobs(lm, prompts, cands, tokenizer.pad_token_id, 0.7)
        sum((lp.double() * w).sum() for lp, w in zip(lps, weights)).backward()
        return [lp.detach() for lp in lps], {n: p.grad.clone() for n, p in lm.named_parameters()}

    want_lp, want_grad = run("sdpa")
    got_lp, got_grad = run(GROUPED)
    for got, want in zip(got_lp, want_lp):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-10, atol=1e-10)
    assert any(grad.abs().max() > 0 for grad in want_grad.values())
    for name, want in want_grad.items():
        torch.testing.assert_close(got_grad[name], want, rtol=1e-8, atol=1e-10, msg=name)


def test_loaded_models_run_grouped_attention():
    assert load_causal_lm("tiny").config._attn_implementation == GROUPED
