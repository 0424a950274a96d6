"""BankEvolution: what is distilled from which episode, credit, growth, and the bank's metrics."""

from __future__ import annotations

import numpy as np
import pytest

from hieragent.memory.bank import MemoryBank
from hieragent.memory.evolution import BankEvolution, key_observation, lesson_text, skill_text
from hieragent.memory.settings import MemorySettings
from hieragent.types import Batch, Retrieval, Trajectory, Turn

D = 8


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, D))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def turn(role: str, text: str, obs: str, retrieval: Retrieval | None = None) -> Turn:
    return Turn(role=role, prompt_ids=[1], action_ids=[2], old_logprobs=[0.0], text=text,
                observation=obs, retrieval=retrieval)


def episode(success: bool, chosen_ids: list[int] = (), seed: int = 0, **kw) -> Trajectory:
    r = None
    if chosen_ids:
        r = Retrieval(query=[0.0] * D, keys=[[0.0] * D] * len(chosen_ids), entry_ids=list(chosen_ids),
                      chosen=list(range(len(chosen_ids))), old_logprob=0.0, temperature=1.0)
    turns = [turn("planner", "go to the red ball", "you see a wall", r), turn("executor", "forward", "you see a wall"),
             turn("planner", "pick up the red ball", "a red ball 1 step forward"),
             turn("executor", "pick up", "a red ball 1 step forward")]
    return Trajectory(turns=turns, seed=seed, mission="pick up the red ball", success=success,
                      env_return=0.9 if success else 0.0, length=2, **kw)


class FixedKeys(MemoryBank):
    """A bank whose 'encoder' gives each distinct text a fixed random unit key (no model)."""

    def __init__(self, **kw) -> None:
        super().__init__(merge_threshold=0.99, **kw)
        self._rng, self._seen = np.random.default_rng(0), {}

    def embed(self, texts):
        for t in texts:
            self._seen.setdefault(t, unit(self._rng, 1)[0])
        return np.stack([self._seen[t] for t in texts])


def test_skill_holds_mission_plan_and_the_view_of_the_last_subgoal():
    t = episode(True)
    assert key_observation(t) == "a red ball 1 step forward"
    assert skill_text(t) == ("mission: pick up the red ball. plan: go to the red ball, pick up the red ball. "
                             "key observation: a red ball 1 step forward")


@pytest.mark.parametrize("kw, how", [({"loop_ended": True}, "in a loop of repeated actions"),
                                     ({"invalid_actions": 3}, "after 3 invalid actions"),
                                     ({}, "ran out of steps after 2")])
def test_lesson_says_what_was_tried_and_how_it_failed(kw, how):
    text = lesson_text(episode(False, **kw))
    assert text.startswith("lesson, mission: pick up the red ball. the plan go to the red ball, pick up")
    assert how in text and text.endswith("last view: a red ball 1 step forward")


def test_update_credits_used_entries_and_adds_a_skill_per_success_and_a_lesson_per_failure():
    bank = FixedKeys()
    seeded = bank.add(["seed a", "seed b"], source="seed")
    evo = BankEvolution(bank, MemorySettings(embedder="minilm"))
    bank.drain_changes()
    batch = Batch([episode(True, [seeded[0]], seed=1), episode(False, [seeded[0], seeded[1]], seed=2)])
    stats, changes = evo.update(batch, step=7)
    assert bank.entry(seeded[0])["uses"] == 2 and bank.entry(seeded[0])["utility"] == pytest.approx(0.45)
    assert bank.entry(seeded[1])["utility"] == 0.0 and bank.entry(seeded[1])["uses"] == 1
    kinds = {bank.entry(i)["kind"]: bank.entry(i) for i in bank.ids()[2:]}
    assert set(kinds) == {"skill", "lesson"}
    assert kinds["skill"]["source"] == "episode seed=1 group=0" and kinds["skill"]["created_step"] == 7
    assert [c["op"] for c in changes] == ["added", "added"] and {c["kind"] for c in changes} == {"skill", "lesson"}
    assert stats["bank/added"] == 2 and stats["bank/size"] == 4
    assert stats["bank/size_skill"] == 3 and stats["bank/size_lesson"] == 1  # 2 seeds + 1
    assert stats["bank/hit_rate"] == 0.0  # utilities were all 0 when these retrievals were judged
    stats, _ = evo.update(Batch([episode(False, [seeded[0]]), episode(False, [seeded[1]])]), step=8)
    assert stats["bank/hit_rate"] == 0.5  # seed a has positive utility now, seed b has not


def test_utility_quantiles_are_those_of_the_used_entries():
    bank = FixedKeys()
    ids = bank.add([f"e{i}" for i in range(10)])
    returns = np.random.default_rng(3).normal(size=6)
    for i, r in zip(ids, returns):
        bank.record_use([i], float(r))
    stats = BankEvolution(bank, MemorySettings()).describe()
    assert stats["bank/used_fraction"] == 0.6
    assert stats["bank/utility_p50"] == pytest.approx(np.median(returns.astype(np.float64)))
    assert stats["bank/utility_p90"] == pytest.approx(np.percentile(returns, 90))


def test_bank_grows_with_lessons_only_when_validation_success_falls_below_its_best():
    bank = FixedKeys(capacity=10)
    evo = BankEvolution(bank, MemorySettings(capacity=10, grow_on_drop=0.1, grow_factor=2.0, max_capacity=30))
    assert evo.on_validation(0.5, [episode(False)], step=1)["bank/grown"] == 0.0  # first sets the best
    assert evo.on_validation(0.45, [episode(False)], step=2)["bank/grown"] == 0.0  # within the margin
    assert len(bank) == 0 and bank.capacity == 10
    out = evo.on_validation(0.3, [episode(False, seed=4)], step=3)
    assert out["bank/grown"] == 1.0 and bank.capacity == 20 and out["bank/capacity"] == 20
    assert [bank.entry(i)["kind"] for i in bank.ids()] == ["lesson"]
    assert bank.entry(bank.ids()[0])["source"] == "validation seed=4"
    assert [c["op"] for c in bank.drain_changes()] == ["added", "grown"]
    evo.on_validation(0.2, [], step=4)
    assert bank.capacity == 30  # capped at max_capacity
    state = evo.state_dict()
    again = BankEvolution(FixedKeys(capacity=10), MemorySettings(grow_on_drop=0.1))
    again.load_state_dict(state)
    assert again.best_val == 0.5 and again.bank.capacity == 30


def test_bad_memory_settings_name_the_key():
    with pytest.raises(ValueError, match="memory.grow_factor"):
        MemorySettings(grow_factor=0.5)
    with pytest.raises(ValueError, match="memory.capacity"):
        MemorySettings(capacity=10, max_capacity=5)
    with pytest.raises(ValueError, match="memory.contrastive_temperature"):
        MemorySettings(contrastive_temperature=0.0)
