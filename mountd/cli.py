"""The daemon-side subcommands: mountd, mount, umount, status."""
from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    return None
