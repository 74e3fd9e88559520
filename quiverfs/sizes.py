"""Parsing and printing byte sizes (``10G``, ``512MiB``, ``1.5T``)."""
from __future__ import annotations

import decimal
import re

from quiverfs.errors import ExitCode, QuietError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE | re.ASCII)
# 1 EiB: beyond any cache, budget or chunk, and far inside the signed 64-bit integers
# that byte counts end up in (SQLite, st_size, Prometheus).
MAX_SIZE = 1 << 60


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in ``text``: a number with an optional K/M/G/T suffix (powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise QuietError(f"invalid {what} {text!r}: use a number with an optional K, M, G or T "
                         "suffix, e.g. 20G", ExitCode.USAGE)
    # Decimal, not float: exact for ordinary sizes, and no overflow on a 400-digit one.
    n = decimal.Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    if n > MAX_SIZE:
        shown = m.group(1) if len(m.group(1)) <= 24 else f"{m.group(1)[:20]}..."
        raise QuietError(f"{what} {shown}{m.group(2)} is too large: at most "
                         f"{MAX_SIZE >> 40}T (1 EiB)", ExitCode.USAGE)
    return int(n)


def human(n: float) -> str:
    """A short human-readable size, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
