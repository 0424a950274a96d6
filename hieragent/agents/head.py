"""Log-probabilities of chosen tokens through the output head, a block of rows at a time.

``log_softmax(hidden @ W.T / T)[ids]`` is what scoring and training need, one number per
position. Computed the plain way, every position first becomes a row of ``V`` logits
(49,152 for SmolLM2's vocabulary), then a row of log-probabilities, and the backward pass
makes two more such rows: gigabytes for a few thousand positions, which on a CPU are
allocated, faulted in and freed at every update. ``head_logprobs`` walks the positions in
blocks of about ``BLOCK_BYTES`` of logits and keeps, per position, only what the backward
pass needs (``block_rows``). With the head frozen (LoRA never adapts it unless asked), the
gradient with respect to a position's hidden state is

    d logp / d h = (W[id] - sum_v p_v W[v]) / T,    p = softmax(h @ W.T / T),

so the forward computes that ``[H]`` vector with the one extra matmul the plain backward
would run anyway, and the backward only scales it by the incoming gradient.

Used where ``plain_head`` finds the model's logits to be exactly ``lm_head(hidden)``: a
bias-free ``nn.Linear`` head that does not train, in a family whose causal-LM forward adds
nothing after it (no soft-capping or logit scale). Any other model takes the plain path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

BLOCK_BYTES = 8 << 20
# causal-LM families whose logits are lm_head(last hidden state) and nothing more
PLAIN_HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_blocks = [True]


@contextmanager
def full_logits() -> Iterator[None]:
    """Within it, scoring takes the plain path for every model (a baseline for the benchmark)."""
    _blocks.append(False)
    try:
        yield
    finally:
        _blocks.pop()


def plain_head(model: nn.Module) -> nn.Linear | None:
    """The model's output head if ``head_logprobs`` may stand in for its logits, else None."""
    config = getattr(model, "config", None)
    if not _blocks[-1] or getattr(config, "model_type", None) not in PLAIN_HEAD_FAMILIES:
        return None
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None or head.weight.requires_grad:
        return None  # a LoRA-adapted or trained head: its gradient is not computed here
    return head


def block_rows(vocab: int, width: int) -> int:
    """Rows per block: about ``BLOCK_BYTES`` of logits, and at least ``width`` (the hidden size)
    rows, so that reading the head's weight again for each block costs no more than the
    block's own logits (with 42 rows of SmolLM2's width 576, the two matmuls per block ran
    1.7x slower than the full logits; with 576 rows, 0.9x)."""
    return max(16, width, BLOCK_BYTES // (4 * vocab))


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, need_grad: bool) -> Tensor:
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        slope = torch.empty_like(hidden) if need_grad else hidden.new_empty(0)
        rows = block_rows(*weight.shape)
        for s in range(0, n, rows):
            h, idx = hidden[s:s + rows], ids[s:s + rows, None]
            logits = (h @ weight.T).float()  # [r, V]
            if temperature != 1.0:
                logits.div_(temperature)
            picked = logits.gather(-1, idx)  # [r, 1]
            top = logits.amax(-1, keepdim=True)  # [r, 1]
            total = logits.sub_(top).exp_().sum(-1, keepdim=True)  # the logits become exp(logit - top)
            out[s:s + rows] = (picked - top - total.log()).squeeze(-1)  # logit - logsumexp
            if need_grad:
                p = logits.div_(total).to(weight.dtype)  # the softmax
                slope[s:s + rows] = ((weight[idx.squeeze(-1)] - p @ weight) / temperature).to(hidden.dtype)
        ctx.save_for_backward(slope)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:
        (slope,) = ctx.saved_tensors
        return (grad[:, None] * slope).to(slope.dtype), None, None, None, None


def head_logprobs(hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(hidden @ weight.T / temperature)[ids]`` in float32, differentiable in
    ``hidden`` (not in ``weight``). ``hidden [..., H]``, ``weight [V, H]``, ``ids [...]`` -> ``[...]``."""
    shape = ids.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _HeadLogprobs.apply(flat, weight.detach(), ids.reshape(-1), float(temperature), need_grad).reshape(shape)
