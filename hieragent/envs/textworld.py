"""TextWorld games (Côté et al., arXiv:1806.11532) behind the ``TextEnv`` interface.

A seed picks a generated game of the level (see ``textworld_games``); the mission is the
quest's objective and the actions are TextWorld's admissible commands. The game only ever
receives admissible commands, so model garbage never reaches the parser and never costs a
game move. Rewards are changes of the game's score: these quests are worth one point, won
on the walkthrough's last command. (TextWorld's ``intermediate_reward`` is a different
signal, the sign of the change in the length of the winning policy; it is not used.)

Planner subgoals are ``go to the <room>`` and the admissible commands that change the
world; ``look``, ``inventory`` and ``examine ...`` change nothing, so they would be free
subgoal completions and are not subgoals.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hieragent.envs.base import TextEnv, normalize, quote
from hieragent.envs.textworld_games import LEVELS, check_level, generate, start
from hieragent.types import Observation, StepResult

if TYPE_CHECKING:
    from textworld.core import Environment

NAMES = list(LEVELS)
INFO_VERBS = ("look", "inventory", "examine")
DIRECTIONS = ("north", "south", "east", "west")
SUGGESTIONS = 3  # valid commands named in the feedback of an invalid one
_GO_TO = re.compile(r"^go to (?:the )?(.+)$")


def is_move(command: str) -> bool:
    return normalize(command).split(" ")[0] == "go"


def is_info(command: str) -> bool:
    return normalize(command).split(" ")[0] in INFO_VERBS


def clean(text: str | None) -> str:
    """Game text on one line: no prompt and status bar, no end-of-game menu, single spaces."""
    text = (text or "").split("\n>")[0]  # ">" then the status bar "-= Room =-score/moves"
    text = text.split("***")[0]  # "*** The End ***", then the RESTART / QUIT menu
    return " ".join(text.split())


@dataclass(frozen=True)
class _Subgoal:
    text: str
    room: str = ""  # go to: the target room, else ""


class TextWorldEnv(TextEnv):
    """A generated TextWorld game behind the ``TextEnv`` interface.

    Args:
        name: One of ``NAMES``; fixes the generation settings (``textworld_games.LEVELS``).
        max_steps: Step cap per episode, invalid steps included; ``None``: the level's.
        invalid_penalty: Subtracted from the reward of an invalid action.
        games_dir: Game cache; ``None``: ``<cache>/textworld`` (``$HIERAGENT_CACHE``). A game
            missing from it is generated on ``reset``, about a second.
    """

    world = "a text adventure"

    def __init__(
        self,
        name: str,
        max_steps: int | None = None,
        invalid_penalty: float = 0.1,
        games_dir: str | None = None,
    ) -> None:
        super().__init__(invalid_penalty)
        level = check_level(name)
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.name = name
        self.games_dir = games_dir
        self._max_steps = max_steps if max_steps is not None else level.max_steps
        self._tw: Environment | None = None
        self._path = ""
        self._live = False
        self._subgoal: _Subgoal | None = None
        self._state: Any = None  # TextWorld's GameState of the current step
        self.steps = 0
        self.score = 0
        self.room = ""
        self.rooms: list[str] = []  # every room of the game
        self.known: set[str] = set()  # rooms visited, or named in the mission or any text shown
        self.exits: dict[tuple[str, str], str] = {}  # (room, direction) -> room
        self._mission = ""
        self._text = ""
        self._commands: dict[str, str] = {}  # normalized -> admissible command as the game spells it

    @property
    def max_steps(self) -> int:
        return self._max_steps

    @property
    def subgoal(self) -> str | None:
        """The current subgoal; cleared when set_subgoal fails or the subgoal is achieved."""
        return self._subgoal.text if self._subgoal else None

    @property
    def walkthrough(self) -> list[str]:
        """The game's winning commands from the start (TextWorld's quest walkthrough)."""
        return list(self._state["game"].walkthrough or [])

    @property
    def max_score(self) -> int:
        return int(self._state["max_score"])

    @property
    def game_file(self) -> str:
        return self._path

    def close(self) -> None:
        if self._tw is not None:
            self._tw.close()
            self._tw, self._path = None, ""
        self._live = False

    def reset(self, seed: int) -> Observation:
        path = str(generate(self.name, seed, self.games_dir))
        if path != self._path:
            import textworld

            self.close()
            infos = textworld.EnvInfos(
                admissible_commands=True, description=True, inventory=True, facts=True,
                game=True, objective=True, score=True, max_score=True, won=True, lost=True,
            )
            self._tw, self._path = start(path, infos), path
        self._state = self._tw.reset()
        game = self._state["game"]
        self.rooms = sorted(info.name for info in game.infos.values() if info.type == "r")
        self.exits = {}
        for fact in self._state["facts"]:
            direction = fact.name.removesuffix("_of")
            if direction in DIRECTIONS:  # north_of(a, b): a lies north of b
                self.exits[(fact.arguments[1].name, direction)] = fact.arguments[0].name
        self.steps, self.score, self._subgoal, self._live = 0, 0, None, True
        self.known = set()
        self._mission = clean(self._state["objective"])
        self._update(feedback="")
        return self.observation()

    def _update(self, feedback: str) -> None:
        """Recompute room, known rooms, text and commands from the game's new state."""
        state = self._state
        self.room = next(f.arguments[1].name for f in state["facts"]
                         if f.name == "at" and f.arguments[0].type == "P")
        parts = [clean(feedback), clean(state["description"]), clean(state["inventory"])]
        self._text = " ".join(p for p in dict.fromkeys(parts) if p)  # a move's feedback is the room
        said = f"{self._mission} {self._text}".lower()
        self.known |= {self.room} | {r for r in self.rooms if re.search(rf"\b{re.escape(r.lower())}\b", said)}
        self._commands = {normalize(c): c for c in state["admissible_commands"]}

    def observation(self) -> Observation:
        """The current observation (actions sorted, as TextWorld lists them)."""
        actions = sorted(self._commands.values())
        goto = [f"go to the {r}" for r in sorted(self.known - {self.room})]
        commands = [c for c in actions if not is_move(c) and not is_info(c)]
        return Observation(mission=self._mission, text=self._text, actions=actions, subgoals=goto + commands)

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise RuntimeError(f"{self.name}: step() needs a live episode; call reset(seed) first")
        self.steps += 1
        key = normalize(action)
        command = self._commands.get(key)
        if command is None:
            close = difflib.get_close_matches(key, list(self._commands), n=SUGGESTIONS, cutoff=0.0)
            valid = ", ".join(self._commands[c] for c in close)
            done = self.steps >= self._max_steps
            self._live = not done
            return StepResult(
                observation=self.observation(), reward=-self.invalid_penalty, done=done, invalid=True,
                feedback=f"invalid action {quote(action)}; valid actions include: {valid}",
            )
        before = set(self._state["facts"])
        self._state, _, _ = self._tw.step(command)
        # A command that left the world as it was did not happen (see ``_build`` in
        # textworld_games: Inform 7 can answer an admissible command with "Which do you mean").
        happened = set(self._state["facts"]) != before
        self._update(feedback=self._state["feedback"])
        reward = float(self._state["score"] - self.score)
        self.score = self._state["score"]
        won, lost = bool(self._state["won"]), bool(self._state["lost"])
        done = won or lost or self.steps >= self._max_steps
        sg = self._subgoal
        if sg is None:
            subgoal_done = False
        else:
            subgoal_done = self.room == sg.room if sg.room else happened and key == normalize(sg.text)
        if subgoal_done:
            self._subgoal = None  # so that subgoal_done is True on exactly one step
        self._live = not done
        return StepResult(observation=self.observation(), reward=reward, done=done, success=won,
                          subgoal_done=subgoal_done)

    # ---- subgoals ---------------------------------------------------------------------

    def _ground(self, text: str) -> _Subgoal | str:
        """The subgoal, or why it cannot be used (unparseable, unknown, not possible now, done).

        A room of the game is accepted even before the agent has heard its name: objectives
        often say "go east" without naming the room there, and arrival is checkable anyway.
        """
        key = normalize(text)
        match = _GO_TO.match(key)
        if match:
            rooms = {r.lower(): r for r in self.rooms}
            room = rooms.get(match[1])
            if room is None:
                return f"there is no room {quote(match[1])}; rooms you know: {', '.join(sorted(self.known))}"
            if room == self.room:
                return f"you are already in the {room}"
            return _Subgoal(f"go to the {room}", room=room)
        command = self._commands.get(key)
        if command is not None and is_move(command):
            return f"name the room instead of {quote(text)}: 'go to the <room>'"
        if command is not None and is_info(command):
            return f"{quote(text)} changes nothing; choose a subgoal that does"
        if command is not None:
            return _Subgoal(command)
        examples = ", ".join(self.observation().subgoals[:SUGGESTIONS])
        return f"cannot use subgoal {quote(text)} now; use 'go to the <room>' or e.g. {examples}"


# ---- expert -----------------------------------------------------------------------------


def walkthrough_segments(env: TextWorldEnv) -> list[tuple[str, list[str]]]:
    """The walkthrough of the episode ``env`` has just reset to, as (subgoal, commands).

    A run of moves becomes ``go to the <room>``, ending where the run first reaches its
    last room; any round trip after that, and any look/examine/inventory command, is
    carried into the next segment, so that every subgoal completes on its segment's last
    command. Each other command is its own subgoal.
    """
    segments: list[tuple[str, list[str]]] = []
    carried: list[str] = []
    commands, room = env.walkthrough, env.room
    i = 0
    while i < len(commands):
        if not is_move(commands[i]):
            carried.append(commands[i])
            if not is_info(commands[i]):
                segments.append((commands[i], carried))
                carried = []
            i += 1
            continue
        moves: list[str] = []
        while i < len(commands) and is_move(commands[i]):
            moves.append(commands[i])
            i += 1
        visited = [room]
        for move in moves:
            visited.append(env.exits[(visited[-1], normalize(move).split(" ")[-1])])
        room = visited[-1]
        first = visited.index(room)  # 0: the run ends where it began
        if first > 0:
            segments.append((f"go to the {room}", carried + moves[:first]))
            carried = []
        carried += moves[first:]
    # Left in ``carried`` at the end: nothing, as TextWorld never ends a quest on a move or a look.
    return segments


def expert_episode(
    name: str, seed: int, max_steps: int | None = None, games_dir: str | None = None
) -> tuple[bool, int]:
    """Play the game's walkthrough for one episode; returns ``(success, length)``."""
    env = TextWorldEnv(name, max_steps=max_steps, games_dir=games_dir)
    try:
        env.reset(seed)
        length = 0
        for command in env.walkthrough:
            result = env.step(command)
            length += 1
            if result.done:
                return result.success, length
        return False, length
    finally:
        env.close()
