"""Keys with neighbourhoods and float64 brute force, for the index tests."""

from __future__ import annotations

import numpy as np

D = 32


def clustered(rng: np.random.Generator, n: int, centres: int = 40, d: int = D) -> np.ndarray:
    """Unit vectors around random centres: data with neighbourhoods, like embeddings."""
    c = rng.standard_normal((centres, d))
    x = c[rng.integers(0, centres, n)] + 0.35 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def brute_force(keys: np.ndarray, ids: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    sims = q.astype(np.float64) @ keys.astype(np.float64).T  # [B, N]
    top = np.argsort(-sims, axis=1)[:, :k]
    return ids[top], np.take_along_axis(sims, top, axis=1)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return sum(len(set(f) & set(t)) for f, t in zip(found, truth)) / truth.size
