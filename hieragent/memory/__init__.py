"""Memory/skill bank: a frozen encoder keys entries in FAISS; a query adapter learns to retrieve.

Retrieval is part of the planner's RL turn (``sample_retrieval``); its log-probability is
recomputed for the importance ratio by ``retrieval_logprob``.

The names below load on first use, so that a process needing only the index (the child that
builds one on loans, ``lent.py``) starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "QueryAdapter": "adapter",
    "KINDS": "bank",
    "MemoryBank": "bank",
    "MINILM": "encoder",
    "MINILM_PACKAGE": "encoder",
    "embed": "encoder",
    "embedding_dim": "encoder",
    "load_encoder": "encoder",
    "INDEX_KINDS": "structures",
    "IndexSpec": "structures",
    "KeyIndex": "index",
    "contrastive_loss": "retrieval",
    "plackett_luce_logprob": "retrieval",
    "retrieval_logprob": "retrieval",
    "sample_retrieval": "retrieval",
    "sample_retrievals": "retrieval",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hieragent.memory' has no attribute '{name}'")
    return getattr(importlib.import_module(f"hieragent.memory.{_WHERE[name]}"), name)
