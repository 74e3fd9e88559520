"""Parsing and printing byte sizes (``10G``, ``512MiB``, ``1.5T``)."""
from __future__ import annotations

import re

from quiverfs.errors import ExitCode, QuietError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in ``text``: a number with an optional K/M/G/T suffix (powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise QuietError(f"invalid {what} {text!r}: use a number with an optional K, M, G or T "
                         "suffix, e.g. 20G", ExitCode.USAGE)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: float) -> str:
    """A short human-readable size, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
