"""``quiver bench read`` keeps working: the quick run end to end, real mounts, the
emulator and rclone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from quiverfs.bench import floor, read
from quiverfs.bench.compare import rclone_available
from quiverfs.bench.emulator import emulator_available
from quiverfs.bench.processes import MountdProcess
from quiverfs.errors import ExitCode
from quiverfs.mount_point import is_mounted
from tests.test_digest_errors import assert_error

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
    pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed"),
]

SUMMARY_KEYS = {"data_path", "warm_p99_ratio_16", "warm_ratio_1", "warm_ratio_4", "warm_ratio_16", "warm_ratio_64",
                "warm_ratio_small_16", "cold_ratio", "cpu_s_per_gb_hit", "store_ratio_16",
                "hot_ratio_16", "hot_ratio_64", "fuse_requests_per_file",
                "fuse_requests_per_file_store", "warm_mount_mb_s_16", "warm_direct_mb_s_16",
                "cold_latency_ms"}
RCLONE_KEYS = {"rclone_warm_ratio_16", "rclone_warm_ratio_64"}
FLOOR_KEYS = {"floor_warm_ratio_1", "floor_warm_ratio_4", "floor_warm_ratio_16",
              "floor_warm_ratio_64", "floor_store_ratio_16", "floor_cpu_s_per_gb_hit",
              "floor_hot_ratio_16", "store_vs_floor_16", "cpu_vs_floor"}
LATENCY_MS = 20.0  # the cold pass's bucket latency: the option reaches the proxy
DATA_PATHS = {"native", "passthrough", "python"}  # what mountd's status may name


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    workdir = str(tmp_path_factory.mktemp("read"))
    return read.run(quick=True, workdir=workdir, latency_ms=LATENCY_MS), workdir


def _bytes_under(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(directory)
               for n in ns)


@pytest.mark.timeout(300)  # the quick run (about 100 s on 2 busy cores)
def test_summary_has_every_key_and_each_is_positive(quick_report):
    summary = quick_report[0]["summary"]
    expected = (SUMMARY_KEYS | (RCLONE_KEYS if rclone_available() else set())
                | (FLOOR_KEYS if os.path.exists(floor.EXAMPLE) else set()))
    assert set(summary) == expected
    # the hot pass may send mountd no request at all: pages kept, no OPEN
    positive = set(summary) - {"fuse_requests_per_file", "data_path"}
    assert all(isinstance(summary[k], (int, float)) and summary[k] > 0 for k in positive), \
        summary
    assert summary["fuse_requests_per_file"] >= 0


def test_the_data_path_is_mountds_own_when_none_is_chosen(quick_report):
    report = quick_report[0]
    assert report["data_path_option"] is None
    assert report["warm"]["data_path"] == report["summary"]["data_path"]
    assert report["summary"]["data_path"] in DATA_PATHS


def test_every_warm_pass_read_the_whole_tree(quick_report):
    report, workdir = quick_report
    total = _bytes_under(os.path.join(workdir, "src"))
    assert report["dataset"] == {"items": read.QUICK_ITEMS, "bytes": total}
    warm = report["warm"]
    passes = ([warm["ssd"][n] for n in read.SSD_THREADS]
              + [warm["store"][n] for n in read.STORE_THREADS]
              + [warm["hot"][n] for n in read.HOT_THREADS])
    for p in passes:
        assert p["files"] == read.QUICK_ITEMS
        assert p["direct_bytes"] == p["mount_bytes"] == total
        for side in ("direct", "mount"):
            assert 0 < p[f"{side}_p50_ms"] <= p[f"{side}_p99_ms"], p
        # the ratio comes from the unrounded times: within the rounding of the two
        assert p["p99_ratio"] == pytest.approx(p["mount_p99_ms"] / p["direct_p99_ms"],
                                               rel=0.01, abs=0.002)
    assert report["summary"]["warm_p99_ratio_16"] == warm["ssd"][16]["p99_ratio"]


def test_the_floor_read_the_same_bytes_in_every_pass(quick_report):
    report, workdir = quick_report
    if "skipped" in report["floor"]:
        pytest.skip(report["floor"]["skipped"])
    total = _bytes_under(os.path.join(workdir, "src"))
    fl = report["floor"]
    for p in [*fl["ssd"].values(), *fl["store"].values(), *fl["hot"].values()]:
        assert p["files"] == read.QUICK_ITEMS
        assert p["direct_bytes"] == p["mount_bytes"] == total
    summary = report["summary"]
    assert summary["store_vs_floor_16"] == pytest.approx(
        summary["store_ratio_16"] / summary["floor_store_ratio_16"], rel=0.01)
    # its mounts are gone, and its copy of the tree
    assert not os.path.exists(os.path.join(workdir, "floor-src"))
    assert not [n for n in os.listdir(workdir) if n.startswith("floor-")]


def test_the_cold_pass_read_the_subset_through_the_slow_bucket(quick_report):
    report, workdir = quick_report
    cold = report["cold"]
    total = _bytes_under(os.path.join(workdir, "cold-src"))
    assert cold["items"] == read.COLD_QUICK and cold["latency_ms"] == LATENCY_MS
    assert cold["direct_bytes"] == cold["mount_bytes"] == total
    assert cold["bucket_fetch_causes"]["exact"]["fetches"] == read.COLD_QUICK
    # 16 threads, each response at least LATENCY_MS late
    assert cold["direct_s"] >= read.COLD_QUICK / 16 * LATENCY_MS / 1000


def test_small_tree_holds_4_kb_files_read_whole(quick_report):
    report, workdir = quick_report
    small = report["small"]
    total = _bytes_under(os.path.join(workdir, "small-src"))
    assert small["dataset"] == {"items": read.SMALL_QUICK, "bytes": total}
    assert 3_600 <= total / read.SMALL_QUICK <= 4_400
    ssd = small["ssd"][read.SMALL_THREADS]
    assert ssd["files"] == read.SMALL_QUICK
    assert ssd["direct_bytes"] == ssd["mount_bytes"] == total
    assert ssd["mount_files_s"] > 0 and ssd["direct_files_s"] > 0


@pytest.mark.skipif(not rclone_available(), reason="rclone is not installed")
def test_rclone_read_the_same_bytes_as_the_local_files(quick_report):
    report, workdir = quick_report
    rclone = report["rclone"]
    # the subset uploaded for rclone, as copied from the source tree
    subset = _bytes_under(os.path.join(workdir, "rclone-src"))
    assert rclone["items"] == read.RCLONE_QUICK
    for n in read.RCLONE_THREADS:
        assert rclone[n]["files"] == read.RCLONE_QUICK
        assert rclone[n]["direct_bytes"] == rclone[n]["mount_bytes"] == subset


def test_without_rclone_its_keys_are_left_out_with_a_note(quick_report, monkeypatch,
                                                          tmp_path):
    monkeypatch.setattr(read, "rclone_available", lambda: False)
    # nothing is uploaded or mounted: the host is never asked
    skipped = read._rclone("http://127.0.0.1:9", str(tmp_path), ["a.JPEG"], str(tmp_path))
    assert skipped == {"skipped": read.RCLONE_MISSING}
    assert os.listdir(tmp_path) == []
    summary = read.summary({**quick_report[0], "rclone": skipped, "floor": {"skipped": ""}})
    assert set(summary) == SUMMARY_KEYS


def test_without_libfuses_example_the_floor_is_left_out_with_a_note(quick_report,
                                                                    monkeypatch, tmp_path):
    monkeypatch.setattr(floor, "EXAMPLE", str(tmp_path / "passthrough_ll.c"))
    # nothing is copied, built or mounted
    skipped = read._floor(str(tmp_path), ["a.JPEG"], str(tmp_path))
    assert skipped == {"skipped": floor.MISSING}
    assert os.listdir(tmp_path) == []
    summary = read.summary({**quick_report[0], "floor": skipped})
    assert not [k for k in summary if "floor" in k]


def test_nothing_stays_mounted(quick_report):
    _, workdir = quick_report
    assert not any(is_mounted(os.path.join(workdir, d)) for d in os.listdir(workdir))


def _mountd_argv(tmp_path, data_path: str | None) -> list[str]:
    """The command line of a mountd started as the benchmark starts one (not run)."""
    return MountdProcess(str(tmp_path / "mnt"), str(tmp_path / "cache"), "1G",
                         str(tmp_path / "log"), read.mountd_args(data_path)).argv()


def test_the_chosen_data_path_reaches_mountds_command_line(tmp_path):
    for data_path in ("native", "python"):
        argv = _mountd_argv(tmp_path, data_path)
        assert argv[-2:] == ["--data-path", data_path] and argv.count("--data-path") == 1
    assert "--data-path" not in _mountd_argv(tmp_path, None)  # mountd's own default


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quiverfs.cli", "bench", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_data_path_belongs_to_read(tmp_path):
    r = _bench("digest", "--data-path", "native", "--json", str(tmp_path / "o"))
    assert_error(r, ExitCode.USAGE, "--data-path", "read")
    assert os.listdir(tmp_path) == []


def test_an_unknown_data_path_is_refused(tmp_path):
    r = _bench("read", "--data-path", "rust", "--json", str(tmp_path / "o"))
    assert r.returncode == ExitCode.USAGE and "invalid choice: 'rust'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []
