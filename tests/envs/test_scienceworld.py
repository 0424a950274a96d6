"""ScienceWorldEnv on the real simulator: splits, replay, invalid input, subgoals, the gold
expert, worker processes and a killed simulator.

Every Java start costs seconds, so most tests share one env of a short task (find-plant).
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hieragent.envs import EnvPool, make_env
from hieragent.envs.base import EVAL_SEED_OFFSET
from hieragent.envs.pool import FAILED_FEEDBACK
from hieragent.envs.scienceworld import (
    FINISH, JAVA_MISSING, NAMES, RARE_VERBS, TASKS, ScienceWorldEnv, measure_costs, verb,
)
from hieragent.envs.scienceworld_gold import cut_segments, expert_episode
from hieragent.rollout.demos import expert_for, record

from demo_helpers import replay_demo

PLANT = "ScienceWorld-find-plant-v0"
HELDOUT = EVAL_SEED_OFFSET
GARBAGE = ["", "   ", "xyzzy", "a" * 5000, "ünïcödé ☃ 植物", "reset task", "look around; inventory",
           "\x00\n\t", "focus on", "go to the moon", "pick up zzz", "0", '"\\', "None"]


@pytest.fixture(scope="module")
def env() -> Iterator[ScienceWorldEnv]:
    env = ScienceWorldEnv(PLANT)
    yield env
    env.close()


def play(env: ScienceWorldEnv, seed: int, n: int = 8) -> list:
    """Observations and step results from ``reset(seed)`` over ``n`` actions drawn by ``seed``:
    some garbage, the rest from ``Observation.actions`` (no focus: it may end the task)."""
    rng = random.Random(seed)
    obs = env.reset(seed)
    trace: list = [obs]
    for _ in range(n):
        if rng.random() < 0.25:
            action = rng.choice(GARBAGE[:3])
        else:
            action = rng.choice([a for a in obs.actions if verb(a) != "focus on"])
        trace.append(env.step(action))
        obs = trace[-1].observation
        if trace[-1].done:
            break
    return trace


def java_children(pid: int) -> list[int]:
    """Ids of the live java processes whose parent is ``pid``, oldest first (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if name == "java" and fields[0] != "Z" and int(fields[1]) == pid:
            found.append((int(fields[19]), int(stat.parent.name)))  # (start time, pid)
    return [p for _, p in sorted(found)]


# ---- names, arguments, Java --------------------------------------------------------------


def test_names_are_the_simulators_30_tasks(env: ScienceWorldEnv) -> None:
    env.reset(0)
    assert sorted(env._call("getTaskNames")) == sorted(TASKS) and len(NAMES) == 30
    assert NAMES[0] == "ScienceWorld-boil-v0" and PLANT in NAMES
    assert isinstance(make_env(PLANT, max_steps=7), ScienceWorldEnv)  # no Java started yet


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"name": "ScienceWorld-find-plants-v0"},
     r"unknown env 'ScienceWorld-find-plants-v0'; known: ScienceWorld-find-plant-v0"),
    ({"heldout": "train"}, r"heldout must be 'test' or 'dev'"),
    ({"simplifications": "easy,fly"}, r"unknown simplifications \['fly'\]"),
    ({"max_actions": 1}, r"max_actions must be >= 2"),
    ({"max_steps": 0}, r"max_steps must be >= 1"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScienceWorldEnv(**{"name": PLANT, **kwargs})


def test_missing_java_is_one_line_saying_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match="Java 17 runtime") as err:
        ScienceWorldEnv(PLANT)
    assert str(err.value) == JAVA_MISSING and "\n" not in JAVA_MISSING and "apt-get install" in JAVA_MISSING


# ---- seeds and splits ----------------------------------------------------------------------


def test_same_seed_replays_step_for_step_and_seeds_differ(env: ScienceWorldEnv) -> None:
    first = play(env, 1)
    assert len(first) > 5 and any(r.invalid for r in first[1:]) and any(not r.invalid for r in first[1:])
    assert play(env, 1) == first
    assert env.reset(1, gold=True) == first[0]  # making the gold path changes nothing
    assert play(env, 2)[0] != first[0]


def test_train_seeds_play_train_variations_and_heldout_seeds_test_or_dev(env: ScienceWorldEnv) -> None:
    splits = env.splits
    train, dev, test = (set(splits[k]) for k in ("train", "dev", "test"))
    assert train and dev and test and not train & dev and not train & test and not dev & test
    n = len(splits["train"])
    assert {env.variation_of(s) for s in range(2 * n)} == {("train", v) for v in train}
    assert [env.variation_of(HELDOUT + k)[1] for k in range(3)] == splits["test"][:3]
    assert ScienceWorldEnv(PLANT, heldout="dev").variation_of(HELDOUT + 1) == ("dev", splits["dev"][1])
    env.reset(HELDOUT + 1)  # the simulator itself loaded that test variation
    loaded = env._sim.taskVariationIdx()
    assert (env.split, env.variation, loaded) == ("test", splits["test"][1], splits["test"][1])


# ---- acting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("action", GARBAGE)
def test_garbage_is_an_invalid_step_that_changes_nothing(env: ScienceWorldEnv, action: str) -> None:
    obs = env.reset(HELDOUT)
    moves = env._call("getNumMoves")
    result = env.step(action)
    assert result.invalid and result.reward == -env.invalid_penalty and not result.done
    assert result.feedback.startswith("invalid action ") and result.observation == obs
    assert env._call("getNumMoves") == moves


def test_an_ambiguous_command_takes_only_its_numbers(env: ScienceWorldEnv) -> None:
    env.reset(HELDOUT)  # the art studio; then the hallway, which has six doors
    env.step("open door to hallway")
    env.step("go to hallway")
    result = env.step("open door")
    assert not result.invalid and result.observation.text.startswith("Ambiguous request")
    choices = result.observation.actions
    assert choices == [str(k) for k in range(len(choices))] and len(choices) > 2
    wrong = env.step("look around")
    assert wrong.invalid and "answer with the number" in wrong.feedback
    assert wrong.observation == result.observation
    assert env.step("1").observation.text == "The door is now open."


def test_actions_are_capped_ranked_and_step_takes_unlisted_commands(env: ScienceWorldEnv) -> None:
    obs = env.reset(HELDOUT)
    assert len(obs.actions) == env.max_actions < len(env._valid) and set(obs.actions) <= set(env._valid)
    assert obs.actions[:3] == ["look around", "inventory", "open door"]
    rare = [k for k, a in enumerate(obs.actions) if verb(a) in RARE_VERBS]
    assert not rare  # rare verbs only after every other valid action
    assert "open door to hallway" not in env._valid
    result = env.step("open door to hallway")  # the simulator parses more than it lists
    assert not result.invalid and result.observation.text == "The door is now open."
    assert "go to hallway" in result.observation.actions


def test_focusing_on_a_wrong_thing_fails_the_task(env: ScienceWorldEnv) -> None:
    env.reset(HELDOUT)
    result = env.step("focus on table")
    assert result.done and not result.success and result.reward == 0.0 and env.score == 0
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("look around")


# ---- subgoals and the expert ------------------------------------------------------------------


@pytest.mark.parametrize(("subgoal", "feedback"), [
    ("go to the moon", "there is no room 'moon'"),
    ("go to the art studio", "you are already in the art studio"),
    ("open door to hallway", "name the room instead"),
    ("look around", "changes nothing"),
    ("pick up unicorn", "cannot use subgoal 'pick up unicorn'"),
])
def test_set_subgoal_explains_what_cannot_be_grounded(env: ScienceWorldEnv, subgoal: str,
                                                      feedback: str) -> None:
    env.reset(HELDOUT)
    assert feedback in env.set_subgoal(subgoal) and env.subgoal is None


def test_go_to_is_done_on_arrival_and_a_command_when_carried_out(env: ScienceWorldEnv) -> None:
    obs = env.reset(HELDOUT)  # the art studio
    assert obs.subgoals[-1] == FINISH and {"go to the hallway", "open cupboard"} <= set(obs.subgoals)
    assert env.set_subgoal("open cupboard") == ""
    assert [env.step(a).subgoal_done for a in ("look at table", "close cupboard", "open cupboard")] == [
        False, False, True]
    assert env.set_subgoal("go to the greenhouse") == ""  # a room not yet heard of
    assert env.set_subgoal("Go to the hallway.") == "" and env.subgoal == "go to the hallway"
    assert [env.step(a).subgoal_done for a in ("open door to hallway", "look around", "go to hallway")] == [
        False, False, True]
    assert env.subgoal is None and not env.step("go to art studio").subgoal_done


def test_cut_segments_groups_moves_answers_and_looks() -> None:
    steps = [("open door to hallway", "studio"), ("go to hallway", "hallway"), ("go to kitchen", "kitchen"),
             ("look around", "kitchen"), ("move seed to pot", "kitchen"), ("0", "kitchen"),
             ("go to hallway", "hallway"), ("go to kitchen", "kitchen"), ("wait1", "kitchen"),
             ("focus on seed", "kitchen"), ("wait", "kitchen"), ("look at seed", "kitchen")]
    assert cut_segments(steps, "studio") == [
        ("go to the kitchen", ["open door to hallway", "go to hallway", "go to kitchen"]),
        ("move seed to pot", ["look around", "move seed to pot", "0"]),
        ("focus on seed", ["go to hallway", "go to kitchen", "wait1", "focus on seed"]),  # a round trip
        (FINISH, ["wait", "look at seed"]),
    ]


def test_expert_demo_records_and_replays_to_success_on_a_heldout_seed(env: ScienceWorldEnv) -> None:
    segments_of, source = expert_for(PLANT)
    assert source == "scienceworld-gold"
    segments = segments_of(env, HELDOUT)
    assert [s for s, _ in segments][:2] == ["go to the greenhouse", "focus on adult banana tree"]
    gold = env.gold_path(HELDOUT)
    assert [a for _, actions in segments for a in actions] == gold[:sum(len(a) for _, a in segments)]
    demo = record(env, PLANT, HELDOUT, segments, source)  # checks subgoal_done on each last action
    results = replay_demo(env, demo, env.reset(HELDOUT), listed=False)
    assert results[-1].success and results[-1].done and env.score == 100
    assert sum(r.reward for r in results) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [HELDOUT, HELDOUT + 1])
def test_expert_succeeds_on_heldout_seeds_of_a_second_task(seed: int) -> None:
    success, length = expert_episode("ScienceWorld-lifespan-longest-lived-v0", seed)
    assert success and 1 <= length <= 10


# ---- pools: worker processes and a killed simulator ------------------------------------------


def test_a_killed_simulator_fails_only_its_episode_and_the_next_reset_restarts_it(
        env: ScienceWorldEnv) -> None:
    seeds = [HELDOUT, HELDOUT]
    reference = [env.reset(HELDOUT)]
    reference += [env.step(a) for a in ("open door to hallway", "go to hallway", "inventory")]
    with EnvPool.make(PLANT, 2, workers=1, step_timeout=120) as pool:
        assert pool.reset(seeds) == [reference[0], reference[0]]  # the worker plays the same episode
        opened = pool.step({0: "open door to hallway", 1: "open door to hallway"})
        assert opened == {0: reference[1], 1: reference[1]}
        worker = pool.worker_pid(0)
        javas = java_children(worker)
        assert len(javas) == 2
        os.kill(javas[0], signal.SIGKILL)  # env 0 started its simulator first
        deadline = time.monotonic() + 10
        while javas[0] in java_children(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        results = pool.step({0: "go to hallway", 1: "go to hallway"})
        assert results[1] == reference[2] and pool.step({1: "inventory"}) == {1: reference[3]}
        assert results[0].done and not results[0].success and results[0].feedback.startswith(FAILED_FEEDBACK)
        assert "died or hung" in results[0].feedback
        assert pool.failed == {0} and pool.dropped_episodes == 1 and pool.restarts == 0
        assert pool.worker_pid(0) == worker  # the worker lived on; only the simulator died
        assert pool.reset(seeds) == [reference[0], reference[0]] and pool.failed == set()
        assert len(java_children(worker)) == 2


def test_a_hung_simulator_raises_after_call_timeout_and_is_killed() -> None:
    # the timeout bounds the simulator's start-up call too, which took over 2 s beside a second test worker
    env = ScienceWorldEnv(PLANT, call_timeout=15.0)
    try:
        env.reset(HELDOUT)
        hung = env.java_pid
        os.kill(hung, signal.SIGSTOP)
        with pytest.raises(RuntimeError, match=rf"simulator \(java pid {hung}\) died or hung during step"):
            env.step("open door to hallway")
        assert env.java_pid is None and not Path(f"/proc/{hung}").exists()  # killed and reaped
        with pytest.raises(RuntimeError, match="call reset"):
            env.step("look around")
    finally:
        env.close()


def test_a_start_up_slower_than_call_timeout_raises_and_leaves_no_simulator() -> None:
    # the simulator's first call loads its classes and tasks: far longer than a millisecond
    env = ScienceWorldEnv(PLANT, call_timeout=0.001)
    try:
        with pytest.raises(RuntimeError, match=r"simulator \(java pid (\d+)\) died or hung during start-up") as err:
            env.reset(HELDOUT)
        pid = int(re.search(r"java pid (\d+)", str(err.value)).group(1))
        assert env.java_pid is None and not Path(f"/proc/{pid}").exists()  # killed and reaped
    finally:
        env.close()


def test_measure_costs_reports_start_up_reset_step_and_memory() -> None:
    costs = measure_costs(PLANT, steps=3)
    assert costs["first reset s"] > costs["reset s"] > 0  # the first one starts the JVM
    assert costs["step ms"] > 0 and 50 < costs["JVM resident MB"] < 1500  # -Xmx1g caps the heap
