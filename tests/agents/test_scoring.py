"""Cached, padded scoring equals plain unpadded forward passes."""

import pytest
import torch

from hieragent.agents.scoring import candidate_logprobs, continuation_logprobs


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
