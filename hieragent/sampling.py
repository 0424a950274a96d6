"""Where the randomness of acting comes from: one shared stream, or one stream per episode.

Every sampling site (the candidate choice of score mode, generated tokens, the retrieval's
Plackett-Luce draws, vLLM's per-request seeds) takes ``Randomness``:

* a ``torch.Generator`` (or ``None``, torch's global one): one stream for the whole batch,
  drawn row after row; what an episode samples then depends on the other episodes of its
  batch;
* a list with one ``torch.Generator`` per row: each episode draws from its own stream, so
  an episode plays the same whatever else is in its batch and whichever rank plays it
  (``episode_generators``). A row draws only while it is still acting.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch
from torch import Tensor

Randomness = Union[torch.Generator, Sequence[torch.Generator], None]


def per_row(randomness: Randomness) -> bool:
    return isinstance(randomness, (list, tuple))


def rows_of(randomness: Randomness, rows: Sequence[int]) -> Randomness:
    """The randomness of a subset of rows (the envs acting in this call)."""
    return [randomness[i] for i in rows] if per_row(randomness) else randomness


def row_generator(randomness: Randomness, row: int) -> torch.Generator | None:
    return randomness[row] if per_row(randomness) else randomness


def draw(probs: Tensor, randomness: Randomness, active: Tensor | None = None) -> Tensor:
    """One index per row of ``probs`` ``[B, N]``, on CPU; ``[B]`` int64.

    With per-row generators only ``active`` rows draw (the others get 0), so a row's stream
    advances by its own draws alone; a shared stream draws for every row, as it always has.
    """
    probs = probs.detach().float().cpu()
    if not per_row(randomness):
        return torch.multinomial(probs, 1, generator=randomness).squeeze(-1)
    if len(randomness) != probs.shape[0]:
        raise ValueError(f"{len(randomness)} generators for {probs.shape[0]} rows")
    out = torch.zeros(probs.shape[0], dtype=torch.long)
    rows = range(probs.shape[0]) if active is None else active.nonzero().flatten().tolist()
    for b in rows:
        out[b] = torch.multinomial(probs[b], 1, generator=randomness[b])[0]
    return out


def episode_seed(*key: int) -> int:
    """A 63-bit seed from integer keys (run seed, episode index, replica): well mixed, so
    neighbouring episodes get unrelated streams."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def episode_generators(base: int, episodes: Sequence[Sequence[int]]) -> list[torch.Generator]:
    """One CPU generator per episode, seeded from ``base`` and the episode's key."""
    return [torch.Generator().manual_seed(episode_seed(base, *key)) for key in episodes]
