"""The transformers engine (the default, CPU or GPU): batched scoring and sampling on the
trainer's own LM, with a KV cache of prompt prefixes.

The cache holds the keys and values of whole prompts computed before, per adapter and
version (a LoRA changes K and V, so nothing is shared across either). A new prompt runs
only the tokens after the longest prefix it shares with its episode's previous prompt or
with a recent prompt of another episode: the system text and the subgoal within an
episode, the whole history when ``rollout.history`` keeps it in the prompt. Prompts are
token ids built by appending (``engines.prompting``), never re-tokenised, so a prefix match
is exact. Numbers with and without the cache are equal up to float rounding
(``tests/engines/test_hf.py`` checks it in float64).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterator

import numpy as np
import torch
from torch import Tensor

from hieragent.agents.scoring import PromptPass, continuation_logprobs, prompt_pass, token_logprobs
from hieragent.engines.base import (Engine, EngineSettings, Generation, Request, check_continuations, finished,
                                   one_adapter, one_sampling, per_request)

KV = list[tuple[Tensor, Tensor]]  # per layer: keys, values [H, L, D]


@dataclass
class _Entry:
    ids: np.ndarray  # [L] the prompt's token ids
    kv: KV


@dataclass
class CacheStats:
    """Tokens the engine ran (``computed``) and took from the cache (``reused``), and the
    rows of logits it projected onto the vocabulary and used (``logit_rows``), summed."""

    computed: int = 0
    reused: int = 0
    logit_rows: int = 0
    calls: int = 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class HFEngine(Engine):
    """Acting on the trainer's transformers LM (PEFT adapters switched per batch).

    Args:
        lm: The causal LM (a PEFT model with the role adapters, or a plain model).
        pad_id: Padding token id.
        eos_id: End-of-turn token id: a completion stops after it.
        settings: Engine settings (prefix cache, its size).
        lag: Versions the lagged weights are behind (``Engine``).
        autocast: The dtype to run under (``bf16-mixed`` training: torch.bfloat16), so that
            rollout and training log-probs are computed alike; ``None``: the LM's dtype.
    """

    name = "hf"

    def __init__(self, lm: torch.nn.Module, pad_id: int, eos_id: int,
                 settings: EngineSettings = EngineSettings(), lag: int = 0,
                 autocast: torch.dtype | None = None) -> None:
        super().__init__(settings, lag)
        self.lm, self.pad_id, self.eos_id = lm, pad_id, eos_id
        self.autocast = autocast
        self._episodes: dict[tuple[str, int, Hashable], _Entry] = {}
        self._recent: dict[tuple[str, int], deque[_Entry]] = {}
        self.stats = CacheStats()

    # -- cache -------------------------------------------------------------------------
    def on_sync(self, version: int) -> None:
        keep = set(self.versions) - {version}  # a re-synced version has new weights
        self._episodes = {k: e for k, e in self._episodes.items() if k[1] in keep}
        self._recent = {k: d for k, d in self._recent.items() if k[1] in keep}

    def end_episodes(self, episodes: list[Hashable]) -> None:
        gone = set(episodes)
        self._episodes = {k: e for k, e in self._episodes.items() if k[2] not in gone}

    def clear(self) -> None:
        """Drop every cached prompt (the engine's weights may have changed without a sync)."""
        self._episodes.clear()
        self._recent.clear()

    def _prefixes(self, adapter: str, requests: list[Request]) -> list[tuple[int, KV] | None]:
        if not self.settings.prefix_cache:
            return [None] * len(requests)
        recent = self._recent.get((adapter, self.version), ())
        out: list[tuple[int, KV] | None] = []
        for r in requests:
            ids = np.asarray(r.prompt_ids)
            best, best_n = None, 0
            own = self._episodes.get((adapter, self.version, r.episode)) if r.episode is not None else None
            for entry in ([own] if own is not None else []) + list(recent):
                n = common_prefix(ids, entry.ids)
                if n > best_n:
                    best, best_n = entry, n
            best_n = min(best_n, len(r.prompt_ids) - 1)  # the last token must run: its logits
            out.append((best_n, best.kv) if best is not None and best_n > 0 else None)
        return out

    def _store(self, adapter: str, requests: list[Request], run: PromptPass) -> None:
        if not self.settings.prefix_cache:
            return
        layers = run.cache.layers
        recent = self._recent.setdefault((adapter, self.version), deque(maxlen=self.settings.cache_prompts))
        for i, r in enumerate(requests):
            where = run.mask[i].bool()
            kv = [(layer.keys[i][:, where], layer.values[i][:, where]) for layer in layers]  # [H, L, D]
            entry = _Entry(np.asarray(r.prompt_ids), kv)
            if r.episode is not None:
                self._episodes[(adapter, self.version, r.episode)] = entry
            if recent.maxlen:
                recent.append(entry)

    def _prompts(self, adapter: str, requests: list[Request]) -> PromptPass:
        prefixes = self._prefixes(adapter, requests)
        run = prompt_pass(self.lm, [r.prompt_ids for r in requests], self.pad_id, prefixes)
        reused = sum(p[0] for p in prefixes if p is not None)
        self.stats.reused += reused
        self.stats.computed += sum(len(r.prompt_ids) for r in requests) - reused
        self.stats.calls += 1
        self.stats.logit_rows += len(requests)
        self._store(adapter, requests, run)
        return run

    @contextlib.contextmanager
    def _running(self, adapter: str) -> Iterator[None]:
        if hasattr(self.lm, "set_adapter"):
            self.lm.set_adapter(adapter)
        device = next(self.lm.parameters()).device
        cast = (torch.autocast(device.type, dtype=self.autocast) if self.autocast is not None
                else contextlib.nullcontext())
        with torch.no_grad(), cast:
            yield

    # -- acting ------------------------------------------------------------------------
    def score(self, requests: list[Request], continuations: list[list[list[int]]]) -> list[list[Tensor]]:
        if not requests:
            return []
        check_continuations(continuations)
        adapter = one_adapter(requests)
        with self._running(adapter):
            run = self._prompts(adapter, requests)
            flat = [c for cands in continuations for c in cands]
            rows = [i for i, cands in enumerate(continuations) for _ in cands]
            self.stats.computed += sum(len(c) for c in flat)
            self.stats.logit_rows += sum(len(c) - 1 for c in flat)
            per_token = continuation_logprobs(self.lm, [r.prompt_ids for r in requests], flat, rows,
                                              self.pad_id, prompt=run)
        return per_request([t.float().cpu() for t in per_token], continuations)

    def generate(self, requests: list[Request], generator: torch.Generator | None = None) -> list[Generation]:
        """Sample up to ``max_new_tokens`` per request, one token per step on the cache."""
        if not requests:
            return []
        adapter, sampling = one_sampling(requests)
        with self._running(adapter):
            run = self._prompts(adapter, requests)
            device = run.last_logits.device
            logits, cache, mask, position = run.last_logits, run.cache, run.mask, run.lengths
            rows = len(requests)
            tokens, logps = [], []
            done = torch.zeros(rows, dtype=torch.bool, device=device)
            for step in range(sampling.max_new_tokens):
                scaled = logits.float() / sampling.temperature  # [B, V]
                if sampling.greedy:
                    token = scaled.argmax(-1)  # [B]
                else:
                    probs = torch.softmax(scaled, -1)
                    token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(device)
                token = torch.where(done, torch.full_like(token, self.eos_id), token)
                tokens.append(token)
                logps.append(token_logprobs(logits, token, sampling.temperature))  # [B]
                done = done | (token == self.eos_id)
                if bool(done.all()) or step == sampling.max_new_tokens - 1:
                    break
                active = rows - int(done.sum())
                self.stats.computed += active
                self.stats.logit_rows += active
                mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], 1)
                out = self.lm(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
                              cache=cache, use_cache=True)
                logits, cache, position = out.logits[:, -1], out.cache, position + 1
        ids = torch.stack(tokens, 1).tolist()  # [B, T]
        lps = torch.stack(logps, 1).float().cpu().tolist()  # [B, T]
        return [finished(row, lp, self.eos_id) for row, lp in zip(ids, lps)]
