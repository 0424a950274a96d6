"""Acting engines (``model.engine``): ``hf`` (transformers, the default) and ``vllm``.

The trainer talks to an ``Engine`` only (``base``); prompts are built in ``prompting``.
"""

from hieragent.engines.base import Engine, EngineSettings, Generation, Request, Sampling
from hieragent.engines.prompting import Dialogue, Prompter, retrieval_query, retrieve

ENGINES = ("hf", "vllm")

__all__ = ["ENGINES", "Dialogue", "Engine", "EngineSettings", "Generation", "Prompter", "Request",
           "Sampling", "retrieval_query", "retrieve"]
