"""The data that travels between stages: observations, turns, trajectories and batches.

This is the only module that defines shared dataclasses. Every stage takes and returns
these; no stage reaches into another stage's internals.

Conventions (the same names everywhere):
  * ``logprobs``      log-probabilities under the policy being trained
  * ``old_logprobs``  behaviour log-probabilities, recorded at rollout time
  * ``mask``          1 for positions that count, 0 for padding
  * ``advantages``    one float per turn, shared by all of the turn's tokens
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

Role = Literal["planner", "executor"]
ROLES: tuple[Role, ...] = ("planner", "executor")


@dataclass
class Observation:
    """What an environment shows the agent after ``reset`` or ``step``.

    Attributes:
        mission: The episode's instruction, e.g. ``"go to the red ball"``.
        text: A text description of what the agent perceives now.
        actions: Admissible primitive actions as words (the executor's candidates).
        subgoals: Subgoals that can be grounded in the current view (the planner's candidates).
    """

    mission: str
    text: str
    actions: list[str]
    subgoals: list[str]


@dataclass
class StepResult:
    """One environment transition.

    Attributes:
        observation: The observation after the action.
        reward: Extrinsic environment reward for this step (penalties included).
        done: Whether the episode ended (success, failure or truncation).
        success: Whether the episode ended with the mission accomplished.
        subgoal_done: Whether the executor's current subgoal was achieved by this step.
        invalid: Whether the action could not be parsed or grounded; the env did not move.
        feedback: A short message for the agent when the action was invalid, else ``""``.
    """

    observation: Observation
    reward: float
    done: bool
    success: bool = False
    subgoal_done: bool = False
    invalid: bool = False
    feedback: str = ""


@dataclass(eq=False)
class Retrieval:
    """A stochastic memory retrieval that is part of a planner turn.

    The query adapter maps ``query`` into the key space; the choice is a softmax over the
    adapted similarities to ``keys`` with ``temperature``, sampled without replacement.
    Keys are copied in so that the log-probability can be recomputed after the bank moved on.

    Attributes:
        query: Frozen encoder embedding of the query text. ``[D]`` float32
        keys: Candidate key embeddings, as stored in the bank. ``[N, D]`` float32
        entry_ids: Bank ids of the N candidates.
        chosen: Positions in ``0..N-1`` of the chosen entries, in the order they were drawn.
        old_logprob: Log-probability of that ordered choice under the behaviour adapter.
        temperature: Softmax temperature used for the choice.

    ``query`` and ``keys`` are numpy arrays (lists are converted: a checkpoint stores lists);
    equality compares their values.
    """

    query: np.ndarray
    keys: np.ndarray
    entry_ids: list[int]
    chosen: list[int]
    old_logprob: float
    temperature: float

    def __post_init__(self) -> None:
        self.query = np.asarray(self.query, dtype=np.float32).reshape(-1)
        keys = np.asarray(self.keys, dtype=np.float32)
        if keys.ndim != 2:  # [] (no candidates, or a summary's emptied vectors)
            d = len(self.query)
            keys = keys.reshape(keys.size // d if d else 0, d)
        self.keys = keys

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Retrieval):
            return NotImplemented
        return (np.array_equal(self.query, other.query) and np.array_equal(self.keys, other.keys)
                and (self.entry_ids, self.chosen, self.old_logprob, self.temperature)
                == (other.entry_ids, other.chosen, other.old_logprob, other.temperature))

    def plain(self) -> dict:
        """The fields as JSON-able lists (what a checkpoint stores)."""
        return {"query": self.query.tolist(), "keys": self.keys.tolist(), "entry_ids": list(self.entry_ids),
                "chosen": list(self.chosen), "old_logprob": self.old_logprob, "temperature": self.temperature}


@dataclass
class Turn:
    """One output of the planner or of the executor, with everything training needs.

    Token ids are carried from rollout into training as they are, never re-derived.

    ``score`` mode: ``candidate_ids`` holds the token ids of every candidate string and
    ``chosen`` the index sampled; ``old_logprobs`` has one entry, the log-probability of the
    chosen candidate under the candidate softmax. ``generate`` mode: ``action_ids`` are the
    sampled tokens and ``old_logprobs`` their per-token behaviour log-probabilities.

    Attributes:
        role: ``"planner"`` or ``"executor"``.
        prompt_ids: Token ids of the prompt the policy saw.
        action_ids: Token ids of the output (the chosen candidate in score mode).
        old_logprobs: Behaviour log-probabilities (see above).
        text: The output as text (subgoal or action).
        reward: Reward credited to this turn before advantage estimation.
        done: Whether the episode ended after this turn.
        policy_version: Optimizer step of the weights that produced the turn.
        candidate_ids: Score mode only: token ids of every candidate.
        chosen: Score mode only: index of the chosen candidate, else ``-1``.
        segment: Index of the planner segment this turn belongs to.
        retrieval: The memory retrieval made in this turn (planner only), if any.
        state_key: A string that is equal for turns taken in identical states, set by the
            rollout: planner, mission and view; executor, subgoal and view (no skills, no
            feedback). A partial view can alias two env states. GiGPO's anchor states and
            the value head's features use it; ``""`` means unknown.
        trainer_logprobs: The trainer's own recomputation of ``old_logprobs`` at the rollout
            weights, when truncated IS asks for it (the engine's can differ at equal weights).
        advantage: Filled in by the objectives stage.
        observation: The observation text the turn was taken in (skill and lesson
            distillation quote it as the episode's key observation).
    """

    role: Role
    prompt_ids: list[int]
    action_ids: list[int]
    old_logprobs: list[float]
    text: str
    reward: float = 0.0
    done: bool = False
    policy_version: int = 0
    candidate_ids: list[list[int]] | None = None
    chosen: int = -1
    segment: int = 0
    retrieval: Retrieval | None = None
    state_key: str = ""
    trainer_logprobs: list[float] | None = None
    advantage: float = 0.0
    observation: str = ""


@dataclass
class Trajectory:
    """One episode: its turns in order and its outcome.

    Attributes:
        turns: Planner and executor turns, in the order they happened.
        group: Id of the GRPO group (rollouts that share an env seed share a group).
        seed: The environment seed of the episode.
        mission: The episode's mission.
        success: Whether the mission was accomplished.
        env_return: Sum of extrinsic rewards.
        length: Number of environment steps.
        invalid_actions: Number of actions that could not be parsed or grounded.
        subgoals_done: Number of planner subgoals the executor achieved.
        loop_ended: Whether the loop guard ended the episode (a run of repeated actions).
    """

    turns: list[Turn] = field(default_factory=list)
    group: int = 0
    seed: int = 0
    mission: str = ""
    success: bool = False
    env_return: float = 0.0
    length: int = 0
    invalid_actions: int = 0
    subgoals_done: int = 0
    loop_ended: bool = False

    def of(self, role: Role) -> list[Turn]:
        return [t for t in self.turns if t.role == role]

    def summary(self) -> Trajectory:
        """A copy without token ids, log-probs or retrieval vectors: what the bank's evolution
        reads of an episode, small enough to send to every rank."""
        def light(turn: Turn) -> Turn:
            r = turn.retrieval
            return replace(turn, prompt_ids=[], action_ids=[], old_logprobs=[], candidate_ids=None,
                           trainer_logprobs=None,
                           retrieval=None if r is None else replace(r, query=[], keys=[]))

        return replace(self, turns=[light(t) for t in self.turns])


@dataclass
class Batch:
    """A set of trajectories collected together, the unit a training step consumes.

    Attributes:
        trajectories: The episodes.
        policy_version: Optimizer step of the weights that collected them.
    """

    trajectories: list[Trajectory]
    policy_version: int = 0

    def turns(self, role: Role | None = None) -> list[Turn]:
        return [t for tr in self.trajectories for t in tr.turns if role is None or t.role == role]


@dataclass
class PlannerStep:
    """One planner decision of a demonstration: what it saw and the subgoal it chose.

    Attributes:
        observation: The env's text when the subgoal was chosen.
        candidates: The subgoals the env offered then (``Observation.subgoals``).
        subgoal: The expert's subgoal (it may be missing from ``candidates``).
    """

    observation: str
    candidates: list[str]
    subgoal: str


@dataclass
class ExecutorStep:
    """One executor decision of a demonstration.

    Attributes:
        subgoal: The subgoal being pursued (the mission in a flat run).
        observation: The env's text before the action.
        candidates: The admissible actions then (``Observation.actions``).
        action: The expert's action.
    """

    subgoal: str
    observation: str
    candidates: list[str]
    action: str


@dataclass
class Demonstration:
    """An expert episode, one JSONL line of a demonstrations file (``hieragent.rollout.demos``).

    Attributes:
        env: Env name, e.g. ``BabyAI-GoToLocal-v0``.
        seed: Env seed; ``reset(seed)`` and the actions below replay the episode exactly.
        mission: The episode's mission.
        source: Which expert: ``babyai-bot``, ``textworld-walkthrough`` or ``planner-search``.
        success: Whether the episode accomplished the mission (only successes are written).
        length: Env steps.
        planner: One entry per subgoal, in order.
        executor: One entry per action, in order; ``subgoal`` ties each to its segment.
    """

    env: str
    seed: int
    mission: str
    source: str
    success: bool
    length: int
    planner: list[PlannerStep] = field(default_factory=list)
    executor: list[ExecutorStep] = field(default_factory=list)
