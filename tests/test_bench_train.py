"""``quiver bench train`` keeps working: the quick run end to end on the CPU, a real
model trained through a real mount by DataLoader worker processes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from quiverfs.bench.cli import run_one
from quiverfs.bench.train import QUICK
from quiverfs.errors import ExitCode
from tests.test_digest_errors import assert_error

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

SUMMARY_KEYS = {"train_ratio_exact", "train_ratio_sampler", "images_per_s_local",
                "images_per_s_gpu_only", "mountd_cpu_ms_per_image", "fuse_requests_per_image"}
RUNS = ("gpu_only", "local", "exact", "sampler")
MOUNT_RUNS = ("exact", "sampler")


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    workdir = str(tmp_path_factory.mktemp("train"))
    return run_one("train", True, workdir, {"device": "cpu"}), workdir


@pytest.mark.slow
@pytest.mark.timeout(180)  # the module's quick run (under a minute on 2 idle cores)
def test_summary_has_every_key_and_positive_ratios(quick_report):
    report, _ = quick_report
    summary = report["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert all(isinstance(v, (int, float)) and v > 0 for v in summary.values()), summary
    assert report["settings"]["device"] == "cpu"
    assert report["settings"]["model"] == QUICK.model
    runs = report["runs"]
    assert summary["train_ratio_exact"] == round(
        runs["exact"]["images_per_s"] / runs["local"]["images_per_s"], 3)
    assert summary["images_per_s_gpu_only"] == runs["gpu_only"]["images_per_s"]


def test_every_run_trained_on_exactly_the_images_it_reports(quick_report):
    runs = quick_report[0]["runs"]
    assert set(runs) == set(RUNS)
    for name in RUNS:
        run = runs[name]
        assert run["batches"] == QUICK.timed_batches, name
        assert run["images"] == QUICK.timed_batches * QUICK.batch_size, name
        assert run["images_read"] == ((QUICK.warmup_batches + QUICK.timed_batches)
                                      * QUICK.batch_size), name
        # both rounded in the report: images/s to 0.1 (0.05 off at most), and seconds to
        # 1 ms, which moves images / seconds by up to rate * 0.0005 / seconds
        rate = run["images"] / run["seconds"]
        assert run["images_per_s"] == pytest.approx(
            rate, abs=0.05 + rate * 0.0005 / run["seconds"] + 1e-9), name
        assert run["loss"] > 0, name
    # the same seed, the same items and the same crops: exact reads through the mount
    # train the model exactly as the local files do
    assert runs["exact"]["loss"] == runs["local"]["loss"]


def test_mount_runs_read_only_the_store_and_count_mountd(quick_report):
    runs = quick_report[0]["runs"]
    for name in MOUNT_RUNS:
        run = runs[name]
        assert run["counters"].get("bucket_fetches", 0) == 0, (name, run["counters"])
        requests = sum(run["fuse_requests"].values())
        assert requests > 0, name
        assert run["fuse_requests_per_image"] == round(requests / run["images_read"], 3)
        assert run["mountd_cpu_s"] > 0, name


def test_nothing_stays_mounted(quick_report):
    _, workdir = quick_report
    with open("/proc/mounts", encoding="utf-8") as f:
        mounts = [line.split()[1] for line in f]
    assert not [m for m in mounts if m.startswith(workdir)], mounts


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quiverfs.cli", "bench", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_an_unknown_model_is_refused_before_any_work(tmp_path):
    r = _bench("train", "--quick", "--model", "no_such_net", "--json", str(tmp_path / "o"),
               "--workdir", str(tmp_path))
    assert_error(r, ExitCode.USAGE, "no_such_net", "resnet50")
    assert os.listdir(tmp_path) == []


def test_model_and_device_belong_to_train(tmp_path):
    r = _bench("read", "--device", "cpu", "--json", str(tmp_path / "o"))
    assert_error(r, ExitCode.USAGE, "--device", "train")
