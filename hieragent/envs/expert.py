"""minigrid's scripted BabyAI bot, driving a BabyAITextEnv through its text actions.

Why: an upper bound for success rates and lengths, and a policy that reaches subgoals on
purpose in tests. Driving the text env (not raw minigrid) also checks the action mapping.
"""

from __future__ import annotations

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
