"""``quiver bench substitution`` keeps working: a tiny run end to end, real mounts; and
its checks of a view's reads and its statistics, on made-up inputs."""
from __future__ import annotations

import hashlib
import os

import pytest

from coordinator.allocation import HEADROOM
from quiverfs import digest as digest_format
from quiverfs.bench import floor
from quiverfs.bench.bucket_dataset import Dataset
from quiverfs.bench.emulator import emulator_available
from quiverfs.bench.substitution import SIZES, check_served, paired_gap, run
from quiverfs.chunk_plan import CACHE_CHUNKS

SUMMARY_KEYS = {
    "hit_ratio_sub", "hit_ratio_lru", "hit_ratio_view", "bucket_bytes_ratio_sub",
    "bucket_bytes_ratio_lru", "bucket_bytes_ratio_view", "items_per_s_sub", "items_per_s_lru",
    "items_per_s_view", "exactly_once", "exactly_once_view", "order_spearman_sub",
    "order_spearman_global", "label_hist_dev_sub", "label_hist_dev_global", "accuracy_global",
    "accuracy_sub", "accuracy_view", "accuracy_global_std", "accuracy_sub_std",
    "accuracy_view_std", "accuracy_gap", "accuracy_gap_ci95", "accuracy_gap_view",
    "accuracy_gap_view_ci95", "max_resident_chunks", "sub_vs_exact_cached",
    "view_vs_exact_cached", "view_vs_floor_cached"}


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
@pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed")
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tiny_run_reports_the_summary_and_every_item_exactly_once(tmp_path):
    report = run(quick=True, workdir=str(tmp_path), size="tiny")
    summary = report["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert summary["exactly_once"] is True
    assert summary["exactly_once_view"] is True
    tiny = SIZES["tiny"]
    (first_fraction, first_jobs), *_ = tiny.configs
    assert {(c["mode"], c["cache_fraction"], c["jobs"]) for c in report["configs"]} == {
        (mode, fraction, jobs) for mode in ("sub", "lru") for fraction, jobs in tiny.configs
    } | {("view", first_fraction, first_jobs)}
    for config in report["configs"]:
        assert len(config["epochs"]) == tiny.epochs
        assert all(e["items"] == config["jobs"] * tiny.items for e in config["epochs"])
    for key in ("hit_ratio_sub", "hit_ratio_lru", "hit_ratio_view"):
        assert 0 <= summary[key] <= 1, key
    # the cycle ran deeper than double buffering, with chunks of mountd's default size
    # (an eighth of the cache), as many as the budget less its headroom holds
    assert 3 <= summary["max_resident_chunks"] <= int(CACHE_CHUNKS * (1 - HEADROOM))
    for mode in ("global", "sub", "view"):
        assert 0 <= summary[f"accuracy_{mode}"] <= 100
        assert summary[f"accuracy_{mode}_std"] is None  # one seed: no spread
    assert summary["accuracy_gap_ci95"] is None and summary["accuracy_gap_view_ci95"] is None
    cached = report["cached"]  # the whole dataset cached: the sampler was handed segments
    assert summary["sub_vs_exact_cached"] > 0
    assert summary["view_vs_exact_cached"] > 0
    if os.path.exists(floor.EXAMPLE):  # make installs libfuse3-dev: the floor is measured
        assert summary["view_vs_floor_cached"] > 0 and cached["floor_view"]["items_per_s"] > 0
    assert cached["runs"]["sub"]["cache_mode"] == "full"
    assert cached["runs"]["sub"]["counters"]["segments"] >= 1
    for config in report["configs"]:  # lru jobs read exactly: their misses are exact
        fetched = {c for c, n in config["bucket_fetch_causes"].items() if n["fetches"]}
        if config["mode"] == "lru":
            assert fetched == {"exact"}
        else:
            assert fetched
    view = next(c for c in report["configs"] if c["mode"] == "view")
    assert view["served_check"]["reads"] == tiny.epochs * first_jobs * tiny.items
    for epoch in view["epochs"]:  # mountd counted one open per read
        assert epoch["job_opens"] == [tiny.items] * first_jobs
    assert all(run["opens"] > 0 for run in report["accuracy"]["runs"]["view"])
    assert not any(os.path.ismount(os.path.join(tmp_path, d)) for d in os.listdir(tmp_path))


def _dataset(paths: list[str]) -> Dataset:
    items = [digest_format.NewItem(p, hashlib.sha256(p.encode()).digest(), len(p))
             for p in paths]
    return Dataset.from_digest(digest_format.encode("d", "file:///d", items))


def _read(path: str, intact: bool = True) -> list:
    return [hashlib.sha256(path.encode()).hexdigest(), path, intact]


PATHS = ["a/1.jpg", "a/2.jpg", "b/3.jpg", "b/4.jpg"]


def test_served_in_place_of_a_path_of_the_same_label_is_exactly_once():
    asked = [[["a/1.jpg", "b/3.jpg", "a/2.jpg", "b/4.jpg"]]]
    served = [[[_read("a/2.jpg"), _read("b/4.jpg"), _read("a/1.jpg"), _read("b/3.jpg")]]]
    check = check_served(asked, served, _dataset(PATHS))
    assert check["exactly_once"] is True
    assert check["reads"] == 4 and check["job_epochs"] == 1


@pytest.mark.parametrize("reads, problem", [
    ([_read("b/3.jpg"), _read("a/2.jpg"), _read("a/1.jpg"), _read("b/4.jpg")], "other_label"),
    ([_read("a/2.jpg"), _read("b/4.jpg"), _read("a/2.jpg"), _read("b/3.jpg")],
     "job_epochs_not_every_item_once"),
    ([_read("a/1.jpg", intact=False), _read("b/3.jpg"), _read("a/2.jpg"), _read("b/4.jpg")],
     "bytes_not_sha256"),
    ([[_read("a/2.jpg")[0], "a/1.jpg", True], _read("b/3.jpg"), _read("a/2.jpg"),
      _read("b/4.jpg")], "wrong_sha256"),
])
def test_a_wrong_serving_is_not_exactly_once(reads, problem):
    asked = [[["a/1.jpg", "b/3.jpg", "a/2.jpg", "b/4.jpg"]]]
    check = check_served(asked, [[reads]], _dataset(PATHS))
    assert check["exactly_once"] is False
    assert check[problem] >= 1


def test_paired_gap_has_a_student_t_interval():
    gap = paired_gap([90.0, 92.0, 94.0], [89.0, 90.0, 91.0])  # gaps 1, 2, 3
    assert gap["per_seed"] == [1.0, 2.0, 3.0]
    assert gap["mean"] == pytest.approx(2.0) and gap["std"] == pytest.approx(1.0)
    half = 4.303 / 3 ** 0.5  # t(0.975, 2 df) * std / sqrt(n)
    assert gap["ci95"] == pytest.approx([2.0 - half, 2.0 + half])


def test_paired_gap_of_one_seed_has_no_interval():
    gap = paired_gap([90.0], [88.0])
    assert gap["mean"] == pytest.approx(2.0)
    assert gap["std"] is None and gap["ci95"] is None


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
def test_the_view_floor_serves_a_files_size_and_bytes_as_they_are_at_each_open(tmp_path):
    """The view's floor is passthrough_ll serving files as a view's are served, with no
    attribute timeout in its replies: a file that changes behind it is seen changed at
    the next open, its size and its bytes (a view file's are the served item's)."""
    if not os.path.exists(floor.EXAMPLE):
        pytest.skip(floor.MISSING)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jpg").write_bytes(b"x" * 10)
    binary = floor.build(str(tmp_path), view=True)
    patched = (tmp_path / "passthrough_ll_view.c").read_text(encoding="utf-8")
    assert all(new in patched and old not in patched for old, new, _ in floor.VIEW_PATCH)
    with floor.mounted(binary, str(src), str(tmp_path), floor.VIEW_OPTIONS) as (root, _):
        path = os.path.join(root, "a.jpg")
        for size, byte in ((10, b"x"), (20, b"y"), (5, b"z")):
            (src / "a.jpg").write_bytes(byte * size)  # behind the server's back
            with open(path, "rb") as f:
                assert (os.fstat(f.fileno()).st_size, f.read()) == (size, byte * size)


def test_a_view_floor_patch_that_does_not_apply_is_refused(tmp_path, monkeypatch):
    example = tmp_path / "passthrough_ll.c"
    example.write_text("int main(void) { return 0; }\n", encoding="utf-8")
    monkeypatch.setattr(floor, "EXAMPLE", str(example))
    if floor.build(str(tmp_path)) is None:
        pytest.skip("no gcc or pkg-config")
    with pytest.raises(RuntimeError, match="the view floor's patch does not apply"):
        floor.build(str(tmp_path), view=True)
