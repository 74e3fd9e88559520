"""``quiver bench substitution`` keeps working: a tiny run end to end, real mounts."""
from __future__ import annotations

import os

import pytest

from quiverfs.bench.substitution import SIZES, run
from quiverfs.bench.emulator import emulator_available

SUMMARY_KEYS = {
    "hit_ratio_sub", "hit_ratio_lru", "bucket_bytes_ratio_sub", "bucket_bytes_ratio_lru",
    "items_per_s_sub", "items_per_s_lru", "exactly_once", "order_spearman_sub",
    "order_spearman_global", "label_hist_dev_sub", "label_hist_dev_global", "accuracy_global",
    "accuracy_sub", "accuracy_gap", "max_resident_chunks", "sub_vs_exact_cached"}


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
@pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed")
@pytest.mark.timeout(120)
def test_tiny_run_reports_the_summary_and_every_item_exactly_once(tmp_path):
    report = run(quick=True, workdir=str(tmp_path), size="tiny")
    summary = report["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert summary["exactly_once"] is True
    tiny = SIZES["tiny"]
    assert {(c["mode"], c["cache_fraction"], c["jobs"]) for c in report["configs"]} == {
        (mode, fraction, jobs) for mode in ("sub", "lru") for fraction, jobs in tiny.configs}
    for config in report["configs"]:
        assert len(config["epochs"]) == tiny.epochs
        assert all(e["items"] == config["jobs"] * tiny.items for e in config["epochs"])
    assert 0 <= summary["hit_ratio_sub"] <= 1 and 0 <= summary["hit_ratio_lru"] <= 1
    assert 1 <= summary["max_resident_chunks"] <= 2  # the chunk cycle ran, double-buffered
    assert 0 <= summary["accuracy_sub"] <= 100
    cached = report["cached"]  # the whole dataset cached: the sampler was handed segments
    assert summary["sub_vs_exact_cached"] > 0
    assert cached["runs"]["sub"]["cache_mode"] == "full"
    assert cached["runs"]["sub"]["counters"]["segments"] >= 1
    for config in report["configs"]:  # lru jobs read exactly: their misses are exact
        fetched = {c for c, n in config["bucket_fetch_causes"].items() if n["fetches"]}
        if config["mode"] == "lru":
            assert fetched == {"exact"}
        else:
            assert fetched
    assert not any(os.path.ismount(os.path.join(tmp_path, d)) for d in os.listdir(tmp_path))
