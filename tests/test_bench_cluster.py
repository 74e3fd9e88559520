"""``quiver bench cluster`` keeps working: a tiny run end to end, real nodes and mounts;
with --kill-coordinator, a quick run on two coordinators whose leader is killed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quiverfs.bench.cluster import (FAILOVER_EPOCHS, MODES, NODES, SIZES, measure,
                                    measure_failover, plot_timeline)
from quiverfs.bench.emulator import emulator_available
from quiverfs.bench.etcd_process import etcd_available
from quiverfs.bench.ha_coordinators import ETCD_MISSING
from quiverfs.errors import ExitCode
from tests.test_digest_errors import assert_error

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
    pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed"),
]

SUMMARY_KEYS = {"bucket_bytes_ratio", "speedup_vs_direct", "speedup_vs_lru",
                "max_resident_chunks", "max_resident_chunks_timeline", "resident_chunk_limit",
                "items_per_s_direct",
                "items_per_s_lru", "items_per_s_sub", "bucket_bytes_ratio_direct",
                "bucket_bytes_ratio_lru", "hit_ratio_sub", "bucket_fetch_causes",
                "exactly_once", "goals_met"}


@pytest.mark.timeout(120)
def test_tiny_run_reports_the_summary_and_keeps_chunks_and_exactly_once(tmp_path):
    tiny = SIZES["tiny"]
    result = measure(tiny, str(tmp_path))
    summary = result.report["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert 2 <= summary["max_resident_chunks"] <= summary["resident_chunk_limit"]
    assert summary["max_resident_chunks_timeline"] <= summary["resident_chunk_limit"]
    assert result.report["modes"]["sub"]["timeline"], "the coordinator recorded no chunk states"
    # every job got each item of its shard (the whole dataset: world size 1) exactly once
    # per epoch; for sub, the paths are the manifests' in order
    assert set(result.orders) == set(MODES)
    for mode, jobs in result.orders.items():
        assert len(jobs) == tiny.jobs, mode
        for job in jobs:
            assert len(job) == (tiny.epochs_direct if mode == "direct" else tiny.epochs_cached)
            for paths in job:
                assert sorted(paths) == result.paths, mode
    assert summary["exactly_once"] is True
    # the fetches by cause add up to the nodes' bucket fetches of the steady epochs
    steady = result.report["modes"]["sub"]["epochs"][1:]
    assert (sum(c["fetches"] for c in summary["bucket_fetch_causes"].values())
            == sum(e["bucket_fetches"] for e in steady))
    assert set(result.report["modes"]["sub"]["bucket_fetch_causes"]) == set(NODES)
    plot = tmp_path / "timeline.png"
    plot_timeline(result.report, str(plot))
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert not any(os.path.ismount(os.path.join(root, d))
                   for root, dirs, _ in os.walk(tmp_path) for d in dirs)


FAILOVER_KEYS = {"failover_s", "failover_s_last_node", "takeover_s", "lease_ttl_s",
                 "speedup_failover_ratio", "items_per_s_calm", "items_per_s_failover",
                 "bucket_bytes_ratio_calm", "bucket_bytes_ratio_failover",
                 "generation_at_kill", "generation_after_takeover",
                 "etcd_writes_per_s_calm", "etcd_keys_written_per_s_calm",
                 "etcd_bytes_written_per_s_calm", "exactly_once",
                 "goals_met"}


@pytest.mark.skipif(not etcd_available(), reason="etcd is not installed")
@pytest.mark.timeout(400)
def test_quick_kill_coordinator_reports_the_failover_and_keeps_exactly_once(tmp_path):
    """--kill-coordinator at --quick size: two coordinators on a real etcd, the leader
    SIGKILLed in the middle of the third epoch; every job still reads each item once."""
    result = measure_failover(SIZES["quick"], str(tmp_path))
    summary = result.report["summary"]
    assert set(summary) == FAILOVER_KEYS
    assert set(summary["goals_met"]) == {"failover_s", "speedup_failover_ratio",
                                         "bucket_bytes_ratio_failover", "cycle_kept",
                                         "exactly_once"}
    jobs = result.orders["sub"]
    assert len(jobs) == SIZES["quick"].jobs
    for job in jobs:
        assert len(job) == FAILOVER_EPOCHS
        for paths in job:
            assert sorted(paths) == result.paths
    assert summary["exactly_once"] is True
    assert summary["lease_ttl_s"] == 5  # the default: the benchmark passes none
    # the kill fell in the epoch, and the nodes switched to the new leader after it
    assert 0 < summary["takeover_s"] <= summary["failover_s"] <= summary[
        "failover_s_last_node"]
    assert set(result.report["switches"]) == set(NODES)
    assert summary["generation_after_takeover"] >= summary["generation_at_kill"] >= 1
    # the cycle turned in the calm epoch: its transitions were written, and no more
    # transactions than keys
    assert 0 < summary["etcd_writes_per_s_calm"] <= summary["etcd_keys_written_per_s_calm"]
    assert summary["etcd_bytes_written_per_s_calm"] > 0
    assert not any(os.path.ismount(os.path.join(root, d))
                   for root, dirs, _ in os.walk(tmp_path) for d in dirs)


def test_kill_coordinator_without_etcd_is_skipped_in_one_line(tmp_path):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "quiverfs.cli", "bench", "cluster",
                        "--kill-coordinator", "--json", str(out)], capture_output=True,
                       text=True, env={**os.environ, "PATH": str(tmp_path)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["summary"] == {"skipped": ETCD_MISSING}
    assert "Traceback" not in r.stderr


def test_kill_coordinator_draws_no_plot(tmp_path, quiver):
    r = quiver("bench", "cluster", "--kill-coordinator", "--plot", str(tmp_path / "x.png"),
               "--json", str(tmp_path / "out.json"))
    assert_error(r, ExitCode.USAGE, "--plot", "--kill-coordinator")
