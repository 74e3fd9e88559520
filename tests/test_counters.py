"""mountd's counters are the enums of quiverfs.counters: their names are the ones
docs/operations.md documents for ``quiver status --json``, ReadStats refuses a bare
string, and no module of mountd counts or reads a counter by a string literal."""
from __future__ import annotations

import ast
import collections
import re
import types
from pathlib import Path

import pytest

from mountd.fetch.read_stats import ReadStats
from quiverfs.counters import (BUCKET_BYTES_BY_CAUSE, BUCKET_FETCHES_BY_CAUSE, FetchCause,
                               ReadCounter, SamplerJobCounter, ViewJobCounter)

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS = ROOT / "docs" / "operations.md"
# The header of each table in docs/operations.md's "Counters", and the enum it documents.
TABLES = {"Read counter": ReadCounter, "Cause": FetchCause,
          "Sampler job counter": SamplerJobCounter, "View job counter": ViewJobCounter}
PER_CAUSE = ("bucket_fetches_CAUSE", "bucket_bytes_CAUSE")  # a row for every cause
COUNTERS = ("counters", "c")  # what mountd's modules call a map of counters


def documented() -> dict[str, set[str]]:
    """The names in each table of the docs' "Counters" section, by its header."""
    text = OPERATIONS.read_text(encoding="utf-8")
    (section,) = re.findall(r"^## Counters\n(.*?)^## ", text, re.S | re.M)
    tables: dict[str, set[str]] = {}
    header = None
    for line in section.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        first = line.split("|")[1].strip()
        if header is None:
            header = first
            tables[header] = set()
        elif not first.startswith("---"):
            tables[header].update(re.findall(r"`(\w+)`", first))
    return tables


def test_the_documented_names_are_the_enums():
    tables = documented()
    assert set(tables) == set(TABLES)
    causes = tables["Cause"]
    reads = tables["Read counter"]
    assert set(PER_CAUSE) <= reads, "the per-cause counters are no longer documented"
    reads = (reads - set(PER_CAUSE)) | {pattern.replace("CAUSE", cause)
                                        for pattern in PER_CAUSE for cause in causes}
    tables["Read counter"] = reads
    for header, kind in TABLES.items():
        assert {member.value for member in kind} == tables[header], header


def test_each_cause_has_its_fetches_and_bytes():
    """The names readers split ``bucket_fetches_CAUSE`` by, and no such member without a
    cause."""
    for cause in FetchCause:
        assert BUCKET_FETCHES_BY_CAUSE[cause] == f"bucket_fetches_{cause.value}"
        assert BUCKET_BYTES_BY_CAUSE[cause] == f"bucket_bytes_{cause.value}"
    per_cause = {m for m in ReadCounter if m.name.startswith(("BUCKET_FETCHES_", "BUCKET_BYTES_"))}
    assert per_cause == {*BUCKET_FETCHES_BY_CAUSE.values(), *BUCKET_BYTES_BY_CAUSE.values()}


def test_read_stats_counts_members_and_refuses_strings():
    stats = ReadStats()
    ds = types.SimpleNamespace(counters=collections.Counter())
    stats.count(ds, ReadCounter.LOCAL_HITS)
    stats.fetched(ds, FetchCause.PREFETCH, 100)
    expected = {ReadCounter.LOCAL_HITS: 1, ReadCounter.BUCKET_FETCHES: 1,
                ReadCounter.BUCKET_BYTES: 100, ReadCounter.BUCKET_FETCHES_PREFETCH: 1,
                ReadCounter.BUCKET_BYTES_PREFETCH: 100}
    assert stats.counters == ds.counters == expected
    assert ReadStats.by_cause(stats.counters)["prefetch"] == {"fetches": 1, "bytes": 100}
    for bare in ("local_hits", "local_hist"):
        with pytest.raises(TypeError):
            stats.count(ds, bare)  # type: ignore[arg-type]
    assert stats.counters == ds.counters == expected


def _name(node: ast.expr) -> str | None:
    """What an expression is called: ``a.b`` b, ``a`` a, ``a["b"]`` b."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    return None


def _has_string(node: ast.expr) -> bool:
    return any(isinstance(n, ast.JoinedStr)
               or isinstance(n, ast.Constant) and isinstance(n.value, str)
               for n in ast.walk(node))


def string_keys(source: str) -> list[int]:
    """Lines that count or read a counter by a string: ``x.counters[...]`` and
    ``x.counters.get(...)`` (or ``c``, as mountd calls counters for short), and
    ``ReadStats.count(ds, ...)``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Subscript) and _name(node.value) in COUNTERS:
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "get" and _name(node.func.value) in COUNTERS and node.args:
                key = node.args[0]
            elif node.func.attr == "count" and len(node.args) > 1:
                key = node.args[1]
        if key is not None and _has_string(key):
            lines.append(node.lineno)
    return lines


def test_mountd_names_no_counter_by_a_string():
    found = {str(path.relative_to(ROOT)): string_keys(path.read_text(encoding="utf-8"))
             for path in sorted((ROOT / "mountd").rglob("*.py"))}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_a_string_key_is_found():
    """The check above sees each way of naming a counter by a string."""
    source = '''
stats.count(ds, "local_hits")
self.count(ds, f"bucket_fetches_{cause}", n)
job.counters["hits" if hit else "misses"] += 1
c["pushed"]
s["counters"].get("hits", 0)
print(f"hits {c.get('local_hits', 0)}")
self.stats.count(ds, ReadCounter.LOCAL_HITS)
job.counters[SamplerJobCounter.HITS] += 1
'''
    assert sorted(string_keys(source)) == [2, 3, 4, 5, 6, 7]
