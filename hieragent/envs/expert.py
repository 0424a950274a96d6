"""minigrid's scripted BabyAI bot, driving a BabyAITextEnv through its text actions.

Why: an upper bound for success rates and lengths, and a policy that reaches subgoals on
purpose in tests. Driving the text env (not raw minigrid) also checks the action mapping.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

from minigrid.utils.baby_ai_bot import BabyAIBot, DisappearedBoxError

from hieragent.envs.babyai import ACTIONS, BabyAITextEnv


def expert_action(bot: BabyAIBot) -> str | None:
    """The bot's next action as a BabyAI-Text word; ``None`` when it believes it is done.

    Call once per step, after the previous action was taken (the bot assumes it was its own).
    """
    action = int(bot.replan())
    return ACTIONS[action] if action < len(ACTIONS) else None  # 6 is minigrid's "done"


def expert_episode(level: str, seed: int, max_steps: int | None = None) -> tuple[bool, int]:
    """Run the bot for one episode; returns ``(success, length)``."""
    env = BabyAITextEnv(level, max_steps=max_steps)
    env.reset(seed)
    bot = BabyAIBot(env.unwrapped)
    length = 0
    while True:
        try:
            action = expert_action(bot)
        except DisappearedBoxError:  # a box was toggled open; the bot cannot recover
            return False, length
        if action is None:  # the bot gave up or thinks it is done, but the env did not end
            return False, length
        result = env.step(action)
        length += 1
        if result.done:
            return result.success, length


def expert_success_rate(level: str, seeds: Iterable[int], max_steps: int | None = None) -> float:
    """Fraction of ``seeds`` on which the bot accomplishes the mission."""
    outcomes = [expert_episode(level, s, max_steps)[0] for s in seeds]
    return sum(outcomes) / len(outcomes) if outcomes else 0.0


# ---- demonstrations: the bot's episode cut into subgoal segments ----------------------

def expert_segments(env: BabyAITextEnv, seed: int) -> list[tuple[str, list[str]]]:
    """The bot's episode on ``seed`` as ``(subgoal, actions)`` segments in the env's grammar.

    The bot's own subgoal stack speaks of grid positions, so the episode is cut where one
    of our subgoals completes instead: an object picked up, dropped (or put next to
    another), a door opened, or, at the end of a GoTo mission, the target faced. While a
    segment's subgoal is not yet among the planner's candidates (its object unseen), an
    ``explore`` segment goes first if exploring completes before the segment ends, so the
    planner's choice was open to it. On a fresh ``reset(seed)``, ``set_subgoal`` of each
    subgoal is accepted and ``subgoal_done`` comes on the last action of its segment.

    Returns ``[]`` when the bot fails, or succeeds with a last step that no subgoal names.
    """
    env.reset(seed)
    bot = BabyAIBot(env.unwrapped)
    actions: list[str] = []
    ends: list[tuple[str, int]] = []  # (subgoal completed, index of the completing action)
    while True:
        try:
            action = expert_action(bot)
        except DisappearedBoxError:
            return []
        if action is None:
            return []
        before = _snapshot(env)
        result = env.step(action)
        actions.append(action)
        label = _completed(env, before, result.success)
        if label is not None:
            ends.append((label, len(actions) - 1))
        if result.done:
            break
    if not result.success or not ends or ends[-1][1] != len(actions) - 1:
        return []
    return _replay_with_exploration(env, seed, actions, ends)


def _snapshot(env: BabyAITextEnv) -> tuple:
    u = env.unwrapped
    carrying = (u.carrying.color, u.carrying.type) if u.carrying is not None else None
    closed = {id(o) for o in u.grid.grid if o is not None and o.type == "door" and not o.is_open}
    return carrying, closed


def _completed(env: BabyAITextEnv, before: tuple, success: bool) -> str | None:
    """Which of our subgoals the step just taken completed, if any."""
    u = env.unwrapped
    carried, closed = before
    now = (u.carrying.color, u.carrying.type) if u.carrying is not None else None
    if now is not None and now != carried:
        return f"pick up the {now[0]} {now[1]}"
    if carried is not None and now is None:
        return _drop_label(env, carried)
    opened = [o for o in u.grid.grid if o is not None and id(o) in closed and o.is_open]
    if opened:
        return f"open the {opened[0].color} door"
    front = u.grid.get(*u.front_pos)
    if success and front is not None:
        return f"go to the {front.color} {front.type}"
    return None


def _drop_label(env: BabyAITextEnv, carried: tuple[str, str]) -> str:
    """``put the X next to the Y`` when the mission asks for that and Y is adjacent, else a drop."""
    u = env.unwrapped
    x, y = u.front_pos  # a drop lands in the cell in front
    mission = str(u.mission)
    if "next to" in mission:
        wanted = mission.split("next to", 1)[1]
        for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            o = u.grid.get(x + dx, y + dy)
            if o is not None and o.type != "wall" and o.type in wanted:
                return f"put the {carried[0]} {carried[1]} next to the {o.color} {o.type}"
    return f"drop the {carried[0]} {carried[1]}"


def _replay_with_exploration(env: BabyAITextEnv, seed: int, actions: list[str],
                             ends: list[tuple[str, int]]) -> list[tuple[str, list[str]]]:
    env.reset(seed)
    segments: list[tuple[str, list[str]]] = []
    start = 0
    for label, end in ends:
        while start <= end:
            if label not in env.observation().subgoals:
                done_at = _explore_done_at(env, actions, start, end)
                if done_at is not None:
                    segments.append(_play(env, "explore", actions[start:done_at + 1]))  # type: ignore[arg-type]
                    start = done_at + 1
                    continue
            segment = _play(env, label, actions[start:end + 1])
            if segment is None:
                return []  # not expected for these events; refuse rather than mislabel
            segments.append(segment)
            start = end + 1
    return segments


def _explore_done_at(env: BabyAITextEnv, actions: list[str], start: int, end: int) -> int | None:
    """Index before ``end`` at which ``explore`` set at ``start`` would complete, if any."""
    trial = copy.deepcopy(env)
    if trial.set_subgoal("explore"):
        return None
    for k in range(start, end):
        if trial.step(actions[k]).subgoal_done:
            return k
    return None


def _play(env: BabyAITextEnv, subgoal: str, actions: list[str]) -> tuple[str, list[str]] | None:
    """Set ``subgoal`` and take ``actions`` on the live env; ``None`` if it was refused."""
    if env.set_subgoal(subgoal):
        return None
    for action in actions:
        env.step(action)
    return subgoal, actions
