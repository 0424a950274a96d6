"""How the bank evolves with training (after SkillRL, arXiv:2602.08234), and what it reports.

After every rollout batch (``BankEvolution.update``):

  * each entry a planner retrieved is credited with its episode's return (``record_use``);
  * a successful episode is distilled into a ``skill``: its mission, its subgoal sequence
    and its key observation, the view in which the last (the completing) subgoal was chosen;
  * a failed one into a ``lesson``: the mission, the plan that did not work, how it ended
    (a loop, invalid actions, or the step limit) and the last view;
  * optionally every episode into an ``episodic`` memory;
  * near-duplicates merge and low-utility entries are evicted by the bank itself.

``on_validation`` grows the bank, as SkillRL's recursive evolution does, when validation
success falls ``grow_on_drop`` below the best seen: capacity rises by ``grow_factor`` and
the lessons of the failed validation episodes are added. Every change reaches the log.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hieragent.memory.bank import MemoryBank
from hieragent.memory.settings import MemorySettings
from hieragent.types import Batch, Retrieval, Trajectory


def key_observation(trajectory: Trajectory) -> str:
    """The view in which the planner chose its last subgoal (the episode's first, if none)."""
    planner = trajectory.of("planner")
    if planner and planner[-1].observation:
        return planner[-1].observation
    return next((t.observation for t in trajectory.turns if t.observation), "")


def _plan(trajectory: Trajectory) -> str:
    return ", ".join(t.text for t in trajectory.of("planner")) or "none"


def skill_text(trajectory: Trajectory) -> str:
    """A skill from a successful episode: mission, subgoal sequence, key observation."""
    text = f"mission: {trajectory.mission}. plan: {_plan(trajectory)}"
    obs = key_observation(trajectory)
    return f"{text}. key observation: {obs}" if obs else text


def lesson_text(trajectory: Trajectory) -> str:
    """A lesson from a failed episode: what was tried, how it ended, and the last view."""
    if trajectory.loop_ended:
        how = "it ended in a loop of repeated actions"
    elif trajectory.invalid_actions:
        how = f"it ended after {trajectory.invalid_actions} invalid actions or subgoals"
    else:
        how = f"it ran out of steps after {trajectory.length}"
    last = next((t.observation for t in reversed(trajectory.turns) if t.observation), "")
    text = f"lesson, mission: {trajectory.mission}. the plan {_plan(trajectory)} failed: {how}"
    return f"{text}. last view: {last}" if last else text


def episode_text(trajectory: Trajectory) -> str:
    """An episodic memory: what happened in one episode, success or not."""
    outcome = "succeeded" if trajectory.success else "failed"
    return (f"episode, mission: {trajectory.mission}. plan: {_plan(trajectory)}. {outcome} "
            f"in {trajectory.length} steps with return {trajectory.env_return:.2f}")


def retrieved_ids(trajectory: Trajectory) -> list[int]:
    """Ids of the entries the episode's planner turns chose, each once, in first-use order."""
    out = (r.entry_ids[c] for t in trajectory.of("planner") if (r := t.retrieval) is not None for c in r.chosen)
    return list(dict.fromkeys(out))


class BankEvolution:
    """Applies ``MemorySettings`` to a bank: credit, distil, grow; and reports on the bank."""

    def __init__(self, bank: MemoryBank, settings: MemorySettings) -> None:
        self.bank, self.settings = bank, settings
        self.best_val: float | None = None
        self._latency_seen = Counter(bank.latency)

    def distil(self, trajectories: list[Trajectory]) -> dict[str, list[tuple[str, str]]]:
        """``{kind: [(text, source)]}`` that ``update`` would add for these episodes."""
        s = self.settings
        out: dict[str, list[tuple[str, str]]] = {"skill": [], "lesson": [], "episodic": []}
        for t in trajectories:
            source = f"episode seed={t.seed} group={t.group}"
            if s.add_skills and t.success and t.of("planner"):
                out["skill"].append((skill_text(t), source))
            if s.add_lessons and not t.success and t.of("planner"):
                out["lesson"].append((lesson_text(t), source))
            if s.add_episodes:
                out["episodic"].append((episode_text(t), source))
        return out

    def prepare(self, batch: Batch, own: list[Trajectory] | None = None,
                ) -> tuple[np.ndarray | None, tuple[list[Retrieval], torch.Tensor] | None]:
        """Before the update: embed the batch's new skills once (``update`` adds them with these
        keys), and pair every retrieval of a successful episode with the key of the skill that
        episode produced, for the contrastive loss: ``(skill keys [S, D], (retrievals, [P, D]))``.

        ``own``: the episodes whose retrievals this process trains on (across processes, its
        own, while ``batch`` holds every rank's); ``None`` is all of ``batch``.
        """
        successes = [t for t in batch.trajectories if t.success and t.of("planner")]
        if not successes or not self.settings.add_skills:
            return None, None
        keys = self.bank.embed([text for text, _ in self.distil(successes)["skill"]])  # [S, D]
        mine = None if own is None else {id(t) for t in own}
        pairs = [(turn.retrieval, keys[j]) for j, t in enumerate(successes) if mine is None or id(t) in mine
                 for turn in t.of("planner") if turn.retrieval is not None]
        if self.settings.contrastive_coef <= 0 or not pairs:
            return keys, None
        return keys, ([r for r, _ in pairs], torch.from_numpy(np.stack([k for _, k in pairs])))

    def update(self, batch: Batch, step: int,
               skill_keys: np.ndarray | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Credit, distil and add for one training batch: ``(metrics, changes)``.

        ``skill_keys`` are the embeddings of the batch's skill texts when the caller already
        has them (the contrastive loss needs them before the update), so nothing embeds twice.
        """
        before = Counter(self.bank.events)
        stats = {"bank/hit_rate": self.hit_rate(batch.trajectories)}
        for t in batch.trajectories:
            used = retrieved_ids(t)
            if used:
                self.bank.record_use(used, t.env_return)
        for kind, rows in self.distil(batch.trajectories).items():
            if rows:
                keys = skill_keys if kind == "skill" else None
                self.bank.add([r[0] for r in rows], kind=kind, source=[r[1] for r in rows], step=step, keys=keys)
        after = self.bank.events
        stats.update({f"bank/{k}": float(after[k] - before.get(k, 0)) for k in ("added", "merged", "evicted")})
        stats.update(self.describe())
        return stats, self.bank.drain_changes()

    def on_validation(self, success: float, failed: list[Trajectory], step: int) -> dict[str, float]:
        """Grow the bank when validation success fell ``grow_on_drop`` below its best."""
        s = self.settings
        grew = 0.0
        if self.best_val is not None and s.grow_on_drop > 0 and success <= self.best_val - s.grow_on_drop:
            self.bank.capacity = min(int(self.bank.capacity * s.grow_factor), s.max_capacity)
            lessons = [t for t in failed if t.of("planner")]
            if lessons:
                self.bank.add([lesson_text(t) for t in lessons], kind="lesson",
                              source=[f"validation seed={t.seed}" for t in lessons], step=step)
            grew = 1.0
            self.bank.changes.append({"op": "grown", "step": int(step), "capacity": self.bank.capacity,
                                      "val_success": float(success), "best_val": float(self.best_val)})
        self.best_val = success if self.best_val is None else max(self.best_val, success)
        return {"bank/grown": grew, "bank/capacity": float(self.bank.capacity)}

    def hit_rate(self, trajectories: list[Trajectory]) -> float:
        """Share of planner retrievals that chose at least one entry of positive utility
        (one that was used before in episodes with positive return); NaN without retrievals."""
        hits = total = 0
        for t in trajectories:
            for turn in t.of("planner"):
                r = turn.retrieval
                if r is None:
                    continue
                total += 1
                hits += any(self.bank.utility(r.entry_ids[c]) > 0 for c in r.chosen)
        return hits / total if total else float("nan")

    def describe(self) -> dict[str, float]:
        """Size by kind, the utility distribution of used entries, and retrieval latency."""
        bank = self.bank
        out = {**bank.stats(), "bank/capacity": float(bank.capacity)}
        now = Counter(bank.latency)
        calls = now["queries"] - self._latency_seen["queries"]
        if calls:
            seconds = now["seconds"] - self._latency_seen["seconds"]
            out["bank/retrieval_ms_per_query"] = 1e3 * seconds / calls
        self._latency_seen = now
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"best_val": self.best_val, "capacity": self.bank.capacity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_val = state.get("best_val")
        self.bank.capacity = int(state.get("capacity", self.bank.capacity))



def append_changes(path: Path, changes: list[dict[str, Any]]) -> None:
    """Append bank changes (added, merged, evicted, updated, grown) to a JSONL log."""
    if not changes:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(c) + "\n" for c in changes)
