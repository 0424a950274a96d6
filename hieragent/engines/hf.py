"""The transformers engine (the default, CPU or GPU): batched scoring and sampling on the
trainer's own LM, with the KV of prompts kept in place from call to call.

With ``prefix_cache`` (the default) every episode owns a row of a preallocated KV arena
per adapter and version (``engines.kv``; a LoRA changes K and V, so nothing is shared
across either). A new prompt runs only the tokens after the longest prefix it shares with
what its row holds (its previous prompt, with the completion it generated) or with what a
recent row of another episode holds: the system text and the subgoal within an episode,
the whole history when ``rollout.history`` keeps it in the prompt. Score mode's candidates
run in the same forward, behind the prompt, under a tree mask. Prompts are token ids built
by appending (``engines.prompting``), never re-tokenised, so a prefix match is exact.
Without ``prefix_cache`` each call runs its prompts whole (``agents.scoring``), the path
the trainer recomputes on; numbers of the two agree up to float rounding
(``tests/engines/test_hf.py`` checks it in float64).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Hashable, Iterator

import numpy as np
import torch
from torch import Tensor

from hieragent.agents.scoring import continuation_logprobs, prompt_pass, token_logprobs
from hieragent.engines.base import (Engine, EngineSettings, Generation, Request, check_continuations, finished,
                                   one_adapter, one_sampling, per_request)
from hieragent.engines.kv import GROUPED, Arena, ArenaCall, Placement, packed
from hieragent.sampling import Randomness, draw


@dataclass
class CacheStats:
    """Tokens the engine ran (``computed``) and took from the cache (``reused``), the rows
    of logits it projected onto the vocabulary and used (``logit_rows``), and the
    (query, key) pairs its attention took in per layer (``attended``), summed."""

    computed: int = 0
    reused: int = 0
    logit_rows: int = 0
    attended: int = 0
    calls: int = 0


def causal_pairs(n: int) -> int:
    """(query, key) pairs of causal attention over ``n`` tokens."""
    return n * (n + 1) // 2


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
        self._arenas: dict[tuple[str, int], Arena] = {}
        self.stats = CacheStats()

    # -- cache -------------------------------------------------------------------------
    def on_sync(self, version: int) -> None:
        keep = set(self.versions) - {version}  # a re-synced version has new weights
        self._arenas = {k: a for k, a in self._arenas.items() if k[1] in keep}

    def end_episodes(self, episodes: list[Hashable]) -> None:
        for arena in self._arenas.values():
            for e in episodes:
                arena.release(e)

    def clear(self) -> None:
        """Drop every cached prompt (the engine's weights may have changed without a sync)."""
        self._arenas.clear()

    def sleep(self) -> None:
        """The trainer updates: the arenas' memory goes back to it. The batch's episodes are
        over, so only the prefixes new episodes would have shared (the system text) are lost."""
        self._arenas.clear()

    def _arena(self, adapter: str) -> Arena:
        key = (adapter, self.version)
        if key not in self._arenas:
            config = self._model().config
            heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            param = next(self.lm.parameters())
            self._arenas[key] = Arena(config.num_hidden_layers, getattr(config, "num_key_value_heads", heads),
                                      head_dim, self.autocast or param.dtype, param.device,
                                      self.settings.cache_prompts)
        return self._arenas[key]

    def _model(self) -> torch.nn.Module:
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    @contextlib.contextmanager
    def _running(self, adapter: str) -> Iterator[None]:
        if hasattr(self.lm, "set_adapter"):
            self.lm.set_adapter(adapter)
        device = next(self.lm.parameters()).device
        cast = (torch.autocast(device.type, dtype=self.autocast) if self.autocast is not None
                else contextlib.nullcontext())
        with torch.no_grad(), cast:
            yield

    # -- the arena path ----------------------------------------------------------------
    def _mask(self, visible: Tensor, lo: Tensor, cols: Tensor, real: Tensor, width: int) -> Tensor:
        """``[B, 1, Q, width]``: query (b, q) sees columns ``< visible`` and ``lo .. cols``."""
        c = torch.arange(width, device=cols.device)
        seen = (c < visible[..., None]) | ((c >= lo[..., None]) & (c <= cols[..., None]))  # [B, Q, W]
        self.stats.attended += int(seen[real].sum())
        return seen[:, None]

    def _forward(self, call: ArenaCall, ids: Tensor, positions: Tensor, cols: Tensor, visible: Tensor,
                 lo: Tensor, real: Tensor, width: int) -> Tensor:
        """One forward of the ``real`` entries of ``ids [B, Q]`` on the arena, packed into one
        sequence; returns the last hidden states ``[B, Q, E]`` (zeros where not real)."""
        rows, qs = real.nonzero(as_tuple=True)  # row-major: each row's tokens in order
        call.set_queries(rows, qs, cols[rows, qs], ids.shape[1], width)
        mask = self._mask(visible, lo, cols, real, width)
        config = self._model().config
        impl = config._attn_implementation
        config._attn_implementation_internal = GROUPED  # unpacks the rows; K/V not repeated per head
        try:
            with packed(call):
                out = self._model().get_decoder()(input_ids=ids[rows, qs][None], attention_mask=mask,
                                                  position_ids=positions[rows, qs][None], cache=call,
                                                  use_cache=True)
        finally:
            config._attn_implementation_internal = impl
        hidden = out.last_hidden_state[0]  # [T, E]
        full = hidden.new_zeros((*ids.shape, hidden.shape[-1]))
        full[rows, qs] = hidden
        return full

    def _logits(self, hidden: Tensor) -> Tensor:
        return self._model().get_output_embeddings()(hidden)

    def _prompt_block(self, requests: list[Request], placements: list[Placement],
                      continuations: list[list[list[int]]] | None, extra: int) -> dict:
        """The query block of one call: each row's new prompt tokens, then its candidates.

        Returns ids, positions, target columns (-1: padding, which does not run), visibility
        (``[B, Q]`` each), the width the queries see, the arena columns the call needs
        (``extra`` more for decoding), and for each row the query index of the prompt's last
        token and each candidate's first query index.
        """
        rows = len(requests)
        spans = []
        for i, (r, p) in enumerate(zip(requests, placements)):
            new = list(r.prompt_ids[p.reused:])
            cands = continuations[i] if continuations is not None else []
            spans.append((new, cands))
        q = max(len(new) + sum(len(c) for c in cands) for new, cands in spans)
        width = max(p.reused + len(new) + sum(len(c) for c in cands) for p, (new, cands) in zip(placements, spans))
        ids = np.full((rows, q), self.pad_id, dtype=np.int64)
        pos = np.zeros((rows, q), dtype=np.int64)
        cols = np.full((rows, q), -1, dtype=np.int64)
        visible = np.ones((rows, q), dtype=np.int64)  # padding sees column 0 only
        lo = np.full((rows, q), -1, dtype=np.int64)
        last, starts = [], []
        for i, (p, (new, cands)) in enumerate(zip(placements, spans)):
            n, u = p.reused, len(new)
            length = n + u  # the whole prompt
            ids[i, :u] = new
            pos[i, :u] = np.arange(n, length)
            cols[i, :u] = np.arange(n, length)
            visible[i, :u] = cols[i, :u] + 1
            lo[i, :u] = cols[i, :u]
            last.append(u - 1)
            at, row_starts = u, []
            for c in cands:
                k = len(c)
                ids[i, at:at + k] = c
                pos[i, at:at + k] = np.arange(length, length + k)
                cols[i, at:at + k] = np.arange(n + at, n + at + k)
                visible[i, at:at + k] = length
                lo[i, at:at + k] = n + at
                row_starts.append(at)
                at += k
            starts.append(row_starts)
        device = next(self.lm.parameters()).device
        real = cols >= 0
        t = {k: torch.from_numpy(v).to(device) for k, v in
             dict(ids=ids, positions=pos, cols=cols, visible=visible, lo=lo, real=real).items()}
        return dict(t, width=width, columns=width + extra, last=last, starts=starts)

    def _call(self, adapter: str, requests: list[Request], extra: int = 0,
              continuations: list[list[list[int]]] | None = None):
        arena = self._arena(adapter)
        placements = arena.place(requests)
        block = self._prompt_block(requests, placements, continuations, extra)
        arena.reserve(arena.slots, block["columns"])
        call = ArenaCall(arena, [p.slot for p in placements], block["columns"])
        hidden = self._forward(call, block["ids"], block["positions"], block["cols"], block["visible"],
                               block["lo"], block["real"], block["width"])
        reused = sum(p.reused for p in placements)
        self.stats.reused += reused
        self.stats.computed += sum(len(r.prompt_ids) for r in requests) - reused
        self.stats.calls += 1
        return arena, placements, call, block, hidden

    # -- acting ------------------------------------------------------------------------
    def score(self, requests: list[Request], continuations: list[list[list[int]]]) -> list[list[Tensor]]:
        if not requests:
            return []
        check_continuations(continuations)
        adapter = one_adapter(requests)
        if not self.settings.prefix_cache:
            return self._score_whole(adapter, requests, continuations)
        with self._running(adapter):
            arena, placements, call, block, hidden = self._call(adapter, requests, 0, continuations)
            rows, qs, targets = [], [], []  # hidden rows that predict a candidate token
            for i, (cands, starts) in enumerate(zip(continuations, block["starts"])):
                for c, at in zip(cands, starts):
                    rows += [i] * len(c)
                    qs += [block["last"][i]] + list(range(at, at + len(c) - 1))
                    targets += c
            device = hidden.device
            picked = hidden[torch.tensor(rows, device=device), torch.tensor(qs, device=device)]  # [T, E]
            logps = token_logprobs(self._logits(picked), torch.tensor(targets, device=device)).float().cpu()
            arena.record(placements, [r.prompt_ids for r in requests])
        flat = [c for cands in continuations for c in cands]
        self.stats.computed += sum(len(c) for c in flat)
        self.stats.logit_rows += len(requests) + sum(len(c) - 1 for c in flat)
        sizes = [len(c) for c in flat]
        return per_request(list(torch.split(logps, sizes)), continuations)

    def generate(self, requests: list[Request], generator: Randomness = None) -> list[Generation]:
        """Sample up to ``max_new_tokens`` per request, one token per step on the cache."""
        if not requests:
            return []
        adapter, sampling = one_sampling(requests)
        if not self.settings.prefix_cache:
            return self._generate_whole(adapter, sampling, requests, generator)
        with self._running(adapter):
            arena, placements, call, block, hidden = self._call(adapter, requests, sampling.max_new_tokens)
            device = hidden.device
            rows = torch.arange(len(requests), device=device)
            logits = self._logits(hidden[rows, torch.tensor(block["last"], device=device)])  # [B, V]
            self.stats.logit_rows += len(requests)
            lengths = torch.tensor([len(r.prompt_ids) for r in requests], device=device)  # [B]
            every = torch.ones((len(requests), 1), dtype=torch.bool, device=device)
            fed: list[Tensor] = []

            def step(token: Tensor) -> Tensor:
                cols = (lengths + len(fed))[:, None]  # [B, 1]
                fed.append(token)
                width = int(cols.max()) + 1
                h = self._forward(call, token[:, None], cols, cols, cols + 1, cols, every, width)
                return self._logits(h[:, -1])

            tokens, logps = self._decode(logits, sampling, generator, step)
            grown = torch.stack(fed, 1).tolist() if fed else [[] for _ in requests]
            arena.record(placements, [list(r.prompt_ids) + g for r, g in zip(requests, grown)])
        return [finished(row, lp, self.eos_id) for row, lp in zip(tokens, logps)]

    def _decode(self, logits: Tensor, sampling, generator, step) -> tuple[list[list[int]], list[list[float]]]:
        """The sampling loop: ``step(token [B])`` runs the sampled tokens and returns the next logits."""
        rows = logits.shape[0]
        device = logits.device
        tokens, logps = [], []
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        for t in range(sampling.max_new_tokens):
            scaled = logits.float() / sampling.temperature  # [B, V]
            if sampling.greedy:
                token = scaled.argmax(-1)  # [B]
            else:
                token = draw(torch.softmax(scaled, -1), generator, active=~done.cpu()).to(device)
            token = torch.where(done, torch.full_like(token, self.eos_id), token)
            tokens.append(token)
            logps.append(token_logprobs(logits, token, sampling.temperature))  # [B]
            done = done | (token == self.eos_id)
            if bool(done.all()) or t == sampling.max_new_tokens - 1:
                break
            active = rows - int(done.sum())
            self.stats.computed += active
            self.stats.logit_rows += active
            logits = step(token)
        return torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).float().cpu().tolist()

    # -- whole prompts (no cache): the trainer's own path ------------------------------
    def _score_whole(self, adapter, requests, continuations) -> list[list[Tensor]]:
        with self._running(adapter):
            prompts = [r.prompt_ids for r in requests]
            run = prompt_pass(self.lm, prompts, self.pad_id)
            flat = [c for cands in continuations for c in cands]
            self.stats.attended += sum(causal_pairs(len(p)) for p in prompts) + sum(
                causal_pairs(len(c)) + len(c) * len(prompts[i]) for i, cands in enumerate(continuations) for c in cands)
            rows = [i for i, cands in enumerate(continuations) for _ in cands]
            self.stats.computed += sum(len(p) for p in prompts) + sum(len(c) for c in flat)
            self.stats.logit_rows += len(requests) + sum(len(c) - 1 for c in flat)
            self.stats.calls += 1
            per_token = continuation_logprobs(self.lm, prompts, flat, rows, self.pad_id, prompt=run)
        return per_request([t.float().cpu() for t in per_token], continuations)

    def _generate_whole(self, adapter, sampling, requests, generator) -> list[Generation]:
        with self._running(adapter):
            run = prompt_pass(self.lm, [r.prompt_ids for r in requests], self.pad_id)
            self.stats.computed += sum(len(r.prompt_ids) for r in requests)
            self.stats.attended += sum(causal_pairs(len(r.prompt_ids)) for r in requests)
            self.stats.logit_rows += len(requests)
            self.stats.calls += 1
            device = run.last_logits.device
            state = {"cache": run.cache, "mask": run.mask, "position": run.lengths}

            def step(token: Tensor) -> Tensor:
                self.stats.attended += int(state["mask"].sum()) + len(requests)
                state["mask"] = torch.cat([state["mask"], torch.ones((len(requests), 1), dtype=state["mask"].dtype,
                                                                     device=device)], 1)
                out = self.lm(input_ids=token[:, None], attention_mask=state["mask"],
                              position_ids=state["position"][:, None], cache=state["cache"], use_cache=True)
                state["cache"], state["position"] = out.cache, state["position"] + 1
                return out.logits[:, -1]

            tokens, logps = self._decode(run.last_logits, sampling, generator, step)
        return [finished(row, lp, self.eos_id) for row, lp in zip(tokens, logps)]
