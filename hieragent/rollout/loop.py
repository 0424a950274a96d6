"""The hierarchical rollout: planner turns, executor turns, batched over an env pool.

The planner emits a subgoal; the executor acts until the subgoal is done, or
``max_subgoal_steps`` pass, or the episode ends; then the planner is asked again. Every
turn of either policy is recorded with its prompt ids, output ids, behaviour
log-probabilities and reward. With ``hierarchical=False`` (the flat baseline) there is no
planner: the executor's subgoal is the mission and the episode is one segment.

Each loop iteration makes one batched engine call per policy over every env that needs
it. Prompts and retrievals come from ``engines.prompting``, turns from ``engines.acting``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from hieragent.engines.acting import Agent, act
from hieragent.engines.prompting import Dialogue, executor_state, planner_state, retrieval_query, retrieve
from hieragent.envs.guards import ended_by_loop
from hieragent.envs.pool import EnvPool
from hieragent.sampling import Randomness, rows_of
from hieragent.types import Trajectory, Turn


@dataclass
class RolloutSettings:
    """How episodes are played.

    Attributes:
        hierarchical: Planner + executor; ``False`` is the flat executor-only baseline.
        max_subgoal_steps: Executor steps after which the planner is asked again (k).
        intrinsic_reward: Added to the executor's reward on the step that achieves its subgoal.
        retrieval_candidates: FAISS top-n the retrieval samples from.
        retrieval_k: Skills shown in the planner prompt.
        retrieval_temperature: Softmax temperature over adapted similarities.
        learn_retrieval: Sample the retrieval and train the query adapter with the
            planner's RL signal; ``False`` is a plain top-k.
        history: Each role's last ``history`` turns of the episode in its prompt, as chat
            turns (0: the current view only). The engine carries their KV cache over.
    """

    hierarchical: bool = True
    max_subgoal_steps: int = 8
    intrinsic_reward: float = 0.5
    retrieval_candidates: int = 8
    retrieval_k: int = 2
    retrieval_temperature: float = 0.1
    learn_retrieval: bool = True
    history: int = 0

    def __post_init__(self) -> None:
        if self.history < 0:
            raise ValueError(f"rollout.history must be >= 0, got {self.history}")


@dataclass
class _EnvState:
    trajectory: Trajectory
    observation: object
    subgoal: str = ""
    segment: int = 0
    segment_steps: int = 0
    needs_plan: bool = True
    plan_turn: Turn | None = None
    planner_feedback: str = ""
    executor_feedback: str = ""
    dialogues: dict = field(default_factory=lambda: {"planner": Dialogue(), "executor": Dialogue()})


def collect(
    pool: EnvPool,
    seeds: list[int],
    groups: list[int],
    agent: Agent,
    settings: RolloutSettings,
    greedy: bool = False,
    generator: Randomness = None,
    on_step: Callable[[int], None] | None = None,
) -> list[Trajectory]:
    """Play one episode per env of ``pool`` (``len(seeds) == len(pool)``) to the end.

    Episodes whose env failed (raised, or its worker hung or died: ``pool.failed``) are
    dropped from the result, so a batch can hold fewer trajectories than envs; the pool
    counts them in ``pool.dropped_episodes``. Every turn records the version
    ``agent.engine`` served. ``generator``: one stream for the batch, or one per env
    (``hieragent.sampling``), so that each episode samples from its own.
    """
    if len(seeds) != len(pool) or len(groups) != len(pool):
        raise ValueError(f"collect needs one seed and group per env: {len(pool)} envs, "
                         f"{len(seeds)} seeds, {len(groups)} groups")
    hierarchical = settings.hierarchical and agent.planner is not None
    observations = pool.reset(seeds)
    states = [
        _EnvState(Trajectory(group=g, seed=s, mission=o.mission), o, subgoal=o.mission,
                  needs_plan=hierarchical)
        for s, g, o in zip(seeds, groups, observations)
    ]
    active = [i for i in range(len(pool)) if i not in pool.failed]
    try:
        while active:
            if hierarchical:
                _planner_turns(pool, states, [i for i in active if states[i].needs_plan], agent,
                               settings, greedy, generator)
            _executor_turns(pool, states, active, agent, settings, hierarchical, greedy, generator)
            ended = [i for i in active if states[i].trajectory.turns[-1].done or i in pool.failed]
            agent.engine.end_episodes([_episode(states[i]) for i in ended])
            active = [i for i in active if i not in ended]
            if on_step is not None:
                on_step(len(pool) - len(active))
    finally:
        agent.engine.end_episodes([_episode(s) for s in states])
    return [s.trajectory for i, s in enumerate(states) if i not in pool.failed]


def _episode(state: _EnvState) -> tuple[int, int]:
    return (id(state), state.trajectory.seed)  # unique while the state lives


def _planner_turns(pool, states, idx, agent, settings, greedy, generator) -> None:
    planner = agent.planner
    if planner.mode == "score":
        # nothing to choose from (e.g. a TextWorld room with no subgoal yet): no planner
        # turn; the executor works from the mission until the planner is asked again
        empty = [i for i in idx if not states[i].observation.subgoals]
        pool.set_subgoals({i: None for i in empty})
        for i in empty:
            state = states[i]
            state.subgoal, state.plan_turn = state.observation.mission, None
            state.needs_plan, state.segment_steps = False, 0
        idx = [i for i in idx if states[i].observation.subgoals]
    if not idx:
        return
    queries = [retrieval_query(states[i].observation.mission, states[i].observation.text) for i in idx]
    picked = retrieve(agent.bank, planner.query_adapter, queries, settings, greedy, rows_of(generator, idx))
    options = [states[i].observation.subgoals for i in idx]
    show = options if planner.mode == "generate" else [None] * len(idx)
    built = [agent.prompter.planner_prompt(states[i].observation.mission, states[i].observation.text,
                                           picked[j][0], show[j], states[i].planner_feedback, pool.world(i),
                                           states[i].dialogues["planner"]) for j, i in enumerate(idx)]
    turns = _act(agent, planner, states, idx, options, built, greedy, generator)
    retrievals = [r for _, r in picked]
    feedback = pool.set_subgoals({i: t.text for i, t in zip(idx, turns)})
    for j, (i, turn) in enumerate(zip(idx, turns)):
        state = states[i]
        turn.segment, turn.retrieval = state.segment, retrievals[j]
        # the state, not the prompt: retrieved skills and feedback are left out (GiGPO anchors)
        turn.state_key = planner_state(state.observation.mission, state.observation.text)
        turn.observation = state.observation.text
        state.trajectory.turns.append(turn)
        state.plan_turn, state.subgoal = turn, turn.text
        state.needs_plan, state.segment_steps = False, 0
        # an ungrounded subgoal still gets its segment (it cannot complete), so the
        # episode always moves on; the planner sees the feedback next time
        state.planner_feedback = feedback.get(i, "")
        if state.planner_feedback:
            state.trajectory.invalid_actions += 1
            turn.reward -= pool.invalid_penalty(i)


def _act(agent, policy, states, idx, options, built, greedy, generator) -> list[Turn]:
    """The engine's turns on the ``(prompt, user block)`` pairs ``built``, and each episode's
    dialogue of this role extended by them (``rollout.history``)."""
    turns = act(agent.engine, policy, [p for p, _ in built], options,
                [_episode(states[i]) for i in idx], greedy, rows_of(generator, idx))
    for (_, user), i, turn in zip(built, idx, turns):
        agent.prompter.remember(states[i].dialogues[policy.role], user, turn.action_ids)
    return turns


def _executor_turns(pool, states, idx, agent, settings, hierarchical, greedy, generator) -> None:
    executor = agent.executor
    options = [states[i].observation.actions for i in idx]
    show = options if executor.mode == "generate" else [None] * len(idx)
    built = [agent.prompter.executor_prompt(states[i].subgoal, states[i].observation.text, show[j],
                                            states[i].executor_feedback, pool.world(i),
                                            states[i].dialogues["executor"]) for j, i in enumerate(idx)]
    turns = _act(agent, executor, states, idx, options, built, greedy, generator)
    results = pool.step({i: t.text for i, t in zip(idx, turns)})
    for i, turn in zip(idx, turns):
        state, result = states[i], results[i]
        trajectory = state.trajectory
        turn.state_key = executor_state(state.subgoal, state.observation.text)  # pre-step view
        turn.observation = state.observation.text
        achieved = hierarchical and result.subgoal_done
        turn.reward = result.reward + (settings.intrinsic_reward if achieved else 0.0)
        turn.segment, turn.done = state.segment, result.done
        trajectory.turns.append(turn)
        trajectory.length += 1
        trajectory.env_return += result.reward
        trajectory.invalid_actions += int(result.invalid)
        trajectory.subgoals_done += int(achieved)
        trajectory.loop_ended = ended_by_loop(result)
        if state.plan_turn is not None:
            state.plan_turn.reward += result.reward  # the segment's extrinsic return
        state.observation, state.executor_feedback = result.observation, result.feedback
        state.segment_steps += 1
        if result.done:
            trajectory.success = result.success
            if state.plan_turn is not None:
                state.plan_turn.done = True
        elif hierarchical and (achieved or state.segment_steps >= settings.max_subgoal_steps):
            state.needs_plan = True
            state.segment += 1
