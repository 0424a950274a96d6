"""ScienceWorld (Wang et al., arXiv:2203.07540): 30 elementary-science tasks in a text house.

``ScienceWorld-<task>-v0`` plays one of the simulator's 30 tasks (its own names, e.g. ``boil``,
``find-plant``). The simulator is a Java program (the ``scienceworld`` package's jar, reached
through py4j): each env starts its own at the first ``reset`` (seconds) and loads the episode's
variation into it at every ``reset``. A simulator that dies, or does not answer a call within
``call_timeout``, is killed and the call raises (a pool then drops the episode); the next
``reset`` starts a fresh one.

Seeds and splits: the simulator splits each task's variations into train, dev and test sets.
A training seed ``s`` (``s < EVAL_SEED_OFFSET``) plays ``train[s % len(train)]``, a held-out
seed plays ``test[(s - EVAL_SEED_OFFSET) % len(test)]`` (``heldout="dev"``: the dev set), so
held-out seeds ``EVAL_SEED_OFFSET + 0..k-1`` are the first ``k`` test variations, as papers
report them. The simulator seeds its own random generator (animals wandering, bees, genetics)
with the variation at every load, and its Java runs with constant identity hash codes
(``JAVA_OPTS``; by default the order of a room's objects changes between loads), so a seed
fixes everything; seeds that map to the same variation play the same episode.

Rules are the simulator's: any command it parses is a step (a move may also answer "The door
is not open."). An input it does not parse ("No known action matches that input.") is an
invalid step: the penalty, feedback, and nothing moves (not even the simulator's clock). ``reset task``
(which would restart the scoring) and inputs over ``MAX_COMMAND_CHARS`` are invalid without
being sent. An ambiguous command makes the simulator list numbered readings; the next action
must then be one of those numbers (``Observation.actions``), and anything else is invalid.

Reward is the change of the task score (0-100) over 100, so an episode's return is its final
score / 100. Success is a score of 100. Focusing on a wrong object fails the task (the score
drops below 0): the episode ends unsuccessful, and the score counts as 0, as papers report it.
The step cap is ScienceWorld's default of 100, or 300 for tasks whose gold paths can be longer.

``Observation.actions`` caps the simulator's valid actions (hundreds to thousands) at
``max_actions``: ``look around`` and ``inventory``, then the moves (``go to``/``open door to``
a room), then the others by relevance (the number of their object words that occur in the
subgoal, weight 4, from the step after it is set; the mission, weight 2; the latest text,
weight 1; each as a share of the action's object words), then by a fixed verb order, then
shorter first; verbs that gold paths rarely use (``RARE_VERBS``) come last. ``step`` still
takes any command the simulator parses, listed or not (it lists one name per object, e.g.
``open door``, and parses more, e.g. ``open door to hallway``).

Planner subgoals: ``go to the <room>`` (done on arrival), a command such as ``focus on red
paint`` or ``pick up flower pot 6`` (done when that command is carried out, an ambiguous
command when its number is chosen), and ``complete the task`` (done on success).

The expert (the simulator's gold action sequence, cut into subgoals) is in
``hieragent.envs.scienceworld_gold``.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import weakref
from dataclasses import dataclass
from typing import Any

from hieragent.envs.base import EVAL_SEED_OFFSET, TextEnv, normalize, quote
from hieragent.types import Observation, StepResult


# The simulator's task names, in the paper's order (task 1-1 to 10-2).
TASKS = (
    "boil", "melt", "freeze", "change-the-state-of-matter-of", "use-thermometer",
    "measure-melting-point-known-substance", "measure-melting-point-unknown-substance",
    "power-component", "power-component-renewable-vs-nonrenewable-energy", "test-conductivity",
    "test-conductivity-of-unknown-substances", "find-living-thing", "find-non-living-thing",
    "find-plant", "find-animal", "grow-plant", "grow-fruit", "chemistry-mix",
    "chemistry-mix-paint-secondary-color", "chemistry-mix-paint-tertiary-color",
    "lifespan-longest-lived", "lifespan-shortest-lived", "lifespan-longest-lived-then-shortest-lived",
    "identify-life-stages-1", "identify-life-stages-2", "inclined-plane-determine-angle",
    "inclined-plane-friction-named-surfaces", "inclined-plane-friction-unnamed-surfaces",
    "mendelian-genetics-known-plant", "mendelian-genetics-unknown-plant",
)
NAMES = [f"ScienceWorld-{task}-v0" for task in TASKS]
SIMPLIFICATIONS = ("teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors",
                   "noElectricalAction", "easy")
# ScienceWorld's own step limit; tasks whose gold paths run longer get room for them.
DEFAULT_MAX_STEPS = 100
LONG_TASK_MAX_STEPS = 300
LONG_TASKS = {"boil", "melt", "freeze", "change-the-state-of-matter-of", "use-thermometer",
              "measure-melting-point-known-substance", "measure-melting-point-unknown-substance",
              "grow-plant", "grow-fruit", "inclined-plane-determine-angle",
              "inclined-plane-friction-named-surfaces", "inclined-plane-friction-unnamed-surfaces",
              "mendelian-genetics-known-plant", "mendelian-genetics-unknown-plant"}
MAX_COMMAND_CHARS = 300
SUGGESTIONS = 3  # valid actions named in the feedback of an invalid one
# Words that the simulator's parser takes between object names (see ``_parseable``).
TEMPLATE_WORDS = {"containing", "and", "in", "on", "to", "into", "at", "up", "down"}
FINISH = "complete the task"
INVALID_REPLIES = ("No known action matches that input.", "Unknown action.")
AMBIGUOUS = "Ambiguous request"
ALWAYS = ("look around", "inventory")
MOVE_VERBS = ("go to", "open door to", "close door to", "teleport to")
INFO_VERBS = ("look around", "look at", "look in", "inventory", "read", "task", "wait")
# Ties in relevance go to the verbs a task needs most often (a fixed order; unknown verbs last).
VERB_ORDER = ("focus on", "go to", "open", "close", "pick up", "put down", "move", "pour", "activate",
              "deactivate", "use", "mix", "look at", "look in", "read", "wait", "connect",
              "disconnect", "dunk", "eat", "flush")
# Verbs that gold paths rarely use: ranked after all others, except connect/disconnect in the
# electrical tasks. (Without this, "connect X to Y" over every pair of objects fills the list.)
RARE_VERBS = ("connect", "disconnect", "dunk", "eat", "flush")
ELECTRICAL_TASKS = {"power-component", "power-component-renewable-vs-nonrenewable-energy",
                    "test-conductivity", "test-conductivity-of-unknown-substances"}
# Words of action templates, and objects present everywhere: no evidence of relevance.
NOT_OBJECT_WORDS = {"to", "in", "on", "at", "up", "down", "into", "agent", "air", "inventory", "door"}
# The house's locations (a task's house has some of them).
ROOMS = ("art studio", "bathroom", "bedroom", "foundry", "greenhouse", "hallway", "kitchen",
         "living room", "outside", "workshop")
_ROOM = re.compile(r"called the ([a-z ]+?)\.")
_GO_TO = re.compile(r"^go to (?:the )?(.+)$")
_CHOICE = re.compile(r"^(\d+):", re.M)
_SPLITS: dict[str, dict[str, list[int]]] = {}  # task -> split -> variations, per process
# Every identity hash code is 1, so that the simulator's hash sets of objects iterate in
# insertion order: by default their order (what a room lists, which names the valid actions
# use, and the order that objects draw random numbers in) changes from one load to the next.
# A 1 GB heap with the serial collector: each env has its own JVM, which by default reserves a
# quarter of the machine's memory and kept about 0.7 GB resident after 60 steps of boil; with
# these about 0.25 GB after the gold paths of grow-fruit and mendelian-genetics, as fast.
JAVA_OPTS = ("-XX:+UnlockExperimentalVMOptions", "-XX:hashCode=2", "-Xmx1g", "-XX:+UseSerialGC")
JAVA_MISSING = ("ScienceWorld needs a Java 17 runtime and `java` is not on PATH; install one, e.g. "
                "`apt-get install openjdk-17-jre-headless` or `conda install -c conda-forge openjdk=17`")


def verb(command: str) -> str:
    """The verb of a command: ``pick up``, ``focus on``, ``go to``..., else its first word."""
    key = normalize(command)
    return next((v for v in MOVE_VERBS + INFO_VERBS + VERB_ORDER if key == v or key.startswith(v + " ")),
                key.split(" ")[0] if key else "")


def is_move(command: str) -> bool:
    return verb(command) in MOVE_VERBS


def is_info(command: str) -> bool:
    return verb(command) in INFO_VERBS or normalize(command).startswith("wait")


def _stop(gateway: Any, proc: Any) -> None:
    """Close the py4j connection, then kill the simulator's process."""
    try:
        gateway.close()
    except Exception:  # the connection of a dead simulator: nothing left to close
        pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class _Subgoal:
    text: str
    room: str = ""  # go to: the target room
    command: str = ""  # a command: done when carried out


class ScienceWorldEnv(TextEnv):
    """One ScienceWorld task behind the ``TextEnv`` interface, with its own simulator.

    Args:
        name: One of ``NAMES``.
        max_steps: Step cap per episode, invalid steps included; ``None``: 100, or 300 for the
            tasks whose gold paths are long (``LONG_TASKS``).
        invalid_penalty: Subtracted from the reward of an invalid action.
        heldout: Variations that held-out seeds play: ``"test"`` or ``"dev"`` (validation).
        max_actions: Length of ``Observation.actions`` (the ranked, capped valid actions).
        simplifications: The simulator's simplifications, comma-separated (``SIMPLIFICATIONS``),
            e.g. ``"easy"``; ``""`` (the default) plays the tasks as the paper's main results do.
        call_timeout: Seconds one call to the simulator may take; past it the simulator is
            killed, the call raises, and the next ``reset`` starts a fresh one.
    """

    world = "a text house for elementary science experiments (ScienceWorld)"

    def __init__(self, name: str, max_steps: int | None = None, invalid_penalty: float = 0.1,
                 heldout: str = "test", max_actions: int = 40, simplifications: str = "",
                 call_timeout: float = 60.0) -> None:
        super().__init__(invalid_penalty)
        if name not in NAMES:
            close = difflib.get_close_matches(name, NAMES, n=3, cutoff=0.6)
            raise ValueError(f"unknown env {name!r}; known: {', '.join(close or NAMES[:3])}, ... "
                             f"({len(NAMES)} ScienceWorld-<task>-v0 names, see scienceworld.NAMES)")
        if heldout not in ("test", "dev"):
            raise ValueError(f"heldout must be 'test' or 'dev' (the variations held-out seeds play), "
                             f"got {heldout!r}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        if max_actions < len(ALWAYS):
            raise ValueError(f"max_actions must be >= {len(ALWAYS)}, got {max_actions}")
        bad = [s for s in simplifications.split(",") if s and s not in SIMPLIFICATIONS]
        if bad:
            raise ValueError(f"unknown simplifications {bad}; known: {', '.join(SIMPLIFICATIONS)}")
        if call_timeout <= 0:
            raise ValueError(f"call_timeout must be > 0 seconds, got {call_timeout}")
        if shutil.which("java") is None:
            raise RuntimeError(JAVA_MISSING)
        self.name, self.task = name, name.removeprefix("ScienceWorld-").removesuffix("-v0")
        self.heldout, self.max_actions = heldout, max_actions
        self.simplifications, self.call_timeout = simplifications, call_timeout
        self._max_steps = max_steps or (LONG_TASK_MAX_STEPS if self.task in LONG_TASKS else DEFAULT_MAX_STEPS)
        self._gateway: Any = None
        self._sim: Any = None  # the simulator's py4j interface
        self._proc: Any = None
        self._finalizer: Any = None
        self._live = False
        self._subgoal: _Subgoal | None = None
        self.seed, self.split, self.variation = 0, "train", 0
        self.steps, self.score = 0, 0
        self.room, self.known_rooms = "", set()
        self._mission, self._text = "", ""
        self._valid: list[str] = []  # the simulator's valid actions now (uncapped)
        self._actions: list[str] = []  # the capped, ranked list shown
        self._choices: list[str] = []  # numbers of a pending ambiguous command, else []
        self._pending = ""  # the ambiguous command the numbers resolve

    @property
    def max_steps(self) -> int:
        return self._max_steps

    @property
    def subgoal(self) -> str | None:
        return self._subgoal.text if self._subgoal else None

    @property
    def java_pid(self) -> int | None:
        """Process id of this env's simulator, ``None`` before the first ``reset``."""
        return self._proc.pid if self._proc is not None else None

    # ---- the simulator ---------------------------------------------------------------------

    def _start(self) -> None:
        """Start the Java simulator unless it runs; a dead one is replaced."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
        from scienceworld.constants import BASEPATH, JAR_PATH

        # die_on_exit: the JVM exits when this process does, even when it is killed.
        port, proc = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH, return_proc=True,
                                    javaopts=list(JAVA_OPTS))
        self._proc = proc
        self._gateway = JavaGateway(java_process=proc, gateway_parameters=GatewayParameters(
            port=port, auto_field=True, read_timeout=self.call_timeout))
        self._finalizer = weakref.finalize(self, _stop, self._gateway, proc)
        from py4j.protocol import Py4JError

        try:  # the simulator's first call, bounded by call_timeout like the others
            self._sim = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        except Py4JError as exc:
            raise self._lost("start-up", exc) from None

    def _call(self, method: str, *args: Any) -> Any:
        """``method`` of the simulator; a dead or hung simulator raises ``RuntimeError`` (and is
        killed, so that the next ``reset`` starts a fresh one)."""
        from py4j.protocol import Py4JError, Py4JJavaError

        try:
            return getattr(self._sim, method)(*args)
        except Py4JJavaError:  # an exception in the simulator, which lives on
            raise
        except Py4JError as exc:  # no answer: the connection broke or timed out
            raise self._lost(method, exc) from None

    def _lost(self, during: str, exc: Exception) -> RuntimeError:
        """Kill the simulator that did not answer; the error to raise, naming it."""
        pid = self.java_pid
        self.close()
        return RuntimeError(f"{self.name}: the ScienceWorld simulator (java pid {pid}) died or hung "
                            f"during {during}: {str(exc).splitlines()[0]}")

    def close(self) -> None:
        """Stop the simulator (a later ``reset`` starts a new one); idempotent."""
        self._live = False
        if self._finalizer is not None:
            self._finalizer()
        self._gateway = self._proc = self._finalizer = None

    @property
    def splits(self) -> dict[str, list[int]]:
        """The simulator's ``train``, ``dev`` and ``test`` variations of this task."""
        if self.task not in _SPLITS:
            self._start()
            self._call("load", self.task, 0, "", False)
            _SPLITS[self.task] = {"train": list(self._call("getVariationsTrain")),
                                  "dev": list(self._call("getVariationsDev")),
                                  "test": list(self._call("getVariationsTest"))}
        return _SPLITS[self.task]

    def variation_of(self, seed: int) -> tuple[str, int]:
        """``(split, variation)`` that ``seed`` plays."""
        split = "train" if seed < EVAL_SEED_OFFSET else self.heldout
        ids = self.splits[split]
        return split, ids[(seed if split == "train" else seed - EVAL_SEED_OFFSET) % len(ids)]

    # ---- playing ---------------------------------------------------------------------------

    def reset(self, seed: int, gold: bool = False) -> Observation:
        """Load the variation of ``seed``; ``gold`` also has the simulator make its gold path
        (``gold_path``), which takes longer but changes nothing in the episode."""
        self._live = False  # until the load succeeds
        self.split, self.variation = self.variation_of(seed)
        self._start()
        self._call("load", self.task, self.variation, self.simplifications, gold)
        self.seed, self.steps, self.score, self._subgoal = seed, 0, 0, None
        self._choices, self._pending, self.known_rooms = [], "", set()
        self._mission = " ".join(self._call("freeActionTaskDesc").split()).removeprefix("Task Description: ")
        # The simulator's own reset answers its first "look around" (a step that lets a tick pass).
        self._update(self._call("step", "look around"))
        self._live = True
        return self.observation()

    def gold_path(self, seed: int) -> list[str]:
        """The simulator's gold actions for ``seed``, whose episode this resets to its start."""
        self.reset(seed, gold=True)
        return [str(a) for a in self._call("getGoldActionSequence")]

    def _update(self, reply: str) -> None:
        """Text, room, known rooms, and the capped actions after the simulator's ``reply``."""
        self._text = reply.strip()
        look = self._call("freeActionLook")
        match = _ROOM.search(look.split("\n", 1)[0])
        self.room = match[1] if match else self.room
        said = f"{self._mission} {self._text} {look}".lower()
        self.known_rooms |= {self.room} | {r for r in ROOMS if re.search(rf"\b{r}\b", said)}
        if self._text.startswith(AMBIGUOUS):
            self._choices = _CHOICE.findall(self._text)
            self._valid = self._actions = list(self._choices)
            return
        self._choices = []
        valid = json.loads(self._call("getValidActionObjectCombinationsJSON"))["validActions"]
        self._valid = sorted({normalize(v["action"]) for v in valid} - {"reset task"})
        self._actions = self.rank(self._valid)

    def rank(self, actions: list[str]) -> list[str]:
        """The ``max_actions`` shown (the rule is in the module docstring)."""
        sources = [(4, self._subgoal.text if self._subgoal else ""), (2, self._mission), (1, self._text)]
        words = [(w, set(re.findall(r"[a-z0-9]+", text.lower()))) for w, text in sources]

        def relevance(action: str) -> float:
            own = set(action[len(verb(action)):].split()) - NOT_OBJECT_WORDS
            return sum(w * len(own & seen) / len(own) for w, seen in words) if own else 0.0

        order = {v: k for k, v in enumerate(VERB_ORDER)}
        rare = set(RARE_VERBS) - ({"connect", "disconnect"} if self.task in ELECTRICAL_TASKS else set())
        first = [a for a in ALWAYS if a in actions]
        first += sorted(a for a in actions if is_move(a) or a.startswith("open door"))
        rest = sorted((a for a in actions if a not in first), key=lambda a: (
            verb(a) in rare, -relevance(a), order.get(verb(a), len(order)), len(a), a))
        return (first + rest)[: self.max_actions]

    def observation(self) -> Observation:
        goto = [f"go to the {r}" for r in sorted(self.known_rooms - {self.room})]
        if self._choices:  # the planner is rarely asked now; it gets the rooms and FINISH
            return Observation(self._mission, self._text, list(self._choices), goto + [FINISH])
        commands = [a for a in self._actions if not is_move(a) and not is_info(a)]
        return Observation(self._mission, self._text, list(self._actions), goto + commands + [FINISH])

    def _invalid(self, action: str, why: str) -> StepResult:
        """An invalid step; ``why`` ends in "; " (then close valid actions are suggested) or not."""
        if not why or why.endswith("; "):
            close = difflib.get_close_matches(normalize(action), self._actions, n=SUGGESTIONS, cutoff=0.0)
            why += f"valid actions include: {', '.join(close)}"
        done = self.steps >= self._max_steps
        self._live = not done
        return StepResult(self.observation(), -self.invalid_penalty, done, invalid=True,
                          feedback=f"invalid action {quote(action)}; {why}")

    def step(self, action: str) -> StepResult:
        if not self._live:
            raise RuntimeError(f"{self.name}: step() needs a live episode; call reset(seed) first")
        self.steps += 1
        command = normalize(action)
        if self._choices and command not in self._choices:
            return self._invalid(action, f"answer with the number of the action you meant: "
                                         f"{', '.join(self._choices)}")
        if not command or len(command) > MAX_COMMAND_CHARS or command == "reset task":
            return self._invalid(action, "")
        from py4j.protocol import Py4JJavaError

        try:
            reply = str(self._call("step", command))
        except Py4JJavaError:  # a parser bug on odd input; the simulator lives on
            return self._invalid(action, "the simulator could not read it; ")
        if reply.startswith(INVALID_REPLIES):
            return self._invalid(action, "the simulator does not know it; ")
        carried_out = "" if reply.startswith(AMBIGUOUS) else (self._pending if self._choices else command)
        self._pending = command if reply.startswith(AMBIGUOUS) else ""
        self._update(reply)
        raw = round(100 * float(self._call("getScore")))
        failed, success = raw < 0, raw >= 100
        reward = (max(raw, 0) - self.score) / 100
        self.score = max(raw, 0)
        done = failed or success or bool(self._call("getCompleted")) or self.steps >= self._max_steps
        sg = self._subgoal
        subgoal_done = sg is not None and (
            self.room == sg.room if sg.room else success if sg.text == FINISH else carried_out == sg.command)
        if subgoal_done:
            self._subgoal = None  # so that subgoal_done is True on exactly one step
        self._live = not done
        return StepResult(self.observation(), reward, done, success=success, subgoal_done=subgoal_done)

    # ---- subgoals --------------------------------------------------------------------------

    def _ground(self, text: str) -> _Subgoal | str:
        """The subgoal, or why it cannot be used. Commands are accepted when the simulator lists
        them, or when every word is one of its words for the objects here (it parses more forms
        than it lists, e.g. "move flower pot 6 containing apple tree in inventory to red box")."""
        key = normalize(text)
        if key == FINISH:
            return _Subgoal(FINISH)
        match = _GO_TO.match(key)
        if match:
            room = match[1]
            if room not in ROOMS:  # unheard-of rooms are fine: arrival is checkable anyway
                return f"there is no room {quote(room)}; the rooms are {', '.join(ROOMS)}"
            if room == self.room:
                return f"you are already in the {room}"
            return _Subgoal(f"go to the {room}", room=room)
        if is_move(key):
            return f"name the room instead of {quote(text)}: 'go to the <room>'"
        if is_info(key):
            return f"{quote(text)} changes nothing; choose a subgoal that does"
        if key in self._valid or self._parseable(key):
            return _Subgoal(key, command=key)
        examples = ", ".join(self.observation().subgoals[:3])
        return f"cannot use subgoal {quote(text)} now; use 'go to the <room>', a command, or e.g. {examples}"

    def _parseable(self, command: str) -> bool:
        """A known verb, and every word in the valid actions or in what the agent sees or holds."""
        if verb(command) not in VERB_ORDER:
            return False
        seen = f"{self._call('freeActionLook')} {self._call('freeActionInventory')} {' '.join(self._valid)}"
        return set(command.split()) <= set(re.findall(r"[a-z0-9]+", seen.lower())) | TEMPLATE_WORDS


def measure_costs(name: str = "ScienceWorld-boil-v0", steps: int = 60,
                  seed: int = EVAL_SEED_OFFSET) -> dict[str, float]:
    """What one env costs: its first reset (the JVM's start and the first load), a later reset,
    a step (a random listed action, no focus: it may end the task), and the JVM's resident MB."""
    import random
    import time

    env = ScienceWorldEnv(name)
    try:
        t0 = time.perf_counter()
        obs = env.reset(seed)
        first = time.perf_counter() - t0
        rng, taken, t0 = random.Random(seed), 0, time.perf_counter()
        while taken < steps:
            result = env.step(rng.choice([a for a in obs.actions if verb(a) != "focus on"]))
            taken, obs = taken + 1, result.observation
            if result.done:
                break
        step = (time.perf_counter() - t0) / taken
        t0 = time.perf_counter()
        env.reset(seed + 1)
        reset = time.perf_counter() - t0
        status = open(f"/proc/{env.java_pid}/status").read()  # Linux
        rss = int(status.split("VmRSS:")[1].split()[0]) / 1024
    finally:
        env.close()
    return {"first reset s": first, "reset s": reset, "step ms": 1e3 * step, "JVM resident MB": rss}


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="What a ScienceWorld env costs on this machine.")
    p.add_argument("--env", default="ScienceWorld-boil-v0", choices=NAMES)
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()
    for key, value in measure_costs(a.env, a.steps).items():
        print(f"{key}: {value:.3f}")
