"""``quiver bench compare`` keeps working: a tiny run end to end, real mounts and rclone."""
from __future__ import annotations

import os

import pytest

from quiverfs.bench.compare import (CACHED_MODES, FRACTIONS, GOALS, SIZES, VIEW_FRACTION,
                                    rclone_available, run)
from quiverfs.bench.emulator import emulator_available
from quiverfs.counters import FetchCause
from quiverfs.mount_point import is_mounted

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
    pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed"),
    pytest.mark.skipif(not rclone_available(), reason="rclone is not installed"),
]

SUMMARY_KEYS = {"speedup_vs_rclone_10", "speedup_vs_rclone_50", "speedup_vs_rclone_100",
                "bucket_bytes_vs_rclone_10", "speedup_vs_rclone_10_1job",
                "epoch0_bucket_ratio_sub_10", "epoch0_speedup_vs_rclone_10",
                "epoch0_exact_vs_rclone_10_1job", "bucket_utilization_sub_10",
                "wait_any_s_sub_10", "budget_used_sub_50",
                "speedup_vs_rclone_10_view", "speedup_view_vs_sub_10",
                "bucket_bytes_vs_rclone_10_view", "hit_ratio_sub_10", "hit_ratio_view_10"}
LATENCY_MS = 20.0  # the tiny run's bucket latency: the option reaches the proxy


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    workdir = str(tmp_path_factory.mktemp("compare"))
    plot = os.path.join(workdir, "compare.png")
    return run(quick=True, workdir=workdir, plot=plot, size="tiny",
               latency_ms=LATENCY_MS), workdir


@pytest.mark.timeout(240)  # the module's tiny run (about 2 minutes on 2 busy cores)
def test_tiny_run_measures_every_configuration(tiny_report):
    report, _ = tiny_report
    tiny = SIZES["tiny"]
    expected = {("direct", None, n) for n in tiny.job_counts} | {
        (mode, fraction, n) for mode in CACHED_MODES for fraction in FRACTIONS
        for n in tiny.job_counts} | {("view", VIEW_FRACTION, max(tiny.job_counts))}
    assert {(c["mode"], c["cache_fraction"], c["jobs"]) for c in report["configs"]} == expected
    for config in report["configs"]:
        epochs = tiny.epochs_direct if config["mode"] == "direct" else tiny.epochs
        assert len(config["epochs"]) == epochs
        assert all(e["items"] == config["jobs"] * tiny.items for e in config["epochs"])


def test_summary_holds_the_ratios_to_rclone(tiny_report):
    report = tiny_report[0]
    summary = report["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert all(isinstance(v, (int, float)) and v > 0 for v in summary.values()), summary
    assert set(report["goals"]) == set(GOALS) <= SUMMARY_KEYS
    assert report["settings"]["latency_ms"] == LATENCY_MS


def test_new_keys_are_in_their_ranges(tiny_report):
    summary = tiny_report[0]["summary"]
    # epoch 0 of a cold cache reads the whole dataset at least once
    assert 1 <= summary["epoch0_bucket_ratio_sub_10"] < 10
    # the bucket cannot send much faster than its cap (bins of 50 ms, bursts of 256 KiB)
    assert 0 < summary["bucket_utilization_sub_10"] <= 1.5
    # mountd's store is bounded by its budget (a little more between evictions)
    assert 0 < summary["budget_used_sub_50"] <= 1.2
    for key in ("speedup_vs_rclone_10_1job", "epoch0_speedup_vs_rclone_10",
                "epoch0_exact_vs_rclone_10_1job",
                "speedup_vs_rclone_10_view", "speedup_view_vs_sub_10"):
        assert 0.05 < summary[key] < 20, key
    for key in ("hit_ratio_sub_10", "hit_ratio_view_10"):
        assert 0 < summary[key] <= 1, key


def test_view_jobs_are_told_apart(tiny_report):
    """The view's jobs share the bench's process group but each has its own QUIVER_JOB:
    mountd tells them apart, and counts an open for every item they read."""
    view = next(c for c in tiny_report[0]["configs"] if c["mode"] == "view")
    assert view["cache_fraction"] == VIEW_FRACTION
    assert view["jobs"] == max(SIZES["tiny"].job_counts) > 1
    for epoch in view["epochs"]:
        assert epoch["mountd_jobs"] == view["jobs"]
        assert epoch["lookups"] == epoch["items"] == view["jobs"] * SIZES["tiny"].items


def test_jobs_report_their_waits(tiny_report):
    for config in tiny_report[0]["configs"]:
        for epoch in config["epochs"]:
            assert len(epoch["job_wait_s"]) == config["jobs"]
            # the union of the jobs' waits is within the epoch, and at least any one's
            assert max(epoch["job_wait_s"]) - 0.01 <= epoch["wait_any_s"] <= epoch["seconds"]


def test_mountd_counts_its_bucket_fetches_by_cause(tiny_report):
    for config in tiny_report[0]["configs"]:
        causes = config["bucket_fetch_causes"]
        if config["mode"] in ("direct", "rclone"):
            assert causes is None
            continue
        assert set(causes) == {c.value for c in FetchCause}
        fetched = {c for c, n in causes.items() if n["fetches"]}
        if config["mode"] == "exact":  # plain reads, no jobs: nothing but exact misses
            assert fetched == {"exact"}
        else:
            assert fetched and "prefetch" not in fetched
        assert causes == {c: {k: sum(e["bucket_fetch_causes"][c][k] for e in config["epochs"])
                              for k in n} for c, n in causes.items()}


def test_every_read_went_through_the_capped_bucket(tiny_report):
    report, _ = tiny_report
    first_epochs = [c["epochs"][0] for c in report["configs"]]
    assert all(e["bucket_bytes"] > 0 for e in first_epochs), "a cold epoch read nothing"
    for config in report["configs"]:
        if config["mode"] in ("exact", "sub", "view"):
            assert 0 <= config["all"]["hit_ratio"] <= 1


def test_plot_is_drawn_and_nothing_stays_mounted(tiny_report):
    _, workdir = tiny_report
    with open(os.path.join(workdir, "compare.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not any(is_mounted(os.path.join(workdir, d)) for d in os.listdir(workdir))
