"""``quiver bench allocation`` keeps working: a tiny run end to end, real mountd and jobs."""
from __future__ import annotations

import os

import pytest

from quiverfs.bench.allocation import SIZES, measure, plot_throughput
from quiverfs.bench.emulator import emulator_available

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
    pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed"),
    pytest.mark.slow,
]


@pytest.mark.timeout(150)
def test_tiny_run_reports_every_budget_and_keeps_exactly_once(tmp_path):
    tiny = SIZES["tiny"]
    report = measure(tiny, str(tmp_path))
    pcts = [round(b * 100) for b in tiny.budgets]
    summary = report["summary"]
    assert set(summary) == {
        *(f"{key}_{p}" for p in pcts for key in ("gain_vs_lru", "gain_vs_nocache",
                                                  "lru_vs_nocache")),
        "items_per_s_nocache", "exactly_once", "goals_met"}
    assert [(c["kind"], c["budget"]) for c in report["configs"]] == [
        ("nocache", 0.0), *((kind, b) for b in tiny.budgets for kind in ("lru", "quiver"))]
    for config in report["configs"]:
        assert config["items_per_s"] > 0, config["kind"]
        assert set(config["types"]) == {t.name for t in tiny.types}
        for t in tiny.types:
            jobs = config["types"][t.name]["jobs"]
            assert len(jobs) == t.jobs
            for job in jobs:
                # each job read its whole dataset (world size 1) exactly once per finished
                # epoch, whatever mountd's allocation did meanwhile
                assert job["exactly_once"] is True, (config["kind"], job)
                assert job["epochs_complete"] >= 1 or t.compute_s > 0, (config["kind"], job)
    for config in report["configs"][1:]:  # through mountd: its fetches, by dataset
        causes = config["bucket_fetch_causes"]
        assert set(causes) == {t.name for t in tiny.types}
        assert all(sum(c["fetches"] for c in by_cause.values()) > 0
                   for by_cause in causes.values()), config["kind"]
    quiver = [c for c in report["configs"] if c["kind"] == "quiver"]
    for config in quiver:
        assert set(config["modes"]) == {t.name for t in tiny.types}
        assert set(config["modes"].values()) <= {"full", "coop", "none"}
        assert set(config["gain"]) == set(config["modes"])
        assert all("t_miss" in j and "t_hit" in j and "benefit" in j
                   for v in config["types"].values() for j in v["jobs"])
    assert summary["exactly_once"] is True
    plot = tmp_path / "allocation.png"
    plot_throughput(report, str(plot))
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert not any(os.path.ismount(os.path.join(root, d))
                   for root, dirs, _ in os.walk(tmp_path) for d in dirs)
