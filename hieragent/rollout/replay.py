"""A replay buffer of rollout batches that knows how stale every turn is.

Each ``Turn`` carries ``policy_version``, the optimizer step of the weights that produced
it, and its behaviour log-probabilities. The buffer keeps recent batches so that later
updates can reuse them; the staleness of a turn at optimizer step ``v`` is
``v - turn.policy_version``. A batch whose staleness exceeds ``max_staleness`` is dropped
before it is used again, and the turns dropped are counted, so a log shows how much data
the staleness limit threw away.

The buffer is plain data: ``state_dict`` turns it into lists and dicts, so it travels in a
Lightning checkpoint and a resumed run replays the same batches.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

from hieragent.types import Batch, Retrieval, Trajectory, Turn


@dataclass
class ReplaySettings:
    """How rollouts are reused across updates (the off-policy part of training).

    Attributes:
        updates_per_batch: Optimizer steps per training step, each on the retained data;
            every step after the first is off-policy.
        max_staleness: Oldest data kept, in optimizer steps (``policy version`` lags). ``0``
            trains on the fresh batch only; with ``updates_per_batch: 4``, ``8`` also replays
            the two previous batches.
        max_batches: Most batches held at once, whatever their staleness.
        rollout_lag: Roll out with the adapters as they were this many training steps ago,
            as an asynchronous actor would: the fresh batch is then already stale. ``0``
            rolls out with the current weights.
    """

    updates_per_batch: int = 1
    max_staleness: int = 0
    max_batches: int = 4
    rollout_lag: int = 0

    def __post_init__(self) -> None:
        for key in ("updates_per_batch", "max_batches"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.replay.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_staleness", "rollout_lag"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.replay.{key} must be >= 0, got {getattr(self, key)}")
        arrival = self.rollout_lag * self.updates_per_batch
        if self.max_staleness < arrival:
            # a lagged batch is this stale when it arrives; a lower limit would drop them all
            raise ValueError(f"model.replay.max_staleness ({self.max_staleness}) must be >= rollout_lag x "
                             f"updates_per_batch ({arrival}), the staleness of a fresh lagged batch")


class ReplayBuffer:
    """Recent batches, oldest first, with the staleness limit applied on every read."""

    def __init__(self, max_staleness: int = 0, max_batches: int = 4) -> None:
        self.max_staleness, self.max_batches = max_staleness, max_batches
        self._batches: deque[Batch] = deque()
        self.dropped_turns = 0  # over the whole run

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, batch: Batch) -> None:
        self._batches.append(batch)
        while len(self._batches) > self.max_batches:
            self.dropped_turns += len(self._batches.popleft().turns())

    def retained(self, version: int) -> list[Batch]:
        """The batches still usable at optimizer step ``version``; older ones are dropped.

        A batch is as stale as its oldest turn, so a kept batch never holds a turn beyond
        the limit.
        """
        kept: deque[Batch] = deque()
        for batch in self._batches:
            turns = batch.turns()
            oldest = min((t.policy_version for t in turns), default=version)
            if version - oldest > self.max_staleness:
                self.dropped_turns += len(turns)
            else:
                kept.append(batch)
        self._batches = kept
        return list(kept)

    def discard(self, batches: list[Batch]) -> int:
        """Drop these batches (matched by identity) from the buffer; returns how many were held."""
        drop = {id(b) for b in batches}
        kept = deque(b for b in self._batches if id(b) not in drop)
        n = len(self._batches) - len(kept)
        self.dropped_turns += sum(len(b.turns()) for b in self._batches if id(b) in drop)
        self._batches = kept
        return n

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"batches": [_plain(b) for b in self._batches], "dropped_turns": self.dropped_turns}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._batches = deque(_batch_from_dict(b) for b in state["batches"])
        self.dropped_turns = int(state["dropped_turns"])


def staleness(turns: list[Turn], version: int) -> list[int]:
    """Optimizer steps between the weights that produced each turn and ``version``."""
    return [version - t.policy_version for t in turns]


def _plain(batch: Batch) -> dict[str, Any]:
    """``batch`` as dicts and lists (retrieval vectors too): what a checkpoint stores."""
    out = dataclasses.asdict(batch)
    for tr, trajectory in zip(out["trajectories"], batch.trajectories):
        for t, turn in zip(tr["turns"], trajectory.turns):
            if turn.retrieval is not None:
                t["retrieval"] = turn.retrieval.plain()
    return out


def _batch_from_dict(data: dict[str, Any]) -> Batch:
    trajectories = []
    for tr in data["trajectories"]:
        turns = []
        for t in tr["turns"]:
            retrieval = Retrieval(**t["retrieval"]) if t.get("retrieval") is not None else None
            turns.append(Turn(**{**t, "retrieval": retrieval}))
        trajectories.append(Trajectory(**{**tr, "turns": turns}))
    return Batch(trajectories=trajectories, policy_version=int(data["policy_version"]))
