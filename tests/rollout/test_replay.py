"""The replay buffer: staleness limits, counting what it drops, and checkpoint round trips."""

import copy
import json
import random

import numpy as np
import pytest

from hieragent.rollout.replay import ReplayBuffer, ReplaySettings, staleness
from hieragent.types import Batch, Retrieval, Trajectory, Turn


def batch(version: int, n_traj: int, rng: random.Random) -> Batch:
    trajs = []
    for g in range(n_traj):
        turns = [Turn(role=rng.choice(["planner", "executor"]), prompt_ids=[rng.randrange(50)] * 3,
                      action_ids=[rng.randrange(50)], old_logprobs=[-rng.random()], text="go",
                      reward=rng.random(), policy_version=version, state_key=f"s{rng.randrange(3)}")
                 for _ in range(rng.randint(1, 4))]
        turns[0].retrieval = Retrieval(query=[rng.random()] * 2, keys=[[rng.random()] * 2], entry_ids=[7],
                                       chosen=[0], old_logprob=-0.5, temperature=0.7)
        trajs.append(Trajectory(turns=turns, group=g, seed=g, mission="m", success=bool(g % 2)))
    return Batch(trajs, policy_version=version)


def test_batches_beyond_max_staleness_are_dropped_and_counted():
    rng = random.Random(0)
    buf = ReplayBuffer(max_staleness=8, max_batches=10)
    batches = [batch(v, 3, rng) for v in (0, 4, 8, 12)]
    for b in batches:
        buf.add(b)
    kept = buf.retained(12)
    assert kept == batches[1:]  # staleness 12 > 8 goes; 8, 4 and 0 stay
    assert buf.dropped_turns == len(batches[0].turns())
    assert buf.retained(17) == batches[3:]  # 17 - 8 = 9 > 8, 17 - 4 = 13 > 8
    assert buf.dropped_turns == sum(len(b.turns()) for b in batches[:3])


def test_a_batch_is_as_stale_as_its_oldest_turn():
    rng = random.Random(1)
    b = batch(10, 2, rng)
    b.trajectories[1].turns[-1].policy_version = 3
    buf = ReplayBuffer(max_staleness=5)
    buf.add(b)
    assert buf.retained(10) == [] and buf.dropped_turns == len(b.turns())
    assert staleness(b.turns(), 10)[-1] == 7


def test_max_batches_evicts_the_oldest():
    rng = random.Random(2)
    buf = ReplayBuffer(max_staleness=100, max_batches=2)
    bs = [batch(v, 1, rng) for v in range(3)]
    for b in bs:
        buf.add(b)
    assert buf.retained(3) == bs[1:] and buf.dropped_turns == len(bs[0].turns())


def test_state_dict_round_trip_restores_every_turn_field():
    rng = random.Random(3)
    buf = ReplayBuffer(max_staleness=4)
    for v in (0, 2):
        buf.add(batch(v, 3, rng))
    buf.dropped_turns = 5
    other = ReplayBuffer(max_staleness=4)
    state = json.loads(json.dumps(buf.state_dict()))  # plain lists and numbers: what a checkpoint holds
    other.load_state_dict(state)
    assert other.retained(2) == buf.retained(2)  # dataclass equality, retrieval vectors included
    assert other.dropped_turns == 5
    restored = other.retained(2)[0].trajectories[0].turns[0].retrieval
    assert isinstance(restored, Retrieval) and restored.keys.dtype == np.float32 and restored.keys.ndim == 2
    changed = buf.retained(2)[0].trajectories[0].turns[0].retrieval
    changed.keys[0, 0] += 1.0
    assert other.retained(2) != buf.retained(2)  # and equality sees a changed key


@pytest.mark.parametrize("key,value", [("updates_per_batch", 0), ("max_batches", 0),
                                       ("max_staleness", -1), ("rollout_lag", -2)])
def test_settings_reject_impossible_values_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"model.replay.{key}"):
        ReplaySettings(**{key: value})


def test_discarded_batches_leave_by_identity_and_are_counted():
    rng = random.Random(4)
    buf = ReplayBuffer(max_staleness=10)
    good, bad = batch(0, 2, rng), batch(1, 2, rng)
    twin = copy.deepcopy(bad)  # equal, but not the batch that failed
    for b in (good, bad, twin):
        buf.add(b)
    assert buf.discard([bad]) == 1
    kept = buf.retained(1)
    assert len(kept) == 2 and kept[0] is good and kept[1] is twin
    assert buf.dropped_turns == len(bad.turns())
    assert buf.discard([bad]) == 0 and buf.dropped_turns == len(bad.turns())
