"""The HF engine's KV arena: one preallocated key/value buffer per layer, one row (slot) per
episode, the KV of each episode's prompt kept in place from turn to turn.

A slot holds the keys and values of a token sequence (``Arena.ids``) in columns
``0 .. len-1``. A call places each request in a slot, reuses the columns of the longest
prefix its prompt shares with what the slot (or another slot) holds, and runs only the rest.
New keys are written straight into each row's own columns (``SlotLayer.update``), and a
4D mask says which columns each query sees, so nothing is re-assembled, re-padded or copied
out between calls. Score mode's candidates run in the same forward as the prompt's new
tokens, laid one after another behind the prompt, each seeing the prompt and itself (a
tree mask), so the prompt's KV is never repeated per candidate. Generated tokens are
written behind the prompt too, and stay valid KV of ``prompt + completion``: with a history
window the next turn's prompt starts with exactly those tokens and reuses them.

Keys live per (adapter, version): a LoRA changes K and V, so no slot is shared across
either (``hf.HFEngine`` keeps one arena per pair).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Hashable, Iterator

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class Placement:
    """Where a request's tokens go: its ``slot`` and the ``reused`` leading prompt tokens
    whose KV the slot already holds (the rest of the prompt runs)."""

    slot: int
    reused: int
    temporary: bool  # a request without an episode: the slot is free again after the call


class Arena:
    """Per-layer KV buffers ``[slots, kv_heads, columns, head_dim]`` with a token record per slot.

    Args:
        layers, kv_heads, head_dim: The model's KV geometry.
        dtype, device: Of the keys the model writes (the autocast dtype when acting under one).
        keep_free: Free slots whose content stays available for prefix reuse (the engine's
            ``cache_prompts``); older free slots are forgotten.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, keep_free: int) -> None:
        self.geometry = (kv_heads, head_dim)
        self.dtype, self.device, self.keep_free = dtype, device, keep_free
        self.keys: list[Tensor] = [self._empty(0, 0) for _ in range(layers)]
        self.values: list[Tensor] = [self._empty(0, 0) for _ in range(layers)]
        self.ids: list[np.ndarray | None] = []  # per slot: the tokens its columns hold
        self.owner: dict[Hashable, int] = {}  # live episode -> slot
        self.free: OrderedDict[int, None] = OrderedDict()  # free slots, least recently freed first
        self.copied = 0  # token columns copied between slots (a new episode taking another's prefix)

    def _empty(self, slots: int, columns: int) -> Tensor:
        return torch.zeros((slots, *self.geometry[:1], columns, self.geometry[1]), dtype=self.dtype,
                           device=self.device)

    @property
    def slots(self) -> int:
        return len(self.ids)

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, slots: int, columns: int) -> None:
        """Grow to at least ``slots`` rows and ``columns`` columns (doubling, so growth is rare)."""
        if slots <= self.slots and columns <= self.columns:
            return
        rows = max(slots, self.slots, 2 * self.slots if slots > self.slots else 0)
        cols = max(columns, self.columns, 2 * self.columns if columns > self.columns else 0)
        cols = -(-cols // 64) * 64
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = self._empty(rows, cols)
                new[: old.shape[0], :, : old.shape[2]] = old
                store[i] = new
        for s in range(self.slots, rows):
            self.ids.append(None)
            self.free[s] = None

    def release(self, episode: Hashable) -> None:
        slot = self.owner.pop(episode, None)
        if slot is not None:
            self._free(slot)

    def _free(self, slot: int) -> None:
        self.free[slot] = None
        self.free.move_to_end(slot)
        held = [s for s in self.free if self.ids[s] is not None]
        for s in held[: max(0, len(held) - self.keep_free)]:
            self.ids[s] = None

    def place(self, requests: list) -> list[Placement]:
        """A slot and the reusable prefix for each request (all but the last prompt token at
        most: the last always runs, for its logits).

        A live episode keeps its slot. A new one takes the free slot holding the longest
        prefix of its prompt, or else the least recently freed slot, into which the longest
        prefix held by any other slot is copied. A request without an episode (or a second
        request of one episode in the same call) gets a slot for this call only.
        """
        taken: set[int] = set()
        out: list[Placement] = []
        for r in requests:
            ids = np.asarray(r.prompt_ids)
            own = self.owner.get(r.episode) if r.episode is not None else None
            if own in taken:
                own = None
            temporary = own is None and (r.episode is None or r.episode in self.owner)
            best, best_n = None, 0
            for s, held in enumerate(self.ids):
                if held is None or s in taken:
                    continue
                n = common_prefix(ids, held)
                if n > best_n or (n == best_n and n > 0 and s == own):
                    best, best_n = s, n
            if own is not None:
                slot = own
            elif best is not None and best in self.free:
                slot = best
            else:
                slot = self._take(taken)
            reused = min(best_n, len(ids) - 1)
            if reused and best != slot:
                self._copy(best, slot, reused)
            self.free.pop(slot, None)
            if not temporary:
                self.owner[r.episode] = slot
            self.ids[slot] = ids[:reused]  # what stays valid if the call fails half-way
            taken.add(slot)
            out.append(Placement(slot, reused, temporary))
        return out

    def _take(self, taken: set[int]) -> int:
        for s in self.free:  # least recently freed first
            if s not in taken:
                return s
        self.reserve(self.slots + 1, self.columns)
        return next(s for s in self.free if s not in taken)

    def _copy(self, src: int, dst: int, n: int) -> None:
        for store in (self.keys, self.values):
            for layer in store:
                layer[dst, :, :n] = layer[src, :, :n]
        self.copied += n

    def record(self, placements: list[Placement], ids: list[list[int]]) -> None:
        """After a call: what each slot's columns hold now; one-off slots are freed."""
        for p, seq in zip(placements, ids):
            self.ids[p.slot] = np.asarray(seq)
            if p.temporary:
                self._free(p.slot)


class SlotLayer(CacheLayerMixin):
    """One layer of a call's cache: writes each new key into its row's own column of the
    arena and returns the keys of the columns the call can see."""

    is_compileable = False

    def __init__(self, call: "ArenaCall", layer: int) -> None:
        super().__init__()
        self.call, self.layer = call, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        call = self.call
        keys, values = call.keys[self.layer], call.values[self.layer]
        new_k = key_states[0].transpose(0, 1).to(keys.dtype)  # packed [1, H, T, D] -> [T, H, D]
        new_v = value_states[0].transpose(0, 1).to(values.dtype)
        keys[call.rows, :, call.cols] = new_k
        values[call.rows, :, call.cols] = new_v
        if call.gathered:  # a copy of the rows: the arena gets the new columns too
            slots = call.slots[call.rows]
            call.arena.keys[self.layer][slots, :, call.cols] = new_k
            call.arena.values[self.layer][slots, :, call.cols] = new_v
        return keys[:, :, : call.width], values[:, :, : call.width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.call.width, 0

    def get_seq_length(self) -> int:
        return self.call.width

    def get_max_length(self) -> int:
        return -1


class ArenaCall(Cache):
    """The cache a forward of one engine call runs on: the arena's rows of the call's slots
    (a view when they are consecutive, else a gathered copy kept in step with the arena).

    The forward runs the call's tokens packed into one sequence, with no padding, so the
    weight matmuls see real tokens only. Before each forward the caller sets, per packed
    token, its row and its column (``set_queries``), and the width the queries may see;
    attention unpacks the queries into rows (``grouped_attention``) and a 4D mask says
    which columns each sees.
    """

    def __init__(self, arena: Arena, slots: list[int], columns: int) -> None:
        self.arena = arena
        self.slots = torch.tensor(slots, dtype=torch.long, device=arena.device)
        first = slots[0]
        self.gathered = slots != list(range(first, first + len(slots)))
        if self.gathered:
            self.keys = [k[self.slots, :, :columns] for k in arena.keys]
            self.values = [v[self.slots, :, :columns] for v in arena.values]
        else:
            self.keys = [k[first:first + len(slots)] for k in arena.keys]
            self.values = [v[first:first + len(slots)] for v in arena.values]
        self.rows = self.cols = self.qs = torch.zeros(0, dtype=torch.long, device=arena.device)
        self.width = self.queries = 0
        super().__init__(layers=[SlotLayer(self, i) for i in range(len(arena.keys))])

    def set_queries(self, rows: Tensor, qs: Tensor, cols: Tensor, queries: int, width: int) -> None:
        """Packed token ``t`` is query ``qs[t]`` of row ``rows[t]``; its key goes to column
        ``cols[t]``; rows have ``queries`` query slots and see ``width`` columns."""
        self.rows, self.qs, self.cols, self.queries, self.width = rows, qs, cols, queries, width

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


_PACKED: ContextVar[ArenaCall | None] = ContextVar("hieragent_packed_call", default=None)


@contextlib.contextmanager
def packed(call: ArenaCall) -> Iterator[None]:
    """Inside the block, ``grouped_attention`` unpacks the queries by ``call``'s layout."""
    token = _PACKED.set(call)
    try:
        yield
    finally:
        _PACKED.reset(token)


def grouped_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[Tensor, None]:
    """SDPA for grouped-query attention under an explicit mask, without repeating K and V.

    transformers' ``sdpa`` repeats every key/value head for each of its query heads when a
    mask is given (``repeat_kv``), a copy of the whole cache per layer and forward, kept for
    the backward pass when training. Here attention runs on the KV heads as they are (see
    ``_grouped``). Same numbers, no copy. Inside ``packed(call)`` the queries come packed as
    one sequence and are unpacked into rows.
    """
    call = _PACKED.get()
    if call is not None:  # packed tokens [1, H, T, D] -> rows [B, H, Q, D]
        heads, dim = query.shape[1], query.shape[3]
        rows = query.new_zeros((key.shape[0], call.queries, heads, dim))
        rows[call.rows, call.qs] = query[0].transpose(0, 1)
        out, _ = _grouped(rows.transpose(1, 2), key, value, attention_mask, dropout, scaling)  # [B, Q, H, D]
        return out[call.rows, call.qs][None], None  # [1, T, H, D]
    return _grouped(query, key, value, attention_mask, dropout, scaling)


def _grouped(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, dropout: float,
             scaling: float | None, native: bool | None = None) -> tuple[Tensor, None]:
    """``[B, H, Q, D]`` queries on ``[B, KV, W, D]`` keys -> ``[B, Q, H, D]``.

    Without a mask (no padding, Q == W or Q == 1: transformers' shortcut) and on the CPU
    (``native``), SDPA's own ``enable_gqa``: on the CPU it beats repeated keys in time and
    memory, forward and backward (``make bench-attention``). On CUDA, transformers
    avoids ``enable_gqa`` under a mask (SDPA falls back to its math kernel there), so
    elsewhere the query heads of each KV head are stacked along the query axis instead, and
    the mask with them.
    """
    batch, heads, q_len, dim = query.shape
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if native is None:
        native = attention_mask is None or query.device.type == "cpu"
    if native:
        out = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                   is_causal=attention_mask is None and q_len > 1, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = query.reshape(batch, kv_heads, group * q_len, dim)  # row j * Q + i: head kv * group + j, query i
    mask = attention_mask.repeat(1, 1, group, 1)
    out = sdpa(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


GROUPED = "hieragent_grouped_sdpa"
ALL_ATTENTION_FUNCTIONS.register(GROUPED, grouped_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED, sdpa_mask)  # transformers' SDPA masks, shortcut included


def use_grouped_attention(model: torch.nn.Module) -> None:
    """Run ``model``'s attention as ``grouped_attention`` everywhere (the trainer's forwards
    too), where it runs transformers' SDPA: the same numbers without a copy of every key and
    value per query head, kept for the backward pass. Other implementations stay."""
    config = model.config
    if config._attn_implementation == "sdpa":
        config._attn_implementation = GROUPED
