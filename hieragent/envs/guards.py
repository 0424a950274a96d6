"""A guard that ends a stuck episode early: the loop detector, as a ``TextEnv`` wrapper.

Why: a policy in training often settles into a loop (spinning on the spot, turning left and
right, walking into a wall, repeating one invalid string) and then burns the rest of the
step budget on turns that teach nothing. Ending such an episode early, with a penalty,
saves rollout time and gives the loop a cost of its own.

No length cap lives here: ``TextEnv.max_steps`` is the cap, and ``BabyAITextEnv`` already
ends every episode there (invalid steps count, and ``max_steps=`` overrides the level's own).
"""

from __future__ import annotations

from dataclasses import replace

from hieragent.envs.base import TextEnv, normalize, quote
from hieragent.types import Observation, StepResult

# Every feedback the guard writes starts with this, so a caller can tell a loop ending
# from the env's own ending across a process boundary (see ``ended_by_loop``).
LOOP_FEEDBACK = "episode ended: repeated "


def ended_by_loop(result: StepResult) -> bool:
    """Whether ``result`` is a step that ``LoopGuard`` turned into the episode's end."""
    return result.feedback.startswith(LOOP_FEEDBACK)


class LoopGuard(TextEnv):
    """Wraps an env and ends its episode when the agent keeps repeating itself.

    The rule, checked after every step that did not end the episode by itself: take the
    pairs ``(normalize(action), observation.text after the step)`` of the last ``repeats``
    steps since ``reset``. If that window is periodic with a period ``d <= max_period`` and
    ``2 * d <= repeats`` (``window[j] == window[j - d]`` for every ``j >= d``, so the cycle
    is seen at least twice), the step becomes the episode's end: ``done=True``,
    ``success=False``, ``reward`` = the step's own reward minus ``penalty``, and
    ``feedback`` = ``"episode ended: repeated 'turn left' 8 times"`` (one action) or
    ``"episode ended: repeated the cycle 'turn left', 'turn right' for 8 steps"``
    (``ended_by_loop`` recognises both). It fires on exactly the ``repeats``-th step of a
    loop, never before. Period 1 is an action that changes nothing visible (a wall, an
    invalid string), period 2 an action and its undoing, period 4 spinning on the spot.

    The observation is part of each pair so that progress is never a loop: ``go forward``
    down a room changes the view every step. A corridor longer than the view with nothing
    in it would look the same at every step, so keep ``repeats`` above such a corridor's
    length (8 is above the 6 free cells of a BabyAI room). Subgoal changes do not clear the
    window: a loop of actions is a loop whatever the planner asks for.

    ``set_subgoal``, ``max_steps``, ``invalid_penalty`` and every other attribute of the
    wrapped env (``unwrapped``, ``level``, ``subgoal``, ...) read through to it.

    Args:
        env: The env to guard.
        repeats: Window length K; the loop must fill it.
        max_period: Longest cycle looked for.
        penalty: Subtracted from the reward of the step that ends the episode.
    """

    def __init__(self, env: TextEnv, repeats: int = 8, max_period: int = 4, penalty: float = 1.0) -> None:
        # TextEnv.__init__ is skipped on purpose: invalid_penalty is the wrapped env's.
        if repeats < 2:
            raise ValueError(f"LoopGuard needs repeats >= 2 (a loop is seen twice), got {repeats}")
        if max_period < 1:
            raise ValueError(f"LoopGuard needs max_period >= 1, got {max_period}")
        self.env = env
        self.repeats, self.max_period, self.penalty = repeats, max_period, penalty
        self._window: list[tuple[str, str]] = []
        self._live = False

    def __getattr__(self, name: str) -> object:
        if name == "env":  # not set yet (e.g. during unpickling): never recurse
            raise AttributeError(name)
        return getattr(self.env, name)

    @property
    def invalid_penalty(self) -> float:  # type: ignore[override]
        return self.env.invalid_penalty

    @invalid_penalty.setter
    def invalid_penalty(self, value: float) -> None:
        self.env.invalid_penalty = value

    @property
    def max_steps(self) -> int:
        return self.env.max_steps

    def reset(self, seed: int) -> Observation:
        self._window = []
        observation = self.env.reset(seed)
        self._live = True
        return observation

    def set_subgoal(self, subgoal: str | None) -> str:
        self._require_live("set_subgoal")
        return self.env.set_subgoal(subgoal)

    def step(self, action: str) -> StepResult:
        self._require_live("step")
        result = self.env.step(action)
        if result.done:
            self._live = False
            return result
        self._window = (self._window + [(normalize(action), result.observation.text)])[-self.repeats:]
        period = self._period()
        if period is None:
            return result
        self._live = False
        return replace(result, done=True, success=False, reward=result.reward - self.penalty,
                       feedback=self._reason(period))

    def _require_live(self, method: str) -> None:
        # The wrapped env still thinks its episode runs after a loop ending; the guard doesn't.
        if not self._live:
            raise RuntimeError(f"LoopGuard: {method}() needs a live episode; call reset(seed) first")

    def _period(self) -> int | None:
        """The shortest period of the full window, if it has one within ``max_period``."""
        w = self._window
        if len(w) < self.repeats:
            return None
        for d in range(1, self.max_period + 1):
            if 2 * d <= len(w) and all(w[j] == w[j - d] for j in range(d, len(w))):
                return d
        return None

    def _reason(self, period: int) -> str:
        cycle = [action for action, _ in self._window[:period]]
        if len(set(cycle)) == 1:
            return f"{LOOP_FEEDBACK}{quote(cycle[0])} {self.repeats} times"
        return f"{LOOP_FEEDBACK}the cycle {', '.join(map(quote, cycle))} for {self.repeats} steps"
