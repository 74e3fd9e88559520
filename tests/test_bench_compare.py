"""``quiver bench compare`` keeps working: a tiny run end to end, real mounts and rclone."""
from __future__ import annotations

import os

import pytest

from quiverfs.bench.compare import CACHED_MODES, FRACTIONS, SIZES, rclone_available, run
from quiverfs.bench.emulator import emulator_available
from quiverfs.mount_point import is_mounted

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
    pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed"),
    pytest.mark.skipif(not rclone_available(), reason="rclone is not installed"),
]

SUMMARY_KEYS = {"speedup_vs_rclone_10", "speedup_vs_rclone_50", "speedup_vs_rclone_100",
                "bucket_bytes_vs_rclone_10"}


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    workdir = str(tmp_path_factory.mktemp("compare"))
    plot = os.path.join(workdir, "compare.png")
    return run(quick=True, workdir=workdir, plot=plot, size="tiny"), workdir


@pytest.mark.timeout(120)
def test_tiny_run_measures_every_configuration(tiny_report):
    report, _ = tiny_report
    tiny = SIZES["tiny"]
    expected = {("direct", None, n) for n in tiny.job_counts} | {
        (mode, fraction, n) for mode in CACHED_MODES for fraction in FRACTIONS
        for n in tiny.job_counts}
    assert {(c["mode"], c["cache_fraction"], c["jobs"]) for c in report["configs"]} == expected
    for config in report["configs"]:
        epochs = tiny.epochs_direct if config["mode"] == "direct" else tiny.epochs
        assert len(config["epochs"]) == epochs
        assert all(e["items"] == config["jobs"] * tiny.items for e in config["epochs"])


def test_summary_holds_the_ratios_to_rclone(tiny_report):
    summary = tiny_report[0]["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert all(v is None or v > 0 for v in summary.values())


def test_every_read_went_through_the_capped_bucket(tiny_report):
    report, _ = tiny_report
    first_epochs = [c["epochs"][0] for c in report["configs"]]
    assert all(e["bucket_bytes"] > 0 for e in first_epochs), "a cold epoch read nothing"
    for config in report["configs"]:
        if config["mode"] in ("exact", "sub"):
            assert 0 <= config["all"]["hit_ratio"] <= 1


def test_plot_is_drawn_and_nothing_stays_mounted(tiny_report):
    _, workdir = tiny_report
    with open(os.path.join(workdir, "compare.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not any(is_mounted(os.path.join(workdir, d)) for d in os.listdir(workdir))
