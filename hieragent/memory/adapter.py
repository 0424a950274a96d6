"""The trainable query adapter: the only learned part of retrieval.

Keys are frozen encoder embeddings stored in FAISS; learning moves queries only, so the index
never needs re-embedding or re-indexing while training runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class QueryAdapter(nn.Module):
    """``out = normalize(q + q W^T + b)``, a residual affine map on the unit sphere.

    W and b start at zero, so at initialisation the adapter is the identity on normalised
    queries and retrieval equals plain cosine search with the frozen encoder.
    """

    def __init__(self, dim: int) -> None:
        """Args:
        dim: Embedding dimension D of the frozen encoder (384 for MiniLM).
        """
        super().__init__()
        if dim < 1:
            raise ValueError(f"QueryAdapter dim must be positive, got {dim}")
        self.dim = dim
        self.weight = nn.Parameter(torch.zeros(dim, dim))  # [D, D]
        self.bias = nn.Parameter(torch.zeros(dim))  # [D]

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        """Map frozen query embeddings ``[B, D]`` to adapted unit queries ``[B, D]``."""
        if q.shape[-1] != self.dim:
            raise ValueError(f"QueryAdapter expects queries of dim {self.dim}, got shape {tuple(q.shape)}")
        q = q.to(dtype=self.weight.dtype, device=self.weight.device)
        return F.normalize(q + q @ self.weight.T + self.bias, dim=-1)
