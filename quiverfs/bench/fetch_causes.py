"""mountd's bucket fetches by cause, as benchmarks report them: the ``bucket_fetch_causes``
maps of ``quiver status --json`` ({cause: {"fetches": n, "bytes": b}}), taken apart
between two moments and added up over nodes or epochs."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Causes = dict[str, dict[str, int]]


def of_dataset(status: dict[str, Any], name: str) -> Causes:
    """The dataset ``name``'s map in a mountd's status."""
    return next(ds["bucket_fetch_causes"] for ds in status["datasets"] if ds["name"] == name)


def since(before: Causes, after: Causes) -> Causes:
    """The fetches counted between two maps of the same counters."""
    return {cause: {k: n - before.get(cause, {}).get(k, 0) for k, n in counts.items()}
            for cause, counts in after.items()}


def total(maps: Iterable[Causes]) -> Causes:
    """Maps added up (several nodes, or several epochs)."""
    out: Causes = {}
    for m in maps:
        for cause, counts in m.items():
            into = out.setdefault(cause, {})
            for k, n in counts.items():
                into[k] = into.get(k, 0) + n
    return out
