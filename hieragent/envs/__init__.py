"""Text environments: BabyAI levels as text, a batch pool, and the scripted expert."""

from hieragent.envs.babyai import ACTIONS, BabyAITextEnv
from hieragent.envs.base import TextEnv, check_env_name, known_envs, make_env
from hieragent.envs.pool import EnvPool

__all__ = ["ACTIONS", "BabyAITextEnv", "EnvPool", "TextEnv", "check_env_name", "known_envs", "make_env"]
