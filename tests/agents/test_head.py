"""The blocked output head gives the log-probabilities and gradients of the full logits."""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

from hieragent.agents import head
from hieragent.agents.head import full_logits, head_logprobs, plain_head
from hieragent.agents.scoring import continuation_logprobs
from hieragent.models.loading import tiny_config
from hieragent.models.lora import LoraSettings, add_adapters


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_hidden_gradient_match_float64_over_several_blocks(monkeypatch, temperature):
    monkeypatch.setattr(head, "BLOCK_BYTES", 16 * 4 * 3000)  # 16 rows a block: 35 rows make 3 blocks
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(5, 7, 12, generator=g)
    weight = torch.randn(3000, 12, generator=g) / 12 ** 0.5
    ids = torch.randint(0, 3000, (5, 7), generator=g)
    upstream = torch.randn(5, 7, generator=g, dtype=torch.float64)

    h64 = hidden.double().requires_grad_()
    want = torch.log_softmax(h64 @ weight.double().T / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
    (want * upstream).sum().backward()

    h32 = hidden.clone().requires_grad_()
    got = head_logprobs(h32, weight, ids, temperature)
    (got.double() * upstream).sum().backward()
    assert got.dtype == torch.float32 and got.shape == ids.shape
    torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    assert h64.grad.abs().max() > 1e-2  # the gradient checked is not near zero

    with torch.no_grad():  # no backward wanted: the same numbers
        torch.testing.assert_close(head_logprobs(hidden, weight, ids, temperature), got.detach(), rtol=0, atol=0)


def test_the_head_stands_in_only_where_the_logits_are_a_frozen_plain_linear(tokenizer):
    llama = LlamaForCausalLM(tiny_config(len(tokenizer)))
    assert plain_head(llama) is None  # its head trains: the blocked path has no weight gradient
    adapted = add_adapters(llama, ["planner"], LoraSettings())
    assert plain_head(adapted) is adapted.get_output_embeddings()
    with full_logits():
        assert plain_head(adapted) is None
    assert plain_head(adapted) is not None
    on_head = add_adapters(LlamaForCausalLM(tiny_config(len(tokenizer))), ["planner"],
                           LoraSettings(target_modules=["q_proj", "lm_head"]))
    assert plain_head(on_head) is None  # a LoRA head is not an nn.Linear
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    gemma.requires_grad_(False)
    assert plain_head(gemma) is None  # soft-capped logits


@pytest.mark.parametrize("lengths", [(3, 1, 4, 2), (1, 1, 1, 1)], ids=["several-tokens", "one-token-each"])
def test_scoring_through_the_blocked_head_equals_full_logits_with_gradients(tiny_lm, tokenizer, lengths):
    g = torch.Generator().manual_seed(5)
    V = len(tokenizer)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (6, 3)]
    conts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    rows = [0, 1, 1, 0]
    weights = [torch.randn(n, generator=g) for n in lengths]
    trained = [p for p in tiny_lm.parameters() if p.requires_grad]

    def run():
        tiny_lm.zero_grad(set_to_none=True)
        lps = continuation_logprobs(tiny_lm, prompts, conts, rows, tokenizer.pad_token_id, temperature=0.8)
        sum((lp * w).sum() for lp, w in zip(lps, weights)).backward()
        return [lp.detach() for lp in lps], [p.grad for p in trained]

    assert plain_head(tiny_lm) is not None
    got_lp, got_grad = run()
    with full_logits():
        want_lp, want_grad = run()
    for got, want, c in zip(got_lp, want_lp, conts):
        assert got.shape == (len(c),)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert [w is None for w in want_grad] == [w is None for w in got_grad]
    assert any(w is not None and w.abs().max() > 0 for w in want_grad)
    # float32 sums in another order (and thread timing) move a gradient entry by a few 1e-6:
    # a wrong temperature, sign or row would move them by tens of percent
    for got, want in zip(got_grad, want_grad):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-5)
