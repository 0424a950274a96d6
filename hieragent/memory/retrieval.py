"""Stochastic memory retrieval as part of the planner's RL turn, and its log-probability.

The planner's retrieval is an action: FAISS proposes the top-n entries for the adapted query,
and k of them are drawn without replacement from a Plackett–Luce model over those n,

    s_i = <A(q), key_i> / T                                     A = QueryAdapter
    log P(c_1..c_k) = sum_j [ s_{c_j} - log sum_{i not in {c_1..c_{j-1}}} exp s_i ]

(sequential softmax draws renormalised over what remains; Plackett 1975, Luce 1959; the same
distribution as Gumbel-top-k, arXiv:1903.06059). The query and candidate keys are recorded
in a ``Retrieval`` so that ``retrieval_logprob`` can recompute this term differentiably for
the importance ratio after the adapter has moved, without touching the bank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hieragent.memory.adapter import QueryAdapter
from hieragent.memory.bank import MemoryBank
from hieragent.sampling import Randomness, draw
from hieragent.types import Retrieval


def plackett_luce_logprob(logits: torch.Tensor, chosen: torch.Tensor, chosen_mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of ordered draws without replacement from softmax(logits).

    Args:
        logits: ``[B, N]``; ``-inf`` marks padding (not a candidate).
        chosen: ``[B, K]`` long, candidate positions in draw order; padding may hold any valid index.
        chosen_mask: ``[B, K]`` bool, True where ``chosen`` is a real draw.
    Returns:
        ``[B]`` summed log-probabilities.
    """
    n = logits.shape[-1]
    drawn = F.one_hot(chosen, n) & chosen_mask[..., None]  # [B, K, N]
    removed_before = (drawn.cumsum(1) - drawn).bool()  # [B, K, N], drawn at steps < j
    remaining = logits[:, None, :].masked_fill(removed_before, float("-inf"))  # [B, K, N]
    log_norm = torch.logsumexp(remaining, dim=-1)  # [B, K]
    picked = logits.gather(1, chosen)  # [B, K]
    # Padded steps see every candidate, so log_norm stays finite and gradients stay clean.
    return torch.where(chosen_mask, picked - log_norm, torch.zeros_like(picked)).sum(1)  # [B]


def _adapt(adapter: QueryAdapter | None, q: torch.Tensor) -> torch.Tensor:
    """Adapted unit queries; ``None`` is the identity (retrieval learning off)."""
    return F.normalize(q, dim=-1) if adapter is None else adapter(q)


def retrieval_logprob(adapter: QueryAdapter | None, retrievals: Sequence[Retrieval]) -> torch.Tensor:
    """Recompute ``log P(chosen)`` of each recorded retrieval under ``adapter``: ``[B]``.

    Differentiable w.r.t. the adapter's parameters; equals ``old_logprob`` while the adapter
    is unchanged. Retrievals may have different N (and k); padding is masked with ``-inf``.
    """
    param = next(adapter.parameters()) if adapter is not None else None
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    if not retrievals:
        return torch.zeros(0, device=device, dtype=dtype)
    if any(r is None for r in retrievals):
        raise ValueError("retrieval_logprob got None; keep only turns whose retrieval is not None")
    b, d = len(retrievals), len(retrievals[0].query)
    n = max(len(r.keys) for r in retrievals)
    k = max(len(r.chosen) for r in retrievals)
    keys = np.zeros((b, n, d), dtype=np.float32)  # [B, N, D]
    key_mask = torch.zeros(b, n, dtype=torch.bool)  # [B, N]
    chosen = torch.zeros(b, k, dtype=torch.long)  # [B, K]
    chosen_mask = torch.zeros(b, k, dtype=torch.bool)  # [B, K]
    for i, r in enumerate(retrievals):
        if len(r.query) != d or (len(r.keys) and r.keys.shape[1] != d):
            raise ValueError(f"retrieval {i} has dim {len(r.query)}, others {d}")
        if len(set(r.chosen)) != len(r.chosen) or any(not 0 <= c < len(r.keys) for c in r.chosen):
            raise ValueError(f"retrieval {i} has invalid chosen {r.chosen} for {len(r.keys)} candidates")
        keys[i, : len(r.keys)] = r.keys
        key_mask[i, : len(r.keys)] = True
        chosen[i, : len(r.chosen)] = torch.tensor(r.chosen, dtype=torch.long)
        chosen_mask[i, : len(r.chosen)] = True
    queries = torch.from_numpy(np.stack([r.query for r in retrievals])).to(dtype)  # [B, D]
    temps = torch.tensor([r.temperature for r in retrievals], dtype=dtype)  # [B]
    return _logprob(adapter, queries, torch.from_numpy(keys).to(dtype), key_mask, chosen, chosen_mask, temps)


def _logprob(adapter: QueryAdapter | None, queries: torch.Tensor, keys: torch.Tensor, key_mask: torch.Tensor,
             chosen: torch.Tensor, chosen_mask: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """``retrieval_logprob`` on tensors: ``queries [B, D]``, ``keys [B, N, D]``, ``key_mask [B, N]``,
    ``chosen``/``chosen_mask [B, K]``, ``temps [B]``; moved to the adapter's device."""
    param = next(adapter.parameters()) if adapter is not None else None
    device = param.device if param is not None else torch.device("cpu")
    q = _adapt(adapter, queries.to(device))  # [B, D]
    sims = torch.einsum("bd,bnd->bn", q, keys.to(device))  # [B, N]
    logits = (sims / temps.to(device)[:, None]).masked_fill(~key_mask.to(device), float("-inf"))  # [B, N]
    return plackett_luce_logprob(logits, chosen.to(device), chosen_mask.to(device))


def contrastive_loss(adapter: QueryAdapter, retrievals: Sequence[Retrieval], positives: torch.Tensor,
                     temperature: float, same_above: float = 0.95) -> torch.Tensor:
    """InfoNCE of adapted queries toward the keys of skills that worked, mean over ``B``.

    For retrieval ``b`` with candidate keys ``k_1..k_N`` and positive key ``p_b`` (the skill
    its successful episode was distilled into),

        L_b = -log [ exp(<A(q_b), p_b>/T) / (exp(<A(q_b), p_b>/T) + sum_i exp(<A(q_b), k_i>/T)) ]

    where candidates with ``<k_i, p_b> >= same_above`` are left out: they are the positive
    itself (or a near-duplicate merged into it), not a negative.

    Args:
        retrievals: ``B`` recorded retrievals (query and candidate keys).
        positives: ``[B, D]`` unit keys.
    """
    if len(retrievals) != len(positives):
        raise ValueError(f"contrastive_loss got {len(retrievals)} retrievals and {len(positives)} positives")
    param = next(adapter.parameters())
    losses = []
    for r, p in zip(retrievals, positives.to(param)):
        q = adapter(torch.from_numpy(r.query)[None].to(param))[0]  # [D]
        keys = torch.from_numpy(r.keys).to(param)  # [N, D]
        negatives = keys[keys @ p < same_above]  # [N', D]
        logits = torch.cat([(q @ p)[None], negatives @ q]) / temperature  # [1 + N']
        losses.append(torch.logsumexp(logits, 0) - logits[0])
    return torch.stack(losses).mean() if losses else torch.zeros((), dtype=param.dtype, device=param.device)


def sample_retrievals(
    bank: MemoryBank,
    adapter: QueryAdapter | None,
    queries: Sequence[str] | np.ndarray,
    n: int,
    k: int,
    temperature: float,
    generator: Randomness = None,
    greedy: bool = False,
) -> list[tuple[list[str], Retrieval | None]]:
    """Retrieve for many queries at once (one encoder call): per query ``(texts, Retrieval)``.

    Args:
        queries: Query texts, or frozen encoder embeddings ``[B, D]``.
        n: FAISS candidates per query (the support of the choice).
        k: Entries chosen per query, drawn in order without replacement; capped at the bank size.
        temperature: Softmax temperature over adapted cosine similarities.
        generator: CPU generator for reproducible draws, or one per query
            (``hieragent.sampling``); ``None`` uses torch's global RNG.
        greedy: Take the top-k by adapted similarity (evaluation, or retrieval learning off);
            ``old_logprob`` is still the Plackett–Luce log-probability of that order.
    Returns:
        One ``(chosen texts in draw order, Retrieval)`` per query; ``([], None)`` for an empty bank.
    """
    started = time.perf_counter()
    if n < 1 or k < 1 or k > n:
        raise ValueError(f"retrieval needs 1 <= k <= n, got n={n}, k={k}")
    if temperature <= 0:
        raise ValueError(f"retrieval temperature must be > 0, got {temperature}")
    num = len(queries)
    if len(bank) == 0 or num == 0:
        return [([], None) for _ in range(num)]
    if isinstance(queries, np.ndarray):
        frozen = np.array(queries, dtype=np.float32, order="C")  # [B, D], a copy: retrievals keep rows of it
    else:
        if any(not isinstance(q, str) for q in queries):
            raise TypeError("queries must be a list of strings or an array [B, D] of embeddings")
        frozen = bank.embed(list(queries))  # [B, D]
    with torch.no_grad():
        adapted = _adapt(adapter, torch.from_numpy(frozen)).float().cpu()  # [B, D]
    ids, _, keys = bank.search_with_keys(adapted.numpy(), n)  # [B, N], [B, N, D]
    n_eff, k_eff = ids.shape[1], min(k, ids.shape[1])
    logits = torch.einsum("bd,bnd->bn", adapted, torch.from_numpy(keys)) / temperature  # [B, N]
    if greedy:
        chosen = logits.topk(k_eff, dim=1).indices  # [B, k]
    else:
        remaining = logits.clone()
        draws = []
        for _ in range(k_eff):  # sequential Plackett–Luce draws, renormalised over what is left
            pick = draw(torch.softmax(remaining, dim=1), generator)[:, None]  # [B, 1]
            remaining.scatter_(1, pick, float("-inf"))
            draws.append(pick)
        chosen = torch.cat(draws, dim=1)  # [B, k]
    retrievals = [
        Retrieval(
            query=frozen[b],
            keys=keys[b],
            entry_ids=ids[b].tolist(),
            chosen=chosen[b].tolist(),
            old_logprob=0.0,
            temperature=float(temperature),
        )
        for b in range(num)
    ]
    with torch.no_grad():  # the computation training repeats, on the same values: the ratio starts at 1
        dtype = next(adapter.parameters()).dtype if adapter is not None else torch.float32
        old = _logprob(adapter, torch.from_numpy(frozen).to(dtype), torch.from_numpy(keys).to(dtype),
                       torch.ones(num, n_eff, dtype=torch.bool), chosen, torch.ones_like(chosen, dtype=torch.bool),
                       torch.full((num,), float(temperature), dtype=dtype)).double().cpu().tolist()
    for r, lp in zip(retrievals, old):
        r.old_logprob = lp
    bank.record_latency(num, time.perf_counter() - started)
    texts = bank.texts([r.entry_ids[c] for r in retrievals for c in r.chosen])  # k_eff per retrieval
    return [(texts[b * k_eff:(b + 1) * k_eff], r) for b, r in enumerate(retrievals)]


def sample_retrieval(
    bank: MemoryBank,
    adapter: QueryAdapter | None,
    query_text_or_vec: str | np.ndarray | Sequence[float],
    n: int,
    k: int,
    temperature: float,
    generator: Randomness = None,
    greedy: bool = False,
) -> tuple[list[str], Retrieval | None]:
    """One query's retrieval; see ``sample_retrievals``."""
    if isinstance(query_text_or_vec, str):
        queries: Sequence[str] | np.ndarray = [query_text_or_vec]
    else:
        queries = np.asarray(query_text_or_vec, dtype=np.float32).reshape(1, -1)
    return sample_retrievals(bank, adapter, queries, n, k, temperature, generator, greedy)[0]
