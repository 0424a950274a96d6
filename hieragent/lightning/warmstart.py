"""Supervised warm start from expert demonstrations (GLIDER's stage 1, arXiv:2505.19761).

Each demonstration step becomes a ``Turn`` built exactly as the rollout builds its turns
(the same prompt text, the same candidate token ids), with the expert's choice as the
output. The loss is the negative log-likelihood of that choice under the policy being
trained:

    score mode:    -log softmax_c(score(c))[expert]   over the step's candidates
    generate mode: -(1/|y|) sum_t log pi(y_t | prompt, y_<t)   over the expert's tokens

averaged over the turns of each role. In score mode an expert subgoal that the env did not
offer as a candidate is appended to the candidates, so that its probability is defined.
RL then starts from the resulting checkpoint with ``model.init_from``.
"""

from __future__ import annotations

import torch

from hieragent.engines.prompting import Dialogue, retrieval_query, retrieve
from hieragent.envs.base import env_class
from hieragent.lightning.optim import guarded_step
from hieragent.types import Demonstration, Role, Turn


def imitation_turns(module, demos: list[Demonstration]) -> dict[Role, list[Turn]]:
    """The demonstrations' decisions as turns of the module's policies, by role, with the
    rollout's prompts (``engines.prompting``, history included) and greedy retrieval."""
    out: dict[Role, list[Turn]] = {"planner": [], "executor": []}
    planner, executor, prompter = module.planner, module.executor, module.prompter
    skills: list[list[str]] = []
    if planner is not None:
        queries = [retrieval_query(d.mission, p.observation) for d in demos for p in d.planner]
        picked = retrieve(module.bank, planner.query_adapter, queries, module.rollout_settings, greedy=True)
        skills = [texts for texts, _ in picked]
    shown = iter(skills)
    for d in demos:
        world = env_class(d.env).world
        if planner is not None:
            dialogue = Dialogue()
            for p in d.planner:
                options = p.candidates if planner.mode == "generate" else None
                prompt, user = prompter.planner_prompt(d.mission, p.observation, next(shown), options,
                                                       world=world, dialogue=dialogue)
                turn = _turn(planner, prompt, p.candidates, p.subgoal)
                prompter.remember(dialogue, user, turn.action_ids)
                out["planner"].append(turn)
        dialogue = Dialogue()
        for e in d.executor:
            subgoal = e.subgoal if planner is not None else d.mission
            options = e.candidates if executor.mode == "generate" else None
            prompt, user = prompter.executor_prompt(subgoal, e.observation, options, world=world,
                                                    dialogue=dialogue)
            turn = _turn(executor, prompt, e.candidates, e.action)
            prompter.remember(dialogue, user, turn.action_ids)
            out["executor"].append(turn)
    return out


def _turn(policy, prompt: list[int], candidates: list[str], target: str) -> Turn:
    if policy.mode == "score":
        options = candidates if target in candidates else [*candidates, target]
        cand_ids = [policy.candidate_ids(o) for o in options]
        chosen = options.index(target)
        return Turn(role=policy.role, prompt_ids=prompt, action_ids=cand_ids[chosen],
                    old_logprobs=[0.0], text=target, candidate_ids=cand_ids, chosen=chosen)
    ids = policy.candidate_ids(target)  # the text and the end-of-turn token, as generated
    return Turn(role=policy.role, prompt_ids=prompt, action_ids=ids, old_logprobs=[0.0] * len(ids),
                text=target)


def imitation_step(module, demos: list[Demonstration]) -> dict[str, float]:
    """One optimizer step of behaviour cloning on ``demos``; returns what to log.

    A non-finite loss or gradient norm skips the step, as in RL (``lightning/optim.py``).
    """
    opt = module.optimizers()
    opt.zero_grad()
    turns = imitation_turns(module, demos)
    chunk = module.objective.micro_batch_turns
    stats: dict[str, float] = {}
    finite = True
    for role, policy in module.policies():
        items = turns[role]
        if not items:
            continue
        total = 0.0
        for start in range(0, len(items), chunk):
            part = items[start:start + chunk]
            logps = policy.turn_logprobs(part)
            nll = torch.stack([-lp.mean() for lp in logps])  # [n]: per-turn mean over tokens
            loss = nll.sum() / len(items)
            if not torch.isfinite(loss):
                finite = False
                break
            module.manual_backward(loss)
            total += float(nll.detach().sum())
        stats[f"sft/{role}_nll"] = total / len(items)
        stats[f"sft/{role}_turns"] = float(len(items))
        # what the step computes on: each turn's prompt and its output (every candidate, in score mode)
        stats[f"sft/{role}_tokens"] = float(sum(len(t.prompt_ids) + sum(map(len, t.candidate_ids or [t.action_ids]))
                                                for t in items))
    step = guarded_step(opt, module.objective.max_grad_norm,
                        skip=None if finite else "non-finite imitation loss")
    stats["train/skipped_step"] = float(step.skipped is not None)
    stats["train/grad_norm"] = step.grad_norm
    if step.skipped is None:
        module.sync_engine()
    return stats
