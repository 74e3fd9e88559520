"""``quiver bench allocation`` keeps working: a tiny run end to end, real mountd and jobs."""
from __future__ import annotations

import os

import pytest

from quiverfs.bench.allocation import (CACHED, CONSTRAINED, SIZES, measure, plot_throughput,
                                       workloads)
from quiverfs.bench.emulator import emulator_available

TINY = SIZES["tiny"]
RATIOS = ("gain_vs_lru", "gain_vs_nocache", "lru_vs_nocache")


def needs_mount(test):
    """The marks of a test of the tiny run: real mountd and emulator, slow."""
    for mark in (pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
                 pytest.mark.skipif(not emulator_available(),
                                    reason="gcp-storage-emulator is not installed"),
                 pytest.mark.slow):
        test = mark(test)
    return test


def test_the_headline_io_job_computes_20_ms_per_16_items_and_io0_nothing():
    for size in SIZES.values():
        headline, *others = workloads(size)
        assert (headline.name, headline.suffix, headline.size) == ("io20", "", size)
        io = {t.name: t.compute_s for t in size.types}["io"]
        assert io == pytest.approx(0.020 * size.batch_size / 16)
        assert [(w.name, w.suffix) for w in others] == [("io0", "_io0")]
        io0 = others[0].size
        assert {t.name: t.compute_s for t in io0.types} == {
            t.name: 0.0 if t.name == "io" else t.compute_s for t in size.types}
        assert io0.budgets == tuple(b for b in size.budgets if b in CONSTRAINED)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    workdir = str(tmp_path_factory.mktemp("allocation"))
    return measure(TINY, workdir), workdir


@needs_mount
@pytest.mark.timeout(300)  # the module's tiny run: 6 configurations
def test_tiny_run_measures_every_workload_and_budget(tiny_report):
    report = tiny_report[0]
    assert [(c["workload"], c["kind"], c["budget"]) for c in report["configs"]] == [
        (w.name, kind, b) for w in workloads(TINY)
        for kind, b in (("nocache", 0.0), *((k, b) for b in w.size.budgets for k in CACHED))]
    assert set(report["normalized"]) == {w.name for w in workloads(TINY)}
    assert report["headline"] == "io20"
    for config in report["configs"]:
        assert config["items_per_s"] > 0, config["kind"]
        assert set(config["types"]) == {t.name for t in TINY.types}


@needs_mount
def test_summary_has_every_workloads_ratios_and_the_goal_on_the_headline(tiny_report):
    summary = tiny_report[0]["summary"]
    assert set(summary) == {
        *(f"{key}_{round(b * 100)}{w.suffix}" for w in workloads(TINY)
          for b in w.size.budgets for key in RATIOS),
        *(f"items_per_s_nocache{w.suffix}" for w in workloads(TINY)),
        "exactly_once", "goals_met"}
    assert {"gain_vs_lru_30", "gain_vs_nocache_30", "gain_vs_lru_30_io0",
            "gain_vs_nocache_30_io0"} <= set(summary)
    assert set(summary["goals_met"]) == {f"gain_vs_lru_{round(b * 100)}"
                                         for b in TINY.budgets if b in CONSTRAINED}


@needs_mount
def test_each_job_computes_its_workloads_time_and_reads_exactly_once(tiny_report):
    compute = {w.name: {t.name: t.compute_s for t in w.size.types} for w in workloads(TINY)}
    for config in tiny_report[0]["configs"]:
        mine = compute[config["workload"]]
        for t in TINY.types:
            jobs = config["types"][t.name]["jobs"]
            assert len(jobs) == t.jobs
            for job in jobs:
                assert job["compute_s"] == mine[t.name]
                # each job read its whole dataset (world size 1) exactly once per finished
                # epoch, whatever mountd's allocation did meanwhile
                assert job["exactly_once"] is True, (config["kind"], job)
                assert job["epochs_complete"] >= 1 or mine[t.name] > 0, (config["kind"], job)
    assert tiny_report[0]["summary"]["exactly_once"] is True


@needs_mount
def test_mountd_counts_its_bucket_fetches_by_dataset(tiny_report):
    for config in tiny_report[0]["configs"]:
        if config["kind"] == "nocache":
            continue
        causes = config["bucket_fetch_causes"]
        assert set(causes) == {t.name for t in TINY.types}
        assert all(sum(c["fetches"] for c in by_cause.values()) > 0
                   for by_cause in causes.values()), config["kind"]


@needs_mount
def test_quiver_reports_its_allocation_and_the_jobs_benefits(tiny_report):
    for config in tiny_report[0]["configs"]:
        if config["kind"] != "quiver":
            continue
        assert set(config["modes"]) == {t.name for t in TINY.types}
        assert set(config["modes"].values()) <= {"full", "coop", "none"}
        assert set(config["gain"]) == set(config["modes"])
        assert all({"t_miss", "t_hit", "benefit", "chunk_wait_s"} <= set(j)
                   for v in config["types"].values() for j in v["jobs"])


@needs_mount
def test_plot_and_no_mount_left(tiny_report):
    report, workdir = tiny_report
    plot = os.path.join(workdir, "allocation.png")
    plot_throughput(report, plot)
    with open(plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not any(os.path.ismount(os.path.join(root, d))
                   for root, dirs, _ in os.walk(workdir) for d in dirs)
