"""A policy's turns from an engine's numbers: the candidate softmax and sampling of
``score`` mode, and the completions of ``generate`` mode, as ``Turn``s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from hieragent.agents.scoring import candidate_softmax
from hieragent.engines.base import Engine, Request, Sampling
from hieragent.engines.prompting import Prompter
from hieragent.sampling import Randomness, row_generator
from hieragent.types import Turn


@dataclass
class Agent:
    """What the rollout acts with: the engine, the prompt builder, the role policies (their
    adapters, modes and temperatures) and the skill bank the planner retrieves from."""

    engine: Engine
    prompter: Prompter
    executor: Any
    planner: Any = None
    bank: Any = None


def act(engine: Engine, policy, prompts: list[list[int]], options: list[list[str]],
        episodes: list[Hashable] | None = None, greedy: bool = False,
        generator: Randomness = None) -> list[Turn]:
    """One turn of ``policy`` per prompt, with behaviour log-probs and the engine's version.

    Args:
        engine: The acting engine.
        policy: The role acting (``agents.policy.Policy``: adapter, mode, temperature).
        prompts: Prompt ids, one per env.
        options: Score mode: each env's candidate strings (generate mode ignores them).
        episodes: The episode of each prompt, for the engine's cache.
        greedy: Take the most likely candidate or token (evaluation).
        generator: Randomness of the sampling: one generator, or one per prompt
            (``hieragent.sampling``).
    """
    if not prompts:
        return []
    episodes = episodes if episodes is not None else [None] * len(prompts)
    sampling = Sampling(policy.temperature, policy.max_new_tokens, greedy)
    requests = [Request(p, policy.adapter, e, sampling) for p, e in zip(prompts, episodes)]
    version = engine.version
    if policy.mode == "score":
        if any(not opts for opts in options):
            raise ValueError(f"{policy.role}: score mode needs at least one candidate per prompt; "
                             f"the env offered none (an env that lists no moves, e.g. TextArena's Sudoku, "
                             f"needs model.{policy.role}_mode: generate)")
        cand_ids = [[policy.candidate_ids(o) for o in opts] for opts in options]
        per_token = engine.score(requests, cand_ids)
        logps = candidate_softmax([t for row in per_token for t in row], [len(c) for c in cand_ids],
                                  policy.temperature, policy.score_reduction)
        turns = []
        for j, (prompt, opts, cands, lp) in enumerate(zip(prompts, options, cand_ids, logps)):
            if greedy:
                choice = int(lp.argmax())
            else:
                choice = int(torch.multinomial(lp.exp().cpu(), 1, generator=row_generator(generator, j)))
            turns.append(Turn(role=policy.role, prompt_ids=prompt, action_ids=cands[choice],
                              old_logprobs=[float(lp[choice])], text=opts[choice],
                              policy_version=version, candidate_ids=cands, chosen=choice))
        return turns
    turns = []
    for prompt, gen in zip(prompts, engine.generate(requests, generator)):
        text = policy.tokenizer.decode(gen.ids, skip_special_tokens=True).strip()
        turns.append(Turn(role=policy.role, prompt_ids=prompt, action_ids=gen.ids,
                          old_logprobs=gen.logprobs, text=text, policy_version=version))
    return turns
