"""How the benches say whether two sets of repeated measurements differ: only where every
value of one lies beyond every value of the other. Anything else is inside the machine's
noise, and they say that in the same words."""

from __future__ import annotations

from collections.abc import Sequence

OVERLAP = "the ranges overlap, a difference inside this machine's noise"


def separation(a: Sequence[float], b: Sequence[float]) -> int:
    """-1 where every value of ``a`` is below every value of ``b``, 1 where every one is above,
    0 where the ranges overlap."""
    if max(a) < min(b):
        return -1
    if max(b) < min(a):
        return 1
    return 0
