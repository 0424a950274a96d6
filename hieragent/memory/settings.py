"""How the joint module builds and grows its memory/skill bank."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemorySettings:
    """The skill bank.

    Attributes:
        enabled: Use a bank at all (the flat baseline has none).
        embedder: Frozen sentence-transformers encoder: ``minilm`` (the offline package),
            a local path, or a cached Hugging Face id.
        capacity: Most entries kept; the lowest-utility ones are evicted beyond it.
        merge_threshold: Cosine similarity above which a new skill merges into an old one.
        seed_file: JSONL of seed skills (``data/skills.jsonl``); empty for an empty bank.
        add_skills: Distil a skill from every successful training episode.
    """

    enabled: bool = True
    embedder: str = "minilm"
    capacity: int = 1000
    merge_threshold: float = 0.95
    seed_file: str = "data/skills.jsonl"
    add_skills: bool = True
