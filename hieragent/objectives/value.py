"""A turn-level critic for GAE: the value of a planner or executor state.

ArCHer (Zhou et al. 2024, arXiv 2402.19446) pairs a token-level policy with an
utterance-level critic. Here one turn is one utterance, and its state is the turn's
``state_key`` (mission or subgoal, and the view; prompts hold no history, so that is the
whole state). The critic is a small MLP on the state's frozen sentence embedding, with one
output per role because planner and executor returns live on different scales:

    x(s) = MiniLM(state_key)                                     [D], frozen, L2-normalised
    V(s, role) = w_role . tanh(W x(s) + b) + b_role
    G_k = A_k + V(s_k)                  lambda-return, A_k from GAE along the credit chain
                                        (advantages.batch_gae; Schulman et al. 2016,
                                        arXiv 1506.02438, Eq. 16)
    L_V = mean_k (V(s_k) - sg[G_k])^2   sg: the targets carry no gradient

One training step with ``estimator="gae"``:

    features = turn_features(batch.turns(), encoder)             # [N, D], once per batch
    roles = [t.role for t in batch.turns()]
    with torch.no_grad():
        values = head(features, roles)                           # [N]
    assign_advantages(batch, settings=settings, values=values)
    targets = value_targets(batch, values, settings.gamma, settings.gae_lambda)
    loss = value_loss(head(features, roles), targets)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from hieragent.memory.encoder import embed, embedding_dim
from hieragent.objectives.advantages import aligned_values, batch_gae
from hieragent.types import ROLES, Batch, Role, Turn

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


def turn_features(turns: Sequence[Turn], encoder: SentenceTransformer) -> Tensor:
    """Frozen embeddings of the turns' states. ``[N, D]`` float32

    ``encoder`` is the memory's encoder (``hieragent.memory.encoder.load_encoder``).
    """
    missing = sum(not t.state_key for t in turns)
    if missing:
        raise ValueError(f"{missing} of {len(turns)} turns have no state_key; the value head "
                         "embeds it. Collect turns with hieragent.rollout.loop.collect, or set "
                         "Turn.state_key when building them by hand")
    if not turns:
        return torch.zeros(0, embedding_dim(encoder))
    return torch.from_numpy(embed(encoder, [t.state_key for t in turns]))


class TurnValueHead(nn.Module):
    """``V(s, role)``: a one-hidden-layer MLP from a state feature ``[D]``, one scalar per role."""

    def __init__(self, dim: int = 384, hidden: int = 64) -> None:
        super().__init__()
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, len(ROLES))

    def forward(self, features: Tensor, roles: Sequence[Role]) -> Tensor:
        """Values of states ``features`` ``[N, D]`` for the given roles; returns ``[N]``."""
        features = features.to(self.out.weight)
        per_role = self.out(torch.tanh(self.hidden(features)))  # [N, R]
        index = torch.tensor([ROLES.index(r) for r in roles], device=per_role.device)  # [N]
        return per_role.gather(1, index[:, None]).squeeze(1)  # [N]


@torch.no_grad()
def turn_values(head: TurnValueHead, turns: Sequence[Turn], encoder: SentenceTransformer) -> Tensor:
    """``V`` of every turn, without gradient: what ``assign_advantages`` takes. ``[N]``"""
    return head(turn_features(turns, encoder), [t.role for t in turns])


def value_targets(batch: Batch, values: Sequence[float] | Tensor, gamma: float,
                  lam: float) -> Tensor:
    """Lambda-returns ``G = A^GAE + V`` of ``batch.turns()``, in that order. ``[N]`` float64"""
    v = aligned_values(batch, values)  # [N]
    return batch_gae(batch, v, gamma, lam) + v


def value_loss(predicted: Tensor, targets: Tensor) -> Tensor:
    """Mean squared error of ``predicted`` ``[N]`` to the detached ``targets`` ``[N]``."""
    targets = targets.detach().to(predicted)
    return torch.mean((predicted - targets) ** 2)
