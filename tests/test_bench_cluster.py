"""``quiver bench cluster`` keeps working: a tiny run end to end, real nodes and mounts."""
from __future__ import annotations

import os

import pytest

from quiverfs.bench.cluster import MODES, NODES, SIZES, measure, plot_timeline
from quiverfs.bench.emulator import emulator_available

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
