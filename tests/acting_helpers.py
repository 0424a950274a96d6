"""Acting through the real HF engine in tests: an ``Agent`` for a bound policy's LM."""

from hieragent.engines.acting import Agent, act
from hieragent.engines.base import EngineSettings
from hieragent.engines.hf import HFEngine
from hieragent.engines.prompting import Prompter


def agent_for(executor, planner=None, bank=None, history=0, **settings) -> Agent:
    lm, tokenizer = executor.lm, executor.tokenizer
    engine = HFEngine(lm, tokenizer.pad_token_id, tokenizer.eos_token_id, EngineSettings(**settings))
    return Agent(engine, Prompter(tokenizer, history), executor, planner, bank)


def prompt_ids(policy, text, world=None):
    return Prompter(policy.tokenizer).prompt(policy.role, text, world)[0]


def act_on(policy, prompts, options, greedy=False, generator=None):
    """``policy``'s turns on ``prompts`` (ids) through an HF engine on its bound LM."""
    engine = HFEngine(policy.lm, policy.tokenizer.pad_token_id, policy.tokenizer.eos_token_id)
    return act(engine, policy, prompts, options, greedy=greedy, generator=generator)
