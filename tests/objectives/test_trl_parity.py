"""Our clipped loss equals TRL's GRPOTrainer loss on the same model, tokens and advantages.

TRL computes the completion log-probabilities itself (its fused LM head, with temperature)
inside ``GRPOTrainer.compute_loss``; we compute them from the same model with a plain
forward pass and feed them, with the same old/reference log-probabilities, advantages and
completion mask, to ``hieragent.objectives.losses``. Nothing of TRL's math is mocked.

TRL's ``loss_type`` against our aggregation (one completion = one sequence):
  * ``grpo``: mean over completions of the token-mean = ``seq-mean-token-mean``;
  * ``bnpo`` (local batch) and ``dapo`` (``num_items_in_batch``) = ``token-mean``;
  * ``dr_grpo``: sum / (B * max_completion_length) = ``seq-mean-token-sum`` / max_completion_length.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
try:  # a test dependency: parity must fail, not skip, where it is missing
    import trl
except ImportError as err:  # pragma: no cover - only without the test extra
    raise ImportError("TRL parity needs trl, a test dependency: pip install -e '.[test]'") from err

from datasets import Dataset  # noqa: E402  (a TRL dependency)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from hieragent.objectives.losses import (  # noqa: E402
    aggregate,
    aggregation_weights,
    clipped_policy_loss,
    kl_penalty,
)

VOCAB = 64
PROMPT = 3
LENGTHS = [6, 2, 4, 1, 5, 3]  # completion tokens per row (TRL pads completions on the right)
MAX_COMPLETION = 8  # dr_grpo's constant; larger than the batch's padded width on purpose
TEMPERATURE = 0.7
EPS_LOW, EPS_HIGH = 0.1, 0.3
MODES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
         "dr_grpo": "seq-mean-token-sum"}


@pytest.fixture(autouse=True)
def one_thread():
    """The matrices are tiny: thread hand-offs cost more than the math (40x on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def word_tokenizer():
    """A word-level tokenizer built in memory: GRPOTrainer needs pad and eos tokens, and
    ``compute_loss`` never tokenizes, so no hub tokenizer (nor SmolLM2's) is needed."""
    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def make_trainer(tmp_path, loss_type, level, beta=0.0, bias_correction_kl=False):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         initializer_range=0.25)
    model = LlamaForCausalLM(config)
    if beta:
        # with beta > 0 TRL builds its reference model from the policy's path: give it a local one
        model.save_pretrained(tmp_path / "policy")
        model = str(tmp_path / "policy")
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(LENGTHS), num_generations=2,
        max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE, epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH, beta=beta, use_bias_correction_kl=bias_correction_kl, loss_type=loss_type,
        importance_sampling_level=level, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
    )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * len(LENGTHS)}),
        processing_class=word_tokenizer(),
    )
    # eval mode: TRL then divides by neither gradient-accumulation steps nor steps per generation
    trainer.model.eval()
    return trainer


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    prompt_ids = torch.randint(2, VOCAB, (B, PROMPT), generator=g)
    completion_ids = torch.randint(2, VOCAB, (B, T), generator=g).masked_fill(mask == 0, 0)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": mask.long(),
        "advantages": torch.randn(B, generator=g),
    }, g


def our_logprobs(model, inputs):
    """Completion log-probs at TRL's temperature, from a plain forward pass. ``[B, T]``"""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, PROMPT - 1 : -1] / TEMPERATURE
    return torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]


def add_old_and_ref(model, inputs, g):
    """Behaviour and reference log-probs a few tenths of a nat away, zero on padding like TRL's."""
    mask = inputs["completion_mask"].float()
    with torch.no_grad():
        lp = our_logprobs(model, inputs)
    inputs["old_per_token_logps"] = (lp + 0.5 * torch.randn(lp.shape, generator=g)) * mask
    inputs["ref_per_token_logps"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask
    inputs["num_items_in_batch"] = mask.sum()  # dapo's global token count


def our_loss(model, inputs, loss_type, level, beta, bias_correction_kl, weights):
    mask = inputs["completion_mask"].float()
    lp = our_logprobs(model, inputs)
    # our side may see garbage padding; TRL's may not (it multiplies by the mask)
    old = torch.where(mask > 0, inputs["old_per_token_logps"], float("nan"))
    terms = clipped_policy_loss(lp, old, inputs["advantages"], mask, EPS_LOW, EPS_HIGH, level)
    per_token = terms.per_token
    if beta:
        kl = kl_penalty(lp, inputs["ref_per_token_logps"], mask, "k3")
        per_token = per_token + beta * (kl * terms.ratio if bias_correction_kl else kl)
    loss = aggregate(per_token, weights)
    return loss / MAX_COMPLETION if loss_type == "dr_grpo" else loss, terms


def grads(model, loss):
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


CASES = [(loss, level, 0.0, False) for loss in MODES for level in ("token", "sequence")]
CASES += [("grpo", "token", 0.05, False), ("dapo", "token", 0.05, True), ("grpo", "sequence", 0.05, True)]


@pytest.mark.parametrize("loss_type,level,beta,bias_correction_kl", CASES)
def test_loss_and_gradient_equal_trl_grpo(tmp_path, loss_type, level, beta, bias_correction_kl):
    trainer = make_trainer(tmp_path, loss_type, level, beta, bias_correction_kl)
    model = trainer.model
    inputs, g = batch()
    add_old_and_ref(model, inputs, g)
    weights = aggregation_weights(inputs["completion_mask"].sum(-1), None, MODES[loss_type])

    theirs = trainer.compute_loss(model, dict(inputs))
    their_grads = grads(model, theirs)
    ours, terms = our_loss(model, inputs, loss_type, level, beta, bias_correction_kl, weights)
    our_grads = grads(model, ours)

    assert terms.clipped.any() and not terms.clipped.all()  # both branches of the clip are used
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6, rel=1e-5)
    assert len(our_grads) == len(their_grads) > 0
    for a, b in zip(our_grads, their_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_dapo_micro_batches_sum_to_our_whole_batch_token_mean(tmp_path, level):
    """TRL's dapo divides every micro-batch by the global token count, as our weights do."""
    trainer = make_trainer(tmp_path, "dapo", level)
    model = trainer.model
    inputs, g = batch(seed=1)
    add_old_and_ref(model, inputs, g)
    weights = aggregation_weights(inputs["completion_mask"].sum(-1), None, "token-mean")
    ours, _ = our_loss(model, inputs, "dapo", level, 0.0, False, weights)
    theirs = 0.0
    for rows in (slice(0, 2), slice(2, None)):
        chunk = {k: v if k == "num_items_in_batch" else v[rows] for k, v in inputs.items()}
        theirs = theirs + trainer.compute_loss(model, chunk)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6, rel=1e-5)
