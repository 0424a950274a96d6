"""Prompt text for the planner and the executor, kept short: every token is CPU time."""

from __future__ import annotations

# System prompts, templates: ``system_text`` fills in the env family's ``TextEnv.world``.
PLANNER_SYSTEM = "You are the planner of an agent in {world}. Reply with the next subgoal."
EXECUTOR_SYSTEM = "You control an agent in {world}. Reply with the next action."
# BabyAI's world, the default: callers that name no env get the prompt the README's
# learning figures were measured on.
DEFAULT_WORLD = "a grid world"


def system_text(template: str, world: str | None = None) -> str:
    """``template`` (``PLANNER_SYSTEM`` or ``EXECUTOR_SYSTEM``) for an env of ``world``."""
    return template.format(world=DEFAULT_WORLD if world is None else world)


def planner_text(mission: str, observation: str, skills: list[str], options: list[str] | None,
                 feedback: str = "") -> str:
    """The planner sees the mission, the view, retrieved skills and (generate mode) options."""
    lines = [f"Mission: {mission}", observation]
    if skills:
        lines.append("Skills: " + " | ".join(skills))
    if feedback:
        lines.append(f"Note: {feedback}")
    if options:
        lines.append("Subgoals: " + ", ".join(options))
    return "\n".join(lines)


def executor_text(subgoal: str, observation: str, options: list[str] | None,
                  feedback: str = "") -> str:
    """The executor sees only its subgoal and the view (the mission reaches it via the planner)."""
    lines = [f"Subgoal: {subgoal}", observation]
    if feedback:
        lines.append(f"Note: {feedback}")
    if options:
        lines.append("Actions: " + ", ".join(options))
    return "\n".join(lines)
