"""How the joint module builds, searches, trains and grows its memory/skill bank."""

from __future__ import annotations

from dataclasses import dataclass, field

from hieragent.memory.structures import IndexSpec


@dataclass
class MemorySettings:
    """The memory/skill bank.

    Attributes:
        enabled: Use a bank at all (the flat baseline has none).
        embedder: Frozen sentence-transformers encoder: ``minilm`` (the offline package),
            a local path, or a cached Hugging Face id.
        capacity: Most entries kept; the lowest-utility ones are evicted beyond it.
        merge_threshold: Cosine similarity above which a new entry merges into an old one
            of the same kind.
        seed_file: JSONL of seed skills (``data/skills.jsonl``); empty for an empty bank.
        index: The FAISS index: ``flat`` (exact), ``ivf_flat``, ``ivf_pq``, ``ivf_fastscan``,
            ``hnsw``, or ``auto`` (exact, then from 50k entries the kind and search settings
            this machine measured best); see ``hieragent.memory.index`` and ``autotune``.
        add_skills: Distil a skill (mission, subgoals, key observation) from every
            successful training episode.
        add_lessons: Distil a lesson (what was tried, how it failed) from every failed one.
        add_episodes: Store every training episode as an episodic memory too.
        grow_on_drop: Grow the bank when validation success falls this far below its best
            (SkillRL's recursive evolution): capacity times ``grow_factor`` and the lessons
            of the failed validation episodes. 0 turns it off.
        grow_factor: Capacity multiplier of one growth.
        max_capacity: Capacity never grows past this.
        contrastive_coef: Weight of the auxiliary InfoNCE loss that pulls the adapted query
            of a successful episode's retrievals toward the key of the skill it produced,
            against the other candidates. 0 turns it off.
        contrastive_temperature: Temperature of that loss.
    """

    enabled: bool = True
    embedder: str = "minilm"
    capacity: int = 1000
    merge_threshold: float = 0.95
    seed_file: str = "data/skills.jsonl"
    index: IndexSpec = field(default_factory=IndexSpec)
    add_skills: bool = True
    add_lessons: bool = True
    add_episodes: bool = False
    grow_on_drop: float = 0.0
    grow_factor: float = 1.5
    max_capacity: int = 100_000
    contrastive_coef: float = 0.0
    contrastive_temperature: float = 0.1

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.max_capacity < self.capacity:
            raise ValueError(f"memory.capacity must be >= 1 and <= memory.max_capacity, got "
                             f"{self.capacity} and {self.max_capacity}")
        if self.grow_factor < 1:
            raise ValueError(f"memory.grow_factor must be >= 1, got {self.grow_factor}")
        if self.grow_on_drop < 0 or self.contrastive_coef < 0:
            raise ValueError("memory.grow_on_drop and memory.contrastive_coef must be >= 0")
        if self.contrastive_temperature <= 0:
            raise ValueError(f"memory.contrastive_temperature must be > 0, got {self.contrastive_temperature}")
