"""ScienceWorld's expert: the gold action sequence of each variation (source ``scienceworld-gold``).

The expert is the simulator's gold action sequence, played to the task's completion (it often
has a few actions left over). ``expert_segments`` cuts it like the
TextWorld walkthrough: a run of moves becomes ``go to the <room>``, each other command that
changes the world becomes its own subgoal, and look/read/wait/inventory commands are carried
into the next segment; whatever is left when the task completes is ``complete the task``.
"""

from __future__ import annotations

import logging

from hieragent.envs.base import normalize
from hieragent.envs.scienceworld import FINISH, ScienceWorldEnv, is_info, is_move

logger = logging.getLogger(__name__)


def expert_segments(env: ScienceWorldEnv) -> list[tuple[str, list[str]]]:
    """The gold path of the episode ``env`` has just reset to, as (subgoal, actions) segments
    (``cut_segments``); ``[]`` if the gold path does not complete the task.

    Plays the gold path once to see where it completes the task and which room each step
    leaves the agent in, then resets ``env`` to the episode's start.
    """
    seed, success = env.seed, False
    steps: list[tuple[str, str]] = []  # (action, room after it)
    for action in env.gold_path(seed):
        result = env.step(action)
        steps.append((action, env.room))
        if result.done:
            success = result.success
            break
    env.reset(seed)
    return cut_segments(steps, env.room) if success else []


def cut_segments(steps: list[tuple[str, str]], room: str) -> list[tuple[str, list[str]]]:
    """Cut ``steps``, (action, room after it) pairs from ``room`` up to the task's completion,
    into (subgoal, actions) segments whose subgoal completes on the segment's last action.

    A run of moves becomes ``go to the <room>``, ending where the run first reaches its last
    room; a round trip after that is carried into the next segment. An ambiguous command and
    the number that answers it are one unit. Any other command that changes the world is its
    own subgoal; look/read/wait/inventory commands are carried into the next segment, and
    those left at the end become ``complete the task``.
    """
    segments: list[tuple[str, list[str]]] = []
    carried: list[str] = []
    i = 0
    while i < len(steps):
        action = steps[i][0]
        if is_move(action):
            rooms, j = [room], i  # the run of moves, with the room after each
            while j < len(steps) and (is_move(steps[j][0]) or steps[j][0].isdigit()):
                rooms.append(steps[j][1])
                j += 1
            moves, room = [a for a, _ in steps[i:j]], rooms[-1]
            first = rooms.index(room)  # 0: the run ends where it began
            if first > 0:
                segments.append((f"go to the {room}", carried + moves[:first]))
                carried = []
            carried += moves[first:]
            i = j
            continue
        answered = i + 1 < len(steps) and steps[i + 1][0].isdigit()
        carried += [action] + ([steps[i + 1][0]] if answered else [])
        if not is_info(action):
            segments.append((normalize(action), carried))
            carried = []
        i += 2 if answered else 1
    if carried:
        segments.append((FINISH, carried))
    return segments


# The expert's env (one Java process), kept for its next call on the same task and step cap.
_EXPERT_ENV: dict[tuple[str, int | None], ScienceWorldEnv] = {}


def expert_episode(name: str, seed: int, max_steps: int | None = None) -> tuple[bool, int]:
    """Play the gold path of ``seed``; returns ``(success, length)``. A simulator that dies or
    hangs fails the episode (logged), so that one bad variation does not end a whole table."""
    env = _EXPERT_ENV.get((name, max_steps))
    if env is None:
        for old in _EXPERT_ENV.values():
            old.close()
        _EXPERT_ENV.clear()
        env = _EXPERT_ENV[(name, max_steps)] = ScienceWorldEnv(name, max_steps=max_steps)
    length = 0
    try:
        for action in env.gold_path(seed):
            result = env.step(action)
            length += 1
            if result.done:
                return result.success, length
    except RuntimeError as exc:
        logger.warning("%s seed %d: expert episode failed: %s", name, seed, exc)
    return False, length
