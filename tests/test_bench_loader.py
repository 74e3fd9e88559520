"""``quiver bench loader`` keeps working: a tiny run end to end, real mounts, real loader
processes, the concurrent emulator behind the latency proxy."""
from __future__ import annotations

import os

import pytest

from quiverfs.bench.emulator import emulator_available
from quiverfs.bench.loader import GOALS, IDLE_PASSES, PROCESSES, SIZES, run
from quiverfs.mount_point import is_mounted

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
    pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed"),
]

LATENCY_MS = 10.0  # the tiny run's bucket latency: the option reaches the proxy


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    workdir = str(tmp_path_factory.mktemp("loader"))
    return run(quick=True, workdir=workdir, latency_ms=LATENCY_MS, size="tiny"), workdir


@pytest.mark.timeout(180)  # the module's tiny run (under a minute on 2 busy cores)
def test_summary_has_every_key_and_goal(tiny_report):
    report, _ = tiny_report
    summary = report["summary"]
    expected = {"scaling_2_vs_1"} | {f"{key}_{p}" for p in PROCESSES for key in (
        "objects_per_s", "read_p99_idle_ms", "read_p99_during_load_ms",
        "p99_during_load_vs_idle")}
    assert set(summary) == expected
    assert all(isinstance(v, (int, float)) and v > 0 for v in summary.values()), summary
    assert set(GOALS) <= set(summary)
    assert report["settings"]["latency_ms"] == LATENCY_MS


def test_every_chunk_load_went_through_the_loader_processes(tiny_report):
    runs = tiny_report[0]["runs"]
    assert [r["loader_processes"] for r in runs] == list(PROCESSES)
    for r in runs:
        assert 0 < r["chunk_load_objects"] < SIZES["tiny"][1]
        assert r["loader_process_fetches"] == r["chunk_load_objects"]
        assert r["cpu_ms_per_object"]["loaders"] > 0


def test_reads_were_timed_as_hits_idle_and_during_the_loads(tiny_report):
    hits = SIZES["tiny"][0]
    for r in tiny_report[0]["runs"]:
        reads = r["reads"]
        assert reads["idle"]["reads"] == hits * IDLE_PASSES
        assert reads["during_load"]["reads"] > 0
        assert reads["hits_misses_during_load"] == 0  # the loads culled no cached file
        assert reads["idle"]["p50_ms"] <= reads["idle"]["p99_ms"] <= reads["idle"]["max_ms"]


def test_nothing_stays_mounted(tiny_report):
    _, workdir = tiny_report
    assert not any(is_mounted(os.path.join(workdir, d)) for d in os.listdir(workdir))
