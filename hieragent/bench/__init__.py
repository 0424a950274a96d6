"""Benchmarks: scripts that print ratios against a baseline measured in the same run."""

from __future__ import annotations

import argparse


def at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Refuse (``parser.error``) any of the integer options ``names`` below 1, naming it."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
