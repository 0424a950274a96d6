"""Log-probabilities of continuations given prompts, with the prompt's KV cache shared.

Used in both directions of the data flow: at rollout time (no grad) to score candidate
actions, and at training time (with grad) to recompute the same numbers under the
current weights. One code path for both is what keeps behaviour and training
log-probabilities comparable.

Prompts are left-padded so that each prompt's last token sits at the same position; the
prompt is run once, its cache is repeated for every continuation of that prompt, and the
continuations (right-padded) are run on top with explicit position ids. Where the model
allows (``agents.head.plain_head``), the continuations' hidden states go through the output
head a block of rows at a time, and no row of vocabulary logits outlives its block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hieragent.agents.head import head_logprobs, plain_head


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Return ``ids [B, P]`` and ``mask [B, P]`` with every sequence right-aligned."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, device=device)
            mask[i, width - len(s):] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Return ``ids [M, L]`` and ``mask [M, L]`` with every sequence left-aligned."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, device=device)
            mask[i, : len(s)] = 1
    return ids, mask


def token_logprobs(logits: Tensor, ids: Tensor, temperature: float = 1.0, rows: Tensor | None = None) -> Tensor:
    """``log softmax(logits / temperature)[ids]``: the log-probability of each token under the
    distribution it was (or would be) sampled from. ``logits [..., V]``, ``ids [...]`` -> ``[...]``

    Generation and the trainer's recomputation both call this, so the behaviour and the
    current log-probs of a turn agree at any temperature. With ``rows [M]`` (``logits [B, V]``,
    ``ids [M]``), token ``j`` is scored on row ``rows[j]``, each row normalised once.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # logit minus logsumexp, as head_logprobs computes it, so both ways of scoring round alike
    if rows is not None:
        return logits[rows, ids] - torch.logsumexp(logits, dim=-1)[rows]
    return logits.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@dataclass
class PromptPass:
    """The prompts' forward: the logits after each prompt's last token, and its KV cache.

    Attributes:
        last_logits: ``[B, V]`` logits at each prompt's last position.
        cache: The KV cache over ``mask``'s positions (a transformers ``Cache``).
        mask: ``[B, W]`` 1 where the cache holds a prompt token, 0 for padding.
        lengths: ``[B]`` prompt lengths (the position of the next token).
    """

    last_logits: Tensor
    cache: object
    mask: Tensor
    lengths: Tensor


def prompt_pass(model: torch.nn.Module, prompts: list[list[int]], pad_id: int) -> PromptPass:
    """Run ``prompts`` (each non-empty), left-padded, through ``model`` and keep the cache.

    Positions count real tokens only, so a row's numbers do not depend on its neighbours'
    lengths.
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)  # [B, P]
    lengths = torch.tensor([len(s) for s in prompts], dtype=torch.long, device=device)  # [B]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    return PromptPass(out.logits[:, -1], out.cache, mask, lengths)


def continuation_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    continuations: list[list[int]],
    rows: list[int],
    pad_id: int,
    temperature: float = 1.0,
    prompt: PromptPass | None = None,
) -> list[Tensor]:
    """Per-token log-probabilities of each continuation after its prompt.

    Args:
        model: A causal LM (PEFT-wrapped or not) returning ``logits`` and a cache.
        prompts: ``B`` prompts as token ids, each non-empty.
        continuations: ``M`` continuations as token ids, each non-empty.
        rows: ``M`` indices into ``prompts``: the prompt each continuation follows.
        pad_id: Token id used for padding (never attended to).
        temperature: The sampling temperature of the continuations (``token_logprobs``).
        prompt: The prompts' forward, if the caller ran it (the engine, with its prefix
            cache); else it is run here. Its cache is consumed.

    Returns:
        ``M`` tensors; the j-th has ``len(continuations[j])`` float32 entries.
    """
    device = next(model.parameters()).device
    if prompt is None:
        prompt = prompt_pass(model, prompts, pad_id)
    row_idx = torch.tensor(rows, dtype=torch.long, device=device)  # [M]
    cont_ids, cont_mask = right_pad(continuations, pad_id, device)  # [M, L]
    width = cont_ids.shape[1]
    # token 0 is predicted by the prompt's last position, token j by continuation j-1
    tok0 = token_logprobs(prompt.last_logits, cont_ids[:, 0], temperature, rows=row_idx)  # [M]
    if width == 1:  # every continuation is one token: the prompts' pass predicted them all
        return [tok0[j:j + 1] for j in range(len(continuations))]

    cache = prompt.cache
    cache.reorder_cache(row_idx)
    cont_pos = prompt.lengths[row_idx][:, None] + torch.arange(width, device=device)  # [M, L]
    full_mask = torch.cat([prompt.mask[row_idx], cont_mask], dim=1)  # [M, W + L]
    inputs = dict(input_ids=cont_ids[:, :-1], attention_mask=full_mask[:, :-1], position_ids=cont_pos[:, :-1],
                  cache=cache, use_cache=True)  # the last position predicts nothing we score
    head = plain_head(model)
    if head is None:
        logits = model(**inputs).logits  # [M, L-1, V]
        tok_rest = token_logprobs(logits, cont_ids[:, 1:], temperature)  # [M, L-1]
    else:
        hidden = model.get_decoder()(**inputs).last_hidden_state  # [M, L-1, H]
        tok_rest = head_logprobs(hidden, head.weight, cont_ids[:, 1:], temperature)  # [M, L-1]
    per_token = torch.cat([tok0[:, None], tok_rest], dim=1)  # [M, L]
    return [per_token[j, : len(c)] for j, c in enumerate(continuations)]


def candidate_softmax(per_token: list[Tensor], counts: list[int], temperature: float = 1.0,
                      reduction: str = "sum") -> list[Tensor]:
    """Candidate scores (summed or mean token log-probs) -> log softmax(score / temperature),
    per prompt; ``counts[i]`` of the flat ``per_token`` belong to prompt ``i``."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"score reduction must be 'sum' or 'mean', got {reduction!r}")
    scores = torch.stack([t.sum() if reduction == "sum" else t.mean() for t in per_token])  # [M]
    out, start = [], 0
    for n in counts:
        out.append(F.log_softmax(scores[start:start + n] / temperature, dim=-1))
        start += n
    return out


def candidate_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    candidates: list[list[list[int]]],
    pad_id: int,
    temperature: float = 1.0,
    reduction: str = "sum",
) -> list[Tensor]:
    """The candidate softmax of ``score`` mode (GLAM, arXiv 2302.02662).

    Each candidate's score is its summed (``reduction="sum"``, as in GLAM) or mean
    (``"mean"``) token log-probability after the prompt; the policy is
    ``softmax(score / temperature)`` over the prompt's candidates. The sum favours short
    candidates by about one token's log-probability per token of difference; for a
    randomly initialised model that is ~log(vocab) per token, so such a model starts
    near-deterministic under ``sum`` and near-uniform under ``mean``.

    Returns:
        ``B`` tensors of log-probabilities, the i-th of length ``len(candidates[i])``.
    """
    flat = [c for cands in candidates for c in cands]
    rows = [i for i, cands in enumerate(candidates) for _ in cands]
    per_token = continuation_logprobs(model, prompts, flat, rows, pad_id)
    return candidate_softmax(per_token, [len(c) for c in candidates], temperature, reduction)
