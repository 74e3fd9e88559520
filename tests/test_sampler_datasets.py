"""``QuiverBatchSampler`` for any file dataset: DatasetFolder of any extension, a list of
paths (``paths=`` and ``JOB/paths``), files the digest lacks, and hostile path lists."""
from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch
import torchvision

from mountd.fs.job_files import MAX_PATHS_BYTES, MAX_PATHS_BYTES_PER_USER
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import (call_as, make_digest, mount, mountd_factory,  # noqa: F401
                                  run_as)

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

CLASSES = 3
PER_CLASS = 12
BATCH = 5
OTHER_UID = 54321  # a uid that is not root, for the per-uid bound


class Source:
    """The dataset written to disk: ``train/cK/NNN.{npy,bin}`` plus files DatasetFolder
    passes over (a README in each class, ``train/notes.bin`` outside any class)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.arrays: dict[str, np.ndarray] = {}  # relative to train/ -> array
        self.blobs: dict[str, bytes] = {}  # relative to train/ -> bytes
        rng = np.random.default_rng(5)
        for c in range(CLASSES):
            d = os.path.join(root, "train", f"c{c}")
            os.makedirs(d)
            for k in range(PER_CLASS):
                array = rng.standard_normal(8)
                array[0] = len(self.arrays)  # its id
                np.save(os.path.join(d, f"{k:03d}.npy"), array)
                self.arrays[f"c{c}/{k:03d}.npy"] = array
                self._write(f"c{c}/{k:03d}.bin", rng.bytes(int(rng.integers(1, 5000))))
            with open(os.path.join(d, "README.txt"), "w", encoding="utf-8") as f:
                f.write("not a sample\n")
        self._write("notes.bin", rng.bytes(100))
        os.makedirs(os.path.join(root, "other"))
        with open(os.path.join(root, "other", "x.bin"), "wb") as f:
            f.write(b"outside the sampler's root")
        self.by_content = {blob: rel for rel, blob in self.blobs.items()}
        assert len(self.by_content) == len(self.blobs)  # every item tells itself apart

    def _write(self, rel: str, data: bytes) -> None:
        with open(os.path.join(self.root, "train", rel), "wb") as f:
            f.write(data)
        self.blobs[rel] = data

    def class_bins(self) -> list[str]:
        return sorted(p for p in self.blobs if "/" in p)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Source:
    return Source(str(tmp_path_factory.mktemp("mixed")))


@pytest.fixture
def mixed(mountd_factory, source):
    """A mountd with the source mounted as ``mixed``; returns (mountd, ROOT/mixed/train)."""
    m = mountd_factory()
    mount(m, make_digest(source.root, "mixed"), "mixed")
    return m, os.path.join(m.root, "mixed", "train")


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def loader_for(dataset, sampler) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)


def test_dataset_folder_of_npy_files_exactly_once_per_epoch(mixed, source):
    m, root = mixed
    dataset = torchvision.datasets.DatasetFolder(root, loader=np.load, extensions=(".npy",))
    assert len(dataset) == CLASSES * PER_CLASS
    ids = {int(array[0]): rel for rel, array in source.arrays.items()}
    sampler = QuiverBatchSampler(root, BATCH, seed=1, dataset=dataset)
    try:
        assert sampler.config["extensions"] == [".npy"] and sampler.config["paths"] is None
        assert sampler.config["universe"] == CLASSES * PER_CLASS
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen = []
            for arrays, labels in loader_for(dataset, sampler):
                for array, label in zip(arrays.numpy(), labels.tolist()):
                    rel = ids[int(array[0])]
                    assert np.array_equal(array, source.arrays[rel])
                    assert label == dataset.class_to_idx[rel.split("/")[0]]
                    seen.append(rel)
            assert sorted(seen) == sorted(source.arrays)  # each .npy once, nothing else
    finally:
        sampler.close()
    assert m.status()["jobs"] == []


def test_dataset_folder_of_bin_files_exactly_once_per_epoch(mixed, source):
    m, root = mixed
    dataset = torchvision.datasets.DatasetFolder(root, loader=read_bytes,
                                                 extensions=(".bin",))
    sampler = QuiverBatchSampler(root, BATCH, seed=2, dataset=dataset)
    try:
        # notes.bin is in no class directory: neither DatasetFolder nor mountd takes it
        assert sampler.config["extensions"] == [".bin"]
        assert sampler.config["universe"] == len(source.class_bins()) == CLASSES * PER_CLASS
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen = []
            batches = 0
            for blobs, _ in loader_for(dataset, sampler):
                assert all(blob in source.by_content for blob in blobs)  # bytes as written
                seen += [source.by_content[blob] for blob in blobs]
                batches += 1
            assert batches == len(sampler)
            assert sorted(seen) == source.class_bins()
    finally:
        sampler.close()


class ListedFiles(torch.utils.data.Dataset):
    """A map-style dataset of any files: index i is (its relative path, its bytes)."""

    def __init__(self, root: str, rel_paths: list[str]) -> None:
        self.root = root
        self.rel_paths = rel_paths
        self.files = [os.path.join(root, p) for p in rel_paths]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[str, bytes]:
        return self.rel_paths[i], read_bytes(self.files[i])


def subset(source: Source) -> list[str]:
    """Every third class .bin, a file outside any class and a .npy: no extension rule."""
    return [*source.class_bins()[::3], "notes.bin", "c1/004.npy"]


def test_paths_argument_gets_exactly_the_listed_items(mixed, source):
    m, root = mixed
    dataset = ListedFiles(root, subset(source))
    sampler = QuiverBatchSampler(root, BATCH, seed=3, dataset=dataset, paths=dataset.files)
    expected = {rel: source.blobs.get(rel) for rel in dataset.rel_paths}
    expected["c1/004.npy"] = read_bytes(os.path.join(source.root, "train", "c1/004.npy"))
    try:
        assert sampler.config["paths"] == sampler.config["universe"] == len(dataset) == 14
        assert sampler.config["extensions"] == []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen = []
            for rels, blobs in loader_for(dataset, sampler):
                for rel, blob in zip(rels, blobs):
                    assert blob == expected[rel]
                    seen.append(rel)
            assert sorted(seen) == sorted(dataset.rel_paths)
    finally:
        sampler.close()
    assert m.status()["jobs"] == []


def test_files_not_in_the_digest_are_a_clear_error(mixed, source):
    m, root = mixed
    listed = [*subset(source), "c0/missing-1.bin", "c2/missing-2.bin"]
    with pytest.raises(ValueError) as info:
        QuiverBatchSampler(root, BATCH, dataset=ListedFiles(root, listed), paths=listed)
    message = str(info.value)
    assert message.startswith("quiver: 2 of the 16 paths in JOB/paths are not files of the "
                              "mounted digest under mixed/train (such as 'c0/missing-1.bin')")
    assert "quiver digest create" in message
    assert m.status()["jobs"] == []


def test_a_dataset_that_lists_other_files_than_its_extensions_is_caught(mixed):
    m, root = mixed
    dataset = torchvision.datasets.DatasetFolder(root, loader=np.load, extensions=(".npy",))
    dataset.samples = dataset.samples[:-1]  # its rule no longer says which files it has
    with pytest.raises(ValueError, match="mountd sees 36 files ending in .npy under .*, "
                                         "the dataset lists 35: .* pass paths="):
        QuiverBatchSampler(root, BATCH, dataset=dataset)
    sampler = QuiverBatchSampler(root, BATCH, dataset=dataset,
                                 paths=[p for p, _ in dataset.samples])
    try:
        assert sampler.config["universe"] == 35
    finally:
        sampler.close()


# -- the JOB/paths protocol, written by hand ----------------------------------------------
def new_job(m, name: str = "raw") -> str:
    job = os.path.join(m.root, ".quiver", "jobs", name)
    os.mkdir(job)
    return job


def write_to(path: str, data: bytes, offset: int | None = None) -> int | None:
    """Write ``data`` (at ``offset``) in one call; the errno it met, or None."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if offset is None:
            os.write(fd, data)
        else:
            os.pwrite(fd, data, offset)
    except OSError as exc:
        return exc.errno
    finally:
        os.close(fd)
    return None


def configure(job: str, count: int, **extra: object) -> int | None:
    config = {"dataset": "mixed", "prefix": "train", "batch_size": 4, "paths": count, **extra}
    return write_to(os.path.join(job, "config"), json.dumps(config).encode())


def job_error(job: str) -> str:
    with open(os.path.join(job, "error"), encoding="utf-8") as f:
        return f.read()


def serves_a_listed_job(job: str) -> None:
    """mountd still takes a good list on this job, and reads its batches."""
    assert write_to(os.path.join(job, "paths"), b"c0/000.bin\nnotes.bin\n") is None
    assert configure(job, 2) is None
    with open(os.path.join(job, "config"), encoding="utf-8") as f:
        assert json.load(f)["universe"] == 2
    with open(os.path.join(job, "e0-b0"), "rb") as f:
        assert sorted(json.load(f)["paths"]) == ["c0/000.bin", "notes.bin"]


@pytest.mark.parametrize("listed, count, extra, message", [
    (b"c0/\xff\xfe.bin\n", 1, {}, "JOB/paths is not UTF-8 (line 1, byte 3)"),
    (b"c0/000.bin\n../other/x.bin\n", 2, {},
     "JOB/paths line 2: '../other/x.bin' has an empty, '.' or '..' component"),
    (b"/c0/000.bin\n", 1, {}, "JOB/paths line 1: '/c0/000.bin' is absolute"),
    (b"c0/000.bin\nc0\n", 2, {}, "1 of the 2 paths in JOB/paths are not files"),
    (b"c0/000.bin\nc0/000.bin\n", 2, {}, "JOB/paths lists 'c0/000.bin' more than once"),
    (b"c0/000.bin\n", 2, {}, "JOB/paths holds 1 paths, the config says 2"),
    (b"c0/000.bin\n", 0, {}, "paths (the number of paths written to JOB/paths) must be"),
    (b"c0/000.bin\n", 1, {"extensions": [".bin"]}, "names 'extensions' and 'paths'"),
])
def test_bad_path_lists_are_refused_and_mountd_serves_on(mixed, listed, count, extra,
                                                         message):
    m, _ = mixed
    job = new_job(m)
    assert write_to(os.path.join(job, "paths"), listed) is None
    assert configure(job, count, **extra) == errno.EINVAL
    assert message in job_error(job)
    serves_a_listed_job(job)


def test_a_hole_in_the_list_is_a_bad_path(mixed):
    m, _ = mixed
    job = new_job(m)
    assert write_to(os.path.join(job, "paths"), b"c0/000.bin\n", offset=100) is None
    assert configure(job, 1) == errno.EINVAL
    assert "JOB/paths line 1:" in job_error(job) and "holds a NUL byte" in job_error(job)


def test_a_list_too_big_for_a_job_is_refused_until_reopened(mixed):
    m, _ = mixed
    job = new_job(m)
    paths = os.path.join(job, "paths")
    assert write_to(paths, b"x", offset=MAX_PATHS_BYTES) == errno.EINVAL
    error = job_error(job)
    assert f"JOB/paths holds at most {MAX_PATHS_BYTES} bytes" in error
    assert "select the files by extensions" in error
    # the list stays refused: the config that would take it is refused too
    assert configure(job, 1) == errno.EINVAL and job_error(job) == error
    serves_a_listed_job(job)  # opening JOB/paths again starts a new list


def test_a_long_write_split_by_the_kernel_stops_at_the_bound(mixed):
    """A list too long for one job, written as one would: the kernel splits the write into
    many WRITE requests; those past the bound are refused, and nothing past it is kept."""
    m, _ = mixed
    job = new_job(m)
    line = b"c0/000.bin\n"
    data = line * (MAX_PATHS_BYTES // len(line) + 2)
    fd = os.open(os.path.join(job, "paths"), os.O_WRONLY)
    written = 0
    try:
        with pytest.raises(OSError) as info:
            while True:  # a write may be taken in part, up to the bound; the next one fails
                written += os.write(fd, memoryview(data)[written:])
    finally:
        os.close(fd)
    assert info.value.errno == errno.EINVAL
    assert written <= MAX_PATHS_BYTES < len(data)
    assert "JOB/paths holds at most" in job_error(job)
    serves_a_listed_job(job)
    assert m.status()["jobs"][0]["job"] == "raw"


def test_the_list_is_write_only_and_dies_with_its_job(mixed):
    m, _ = mixed
    job = new_job(m)
    paths = os.path.join(job, "paths")
    with pytest.raises(PermissionError):  # mountd keeps no copy to read back
        open(paths, "rb")
    fd = os.open(paths, os.O_WRONLY)
    try:
        os.rmdir(job)
        with pytest.raises(FileNotFoundError):  # nothing would ever free its list
            os.write(fd, b"c0/000.bin\n")
    finally:
        os.close(fd)
    assert m.status()["jobs"] == []


def test_a_uid_cannot_hold_more_than_its_bound_across_jobs(mountd_factory, shared_workdir):
    src = os.path.join(shared_workdir, "src", "c0")  # readable by all: the uid mounts it
    os.makedirs(src)
    with open(os.path.join(src, "a.bin"), "wb") as f:
        f.write(b"the uid's own item")
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"))
    os.chmod(m.cache_dir, 0o755)  # the control socket lives there
    reply = call_as(OTHER_UID, OTHER_UID, m.socket, {
        "op": "mount", "name": "mine", "digest": make_digest(os.path.dirname(src), "mine")})
    assert reply["ok"], reply
    jobs = [os.path.join(m.root, ".quiver", "jobs", f"u{k}") for k in range(3)]
    per_job = MAX_PATHS_BYTES_PER_USER // 2  # two jobs reach the bound, a third passes it
    config = b'{"dataset": "mine", "batch_size": 4, "paths": 1}'

    def fill() -> dict:
        errs = []
        for job in jobs:
            os.mkdir(job)
            errs.append(write_to(os.path.join(job, "paths"), b"x", offset=per_job - 1))
        refused = job_error(jobs[2])
        # a config takes (and frees) the first job's list: the third may write again
        took = write_to(os.path.join(jobs[0], "config"), config)
        again = write_to(os.path.join(jobs[2], "paths"), b"c0/a.bin\n")
        configured = write_to(os.path.join(jobs[2], "config"), config)
        return {"errs": errs, "refused": refused, "took": took, "again": again,
                "configured": configured, "error": job_error(jobs[2])}

    try:
        got = run_as(OTHER_UID, OTHER_UID, fill)
    finally:
        for job in jobs:
            if os.path.isdir(job):
                os.rmdir(job)
    assert got["errs"] == [None, None, errno.EINVAL]
    assert (f"uid {OTHER_UID}'s path lists not yet taken by a config hold "
            f"{MAX_PATHS_BYTES_PER_USER} bytes") in got["refused"]
    assert got["took"] == errno.EINVAL  # its list was a hole, but it was taken
    assert got["again"] is None and got["configured"] is None, got["error"]
    assert m.status()["jobs"] == []
