"""Memory/skill bank: a frozen encoder keys entries in FAISS; a query adapter learns to retrieve.

Retrieval is part of the planner's RL turn (``sample_retrieval``); its log-probability is
recomputed for the importance ratio by ``retrieval_logprob``.
"""

from hieragent.memory.adapter import QueryAdapter
from hieragent.memory.bank import KINDS, MemoryBank
from hieragent.memory.encoder import MINILM, MINILM_PACKAGE, embed, embedding_dim, load_encoder
from hieragent.memory.retrieval import (
    plackett_luce_logprob,
    retrieval_logprob,
    sample_retrieval,
    sample_retrievals,
)

__all__ = [
    "KINDS",
    "MINILM",
    "MINILM_PACKAGE",
    "MemoryBank",
    "QueryAdapter",
    "embed",
    "embedding_dim",
    "load_encoder",
    "plackett_luce_logprob",
    "retrieval_logprob",
    "sample_retrieval",
    "sample_retrievals",
]
