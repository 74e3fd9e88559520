"""Shared fixtures: the GCS emulator, dataset trees, uploads, and running ``quiver``."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator

import pytest

from quiverfs.bench.data import Tree, write_digits_tree, write_synthetic_tree
from quiverfs.bench.emulator import Emulator, emulator_available, running_emulator, upload_tree
from quiverfs.bench.etcd_process import Etcd, etcd_available

SYNTHETIC_ITEMS = 40
SYNTHETIC_CLASSES = 10
CLI_TIMEOUT = 120  # seconds; a hung command fails its test instead of the whole run


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[Emulator]:
    """An in-memory GCS emulator for the whole session, with STORAGE_EMULATOR_HOST set."""
    if not emulator_available():
        pytest.skip("gcp-storage-emulator is not installed (pip install gcp-storage-emulator)")
    with running_emulator() as emulator, pytest.MonkeyPatch.context() as mp:
        mp.setenv("STORAGE_EMULATOR_HOST", emulator.host)
        yield emulator
    if emulator.process.returncode is None:
        pytest.fail("the GCS emulator process was not reaped")


@pytest.fixture
def gcs_bucket(gcs_emulator: Emulator) -> str:
    """A fresh, empty bucket in the emulator (its name)."""
    name = f"quiver-test-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(name)
    return name


@pytest.fixture
def upload(gcs_emulator: Emulator, gcs_bucket: str) -> Callable[[str, str], str]:
    """``upload(local_dir, prefix)`` copies a tree into ``gcs_bucket``; returns its gs:// URI."""
    def do_upload(local_dir: str, prefix: str = "data") -> str:
        upload_tree(gcs_emulator.host, gcs_bucket, prefix, local_dir)
        return f"gs://{gcs_bucket}/{prefix}" if prefix else f"gs://{gcs_bucket}"

    return do_upload


@pytest.fixture(scope="session")
def digits_tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    """scikit-learn's digits as an ImageFolder tree of 1797 PNGs (read-only by convention)."""
    return write_digits_tree(str(tmp_path_factory.mktemp("digits")))


@pytest.fixture(scope="session")
def synthetic_tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    """40 JPEGs of 20-300 KB in 10 classes (read-only by convention)."""
    return write_synthetic_tree(str(tmp_path_factory.mktemp("synthetic")), SYNTHETIC_ITEMS,
                                SYNTHETIC_CLASSES, seed=1)


@pytest.fixture
def etcd(tmp_path) -> Iterator[Etcd]:
    """A one-member etcd on loopback ports, its data under ``tmp_path``."""
    if not etcd_available():
        pytest.skip("etcd is not installed (make apt: etcd-server, etcd-client)")
    e = Etcd(str(tmp_path))
    e.start()
    yield e
    e.stop()


@pytest.fixture
def shared_workdir() -> Iterator[str]:
    """A directory other uids can traverse (pytest's tmp_path is root-only)."""
    d = tempfile.mkdtemp(prefix="quiver-iso-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def quiver() -> Callable[..., subprocess.CompletedProcess]:
    """``quiver(*args)`` runs the real CLI in a subprocess and returns its result (text)."""
    def run(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, sys.executable, "-m", "quiverfs.cli", *args],
                              capture_output=True, text=True, timeout=CLI_TIMEOUT,
                              stdin=subprocess.DEVNULL)

    return run
