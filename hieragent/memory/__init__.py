"""Memory/skill bank: a frozen encoder keys entries in FAISS; a query adapter learns to retrieve.

Retrieval is part of the planner's RL turn (``sample_retrieval``); its log-probability is
recomputed for the importance ratio by ``retrieval_logprob``.
"""

from hieragent.memory.adapter import QueryAdapter
from hieragent.memory.bank import KINDS, MemoryBank
from hieragent.memory.encoder import MINILM, MINILM_PACKAGE, embed, embedding_dim, load_encoder
from hieragent.memory.index import INDEX_KINDS, IndexSpec, KeyIndex
from hieragent.memory.retrieval import (
    contrastive_loss,
    plackett_luce_logprob,
    retrieval_logprob,
    sample_retrieval,
    sample_retrievals,
)

__all__ = [
    "INDEX_KINDS",
    "KINDS",
    "MINILM",
    "MINILM_PACKAGE",
    "IndexSpec",
    "KeyIndex",
    "MemoryBank",
    "QueryAdapter",
    "contrastive_loss",
    "embed",
    "embedding_dim",
    "load_encoder",
    "plackett_luce_logprob",
    "retrieval_logprob",
    "sample_retrieval",
    "sample_retrievals",
]
