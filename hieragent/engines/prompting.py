"""Prompts as token ids, and the planner's retrieval: the one place either is built.

The rollout, evaluation and the warm start all build their prompts here, so the ids a
policy is trained on are the ids it acted on. A prompt is the chat template over the
role's system text (for the env family's world) and one user message. With a history
window (``rollout.history: N``) the role's last ``N`` turns of the episode come before it,
as ``user, assistant`` pairs; the prompt is then built by appending token blocks (the
previous prompt, the reply as generated, the template's glue, the new user block), so the
next prompt extends the last one token for token and the engine's KV cache carries over.
When the window slides, the oldest pair drops out and the prompt is rebuilt from the same
blocks; the engine then reuses the system block only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from hieragent.agents.prompts import EXECUTOR_SYSTEM, PLANNER_SYSTEM, executor_text, planner_text, system_text
from hieragent.memory.retrieval import sample_retrievals
from hieragent.sampling import Randomness
from hieragent.types import Role

SYSTEMS: dict[str, str] = {"planner": PLANNER_SYSTEM, "executor": EXECUTOR_SYSTEM}
_PROBE = ("Mission: probe", "go forward")


@dataclass
class Dialogue:
    """One role's past turns in one episode: ``(user block ids, reply ids + glue)`` pairs."""

    turns: list[tuple[list[int], list[int]]] = field(default_factory=list)


class Prompter:
    """Builds prompt ids for both roles from a tokenizer's chat template.

    Args:
        tokenizer: The policy LM's tokenizer (with a chat template).
        history: Past turns of the same role shown in the prompt (0: none).
    """

    def __init__(self, tokenizer, history: int = 0) -> None:
        if history < 0:
            raise ValueError(f"rollout.history must be >= 0, got {history}")
        self.tokenizer, self.history = tokenizer, history
        self._system: dict[tuple[str, str | None], list[int]] = {}
        if history:
            self._glue = self._derive_glue()

    def _template(self, messages: list[dict], **kw) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **kw)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _derive_glue(self) -> list[int]:
        """The template's tokens between an assistant reply's end-of-turn and the next user
        block, checked once: appending blocks must give the template's own ids."""
        user, reply = _PROBE
        system = {"role": "system", "content": "probe"}
        one = self._template([system, {"role": "user", "content": user}], add_generation_prompt=True)
        two = self._template([system, {"role": "user", "content": user},
                              {"role": "assistant", "content": reply},
                              {"role": "user", "content": user}], add_generation_prompt=True)
        head = one + self._encode(reply) + [self.tokenizer.eos_token_id]
        start = self._template([system])
        block = one[len(start):]
        if one[: len(start)] != start or two[: len(head)] != head or two[-len(block):] != block:
            raise ValueError("rollout.history needs a chat template whose turns tokenize as separate "
                             "blocks (ChatML-like); this tokenizer's does not")
        glue = two[len(head): len(two) - len(block)]
        if head + glue + block != two:
            raise ValueError("rollout.history: the chat template's multi-turn ids are not the "
                             "concatenation of its turns; use rollout.history: 0")
        return glue

    def system_ids(self, role: Role, world: str | None) -> list[int]:
        key = (role, world)
        if key not in self._system:
            system = system_text(SYSTEMS[role], world)
            self._system[key] = self._template([{"role": "system", "content": system}])
        return self._system[key]

    def prompt(self, role: Role, text: str, world: str | None = None,
               dialogue: Dialogue | None = None) -> tuple[list[int], list[int]]:
        """The prompt ids of ``text`` for ``role`` in an env of ``world`` (its family's
        ``TextEnv.world``; ``None``: BabyAI's), after the dialogue's last ``history`` turns.

        Returns the prompt and its new user block (for ``remember``).
        """
        system = system_text(SYSTEMS[role], world)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        plain = self._template(messages, add_generation_prompt=True)
        start = self.system_ids(role, world)
        user = plain[len(start):]
        if not self.history or dialogue is None or not dialogue.turns:
            return plain, user
        if plain[: len(start)] != start:
            raise ValueError(f"rollout.history: the {role} prompt does not start with its system block")
        past = [tok for u, r in dialogue.turns[-self.history:] for tok in (*u, *r)]
        return start + past + user, user

    def planner_prompt(self, mission: str, observation: str, skills: list[str], options: list[str] | None,
                       feedback: str = "", world: str | None = None,
                       dialogue: Dialogue | None = None) -> tuple[list[int], list[int]]:
        """The planner's prompt: mission, view, retrieved skills, feedback, (generate mode) options."""
        return self.prompt("planner", planner_text(mission, observation, skills, options, feedback), world, dialogue)

    def executor_prompt(self, subgoal: str, observation: str, options: list[str] | None,
                        feedback: str = "", world: str | None = None,
                        dialogue: Dialogue | None = None) -> tuple[list[int], list[int]]:
        """The executor's prompt: its subgoal, the view, feedback, (generate mode) options."""
        return self.prompt("executor", executor_text(subgoal, observation, options, feedback), world, dialogue)

    def remember(self, dialogue: Dialogue, user: list[int], reply: list[int]) -> None:
        """Append a turn: its user block and the reply's ids as acted (end-of-turn added if
        the reply ran out of tokens), then the template's glue."""
        if not self.history:
            return
        eos = self.tokenizer.eos_token_id
        ending = [] if reply and reply[-1] == eos else [eos]
        dialogue.turns.append((user, [*reply, *ending, *self._glue]))
        del dialogue.turns[: -self.history]


def planner_state(mission: str, observation: str) -> str:
    """The planner's state key (``Turn.state_key``): its prompt text without skills, feedback
    or options, so that equal states compare equal (GiGPO anchors, the value head)."""
    return planner_text(mission, observation, [], None)


def executor_state(subgoal: str, observation: str) -> str:
    """The executor's state key: subgoal and view."""
    return executor_text(subgoal, observation, None)


def retrieval_query(mission: str, observation: str) -> str:
    """What the planner's retrieval embeds: the mission and the current view."""
    return f"{mission}. {observation}"


def retrieve(bank, query_adapter, queries: list[str], settings, greedy: bool = False,
             generator: Randomness = None) -> list[tuple[list[str], object]]:
    """Skills to show per query, and the retrieval to train on (``None`` if not learned).

    ``settings`` is the ``RolloutSettings``: top-``retrieval_candidates`` from FAISS, ``k``
    sampled without replacement from the adapted-similarity softmax (or the top-``k`` when
    ``greedy`` or when the retrieval is not learned).
    """
    if bank is None or len(bank) == 0 or not queries:
        return [([], None) for _ in queries]
    picked = sample_retrievals(bank, query_adapter, queries, n=settings.retrieval_candidates,
                               k=settings.retrieval_k, temperature=settings.retrieval_temperature,
                               generator=generator, greedy=greedy or not settings.learn_retrieval)
    return [(texts, retrieval if settings.learn_retrieval else None) for texts, retrieval in picked]
