"""Expert demonstrations: recorded from real replays, written atomically, read back exactly."""

import json
from dataclasses import asdict

import pytest

from hieragent.envs.babyai import BabyAITextEnv
from hieragent.envs.base import FAMILIES
from hieragent.rollout.demos import (
    demonstrations, expert_for, read_demonstrations, record, write_demonstrations,
)

from demo_helpers import replay_demo

LEVEL = "BabyAI-PickupLoc-v0"


@pytest.fixture(scope="module")
def demos():
    return list(demonstrations(LEVEL, range(6)))


def test_every_demo_replays_to_success_with_the_recorded_choices(demos) -> None:
    assert len(demos) >= 5
    env = BabyAITextEnv(LEVEL)
    for demo in demos:
        assert demo.success and demo.source == "babyai-bot" and demo.env == LEVEL
        obs = env.reset(demo.seed)
        assert obs.mission == demo.mission
        assert replay_demo(env, demo, obs)[-1].success


def test_jsonl_round_trip_is_exact(demos, tmp_path) -> None:
    path = tmp_path / "demos.jsonl"
    assert write_demonstrations(demos, path) == len(demos)
    assert [asdict(d) for d in read_demonstrations(path)] == [asdict(d) for d in demos]
    assert all(json.loads(line)["env"] == LEVEL for line in path.read_text().splitlines())


def test_a_failed_write_leaves_the_previous_file_whole(demos, tmp_path) -> None:
    path = tmp_path / "demos.jsonl"
    write_demonstrations(demos[:2], path)
    before = path.read_bytes()

    def broken():
        yield demos[0]
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_demonstrations(broken(), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["demos.jsonl"]  # no temporary left


def test_record_refuses_segments_that_do_not_match_the_env() -> None:
    env = BabyAITextEnv(LEVEL)
    with pytest.raises(ValueError, match="refused"):
        record(env, LEVEL, 0, [("pick up the purple unicorn", ["pick up"])], "test")
    with pytest.raises(ValueError, match="did not succeed|subgoal_done"):
        record(env, LEVEL, 0, [("explore", ["turn left"])], "test")


def test_bad_files_are_errors_naming_the_file_and_line(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_demonstrations(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"env": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1"):
        read_demonstrations(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no demonstrations"):
        read_demonstrations(empty)


def test_every_env_family_has_an_expert_labelled_from_the_registry() -> None:
    for prefix, fam in FAMILIES.items():
        segments, source = expert_for(prefix + "Any-v0")
        assert callable(segments) and source == fam.source
    with pytest.raises(ValueError, match="no env family serves 'Atari-Pong-v0'"):
        expert_for("Atari-Pong-v0")
