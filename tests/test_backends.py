"""Both storage backends against real data: local files and the GCS emulator."""
from __future__ import annotations

import concurrent.futures
import io
import os
import random
import socket
from collections.abc import Callable, Iterator

import pytest
import requests

from quiverfs.backends import Backend, StorageOptions, open_backend
from quiverfs.backends.gcs import GCSBackend
from quiverfs.bench.emulator import Emulator
from quiverfs.errors import ExitCode, QuietError

BIG = 3 * (1 << 20) + 12345  # spans several 1 MiB read blocks


def write_files(root: str, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        path = os.path.join(root, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


@pytest.fixture
def files() -> dict[str, bytes]:
    rng = random.Random(7)
    return {
        "big.bin": rng.randbytes(BIG),
        "cat/one.jpg": rng.randbytes(1000),
        "cat/deep/two.txt": b"hello, quiver\n",
        "dog/empty": b"",
    }


def open_tree(request: pytest.FixtureRequest, kind: str, root: str) -> Backend:
    """A backend of ``kind`` holding the files under ``root`` (gs: in a fresh bucket)."""
    if kind == "file":
        return open_backend(root)
    uri = request.getfixturevalue("upload")(root, "some/prefix")
    host = request.getfixturevalue("gcs_emulator").host
    return open_backend(uri, StorageOptions(emulator_host=host))


@pytest.fixture(params=["file", "gs"])
def backend(request: pytest.FixtureRequest, tmp_path,
            files: dict[str, bytes]) -> Iterator[Backend]:
    """A backend of each kind holding ``files``."""
    write_files(str(tmp_path), files)
    b = open_tree(request, request.param, str(tmp_path))
    try:
        yield b
    finally:
        b.close()


def test_read_whole_objects(backend: Backend, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        assert backend.read(key) == data, key


@pytest.mark.parametrize("offset,length", [(0, 1), (1, 10), (BIG - 7, 7), ((1 << 20) - 3, 6),
                                           (12345, 2 * (1 << 20))])
def test_read_range(backend: Backend, files: dict[str, bytes], offset: int, length: int) -> None:
    assert backend.read("big.bin", offset, length) == files["big.bin"][offset:offset + length]


def test_read_from_offset_to_end(backend: Backend, files: dict[str, bytes]) -> None:
    assert backend.read("big.bin", BIG - 100) == files["big.bin"][-100:]


def test_read_zero_length(backend: Backend) -> None:
    assert backend.read("big.bin", 5, 0) == b""


def test_range_past_the_end_is_cut_at_the_end(backend: Backend,
                                              files: dict[str, bytes]) -> None:
    assert backend.read("cat/one.jpg", 990, 100) == files["cat/one.jpg"][990:]


def test_stream_into(backend: Backend, files: dict[str, bytes]) -> None:
    sink = io.BytesIO()
    assert backend.stream_into("big.bin", sink) == BIG
    assert sink.getvalue() == files["big.bin"]


def test_list_finds_every_object_with_its_size(backend: Backend,
                                               files: dict[str, bytes]) -> None:
    assert sorted((o.key, o.size) for o in backend.list()) == sorted(
        (k, len(v)) for k, v in files.items())


def test_stat(backend: Backend, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        info = backend.stat(key)
        assert (info.key, info.size) == (key, len(data))


@pytest.mark.parametrize("op", ["read", "stat", "stream_into"])
def test_missing_object_is_not_found(backend: Backend, op: str) -> None:
    args = {"read": (), "stat": (), "stream_into": (io.BytesIO(),)}[op]
    with pytest.raises(QuietError) as err:
        getattr(backend, op)("cat/missing.jpg", *args)
    assert err.value.exitcode == ExitCode.NOT_FOUND
    assert "missing.jpg" in err.value.message


@pytest.mark.parametrize("key", ["..", "../etc/passwd", "cat/../../x", "/etc/passwd", "",
                                 "cat//one.jpg", "./big.bin"])
def test_invalid_keys_are_refused(backend: Backend, key: str) -> None:
    for op in (backend.read, backend.stat):
        with pytest.raises(ValueError, match="invalid object key"):
            op(key)


def test_object_uri(backend: Backend) -> None:
    assert backend.object_uri("cat/one.jpg") == backend.uri + "/cat/one.jpg"


def test_missing_local_directory(tmp_path) -> None:
    with pytest.raises(QuietError) as err:
        list(open_backend(str(tmp_path / "nope")).list())
    assert err.value.exitcode == ExitCode.NOT_FOUND


def test_local_file_as_root_is_bad_input(tmp_path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(QuietError) as err:
        list(open_backend(f"file://{tmp_path}/f").list())
    assert err.value.exitcode == ExitCode.BAD_INPUT


def test_unsupported_uri_scheme() -> None:
    with pytest.raises(QuietError) as err:
        open_backend("s3://bucket/x")
    assert err.value.exitcode == ExitCode.USAGE


def gcs(emulator: Emulator, uri: str, **kw) -> GCSBackend:
    return GCSBackend(uri, StorageOptions(emulator_host=emulator.host), **kw)


@pytest.mark.parametrize("op", ["list", "read", "stat"])
def test_missing_bucket_is_not_found(gcs_emulator: Emulator, op: str) -> None:
    b = gcs(gcs_emulator, "gs://no-such-bucket-q/prefix")
    call: Callable[[], object] = {"list": lambda: list(b.list()),
                                  "read": lambda: b.read("x.jpg"),
                                  "stat": lambda: b.stat("x.jpg")}[op]
    with pytest.raises(QuietError) as err:
        call()
    assert err.value.exitcode == ExitCode.NOT_FOUND
    assert "bucket gs://no-such-bucket-q does not exist" in err.value.message


def test_empty_prefix_lists_nothing(gcs_emulator: Emulator, gcs_bucket: str) -> None:
    assert list(gcs(gcs_emulator, f"gs://{gcs_bucket}/nothing-here").list()) == []


def test_bucket_root_without_prefix(gcs_emulator: Emulator, upload, tmp_path,
                                    files: dict[str, bytes]) -> None:
    write_files(str(tmp_path), files)
    uri = upload(str(tmp_path), "")
    b = gcs(gcs_emulator, uri)
    assert b.read("cat/deep/two.txt") == files["cat/deep/two.txt"]
    assert {o.key for o in b.list()} == set(files)


def test_gs_uri_without_bucket() -> None:
    with pytest.raises(QuietError) as err:
        GCSBackend("gs://")
    assert err.value.exitcode == ExitCode.USAGE


def test_bad_credentials_are_a_permission_error() -> None:
    b = GCSBackend("gs://bucket/x", StorageOptions(credentials_info={"type": "service_account"}))
    with pytest.raises(QuietError) as err:
        b.read("a")
    assert err.value.exitcode == ExitCode.PERMISSION


def test_unreachable_storage_fails_after_retries() -> None:
    with socket.socket() as s:  # a port that refuses connections
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = GCSBackend("gs://bucket/x", StorageOptions(emulator_host=f"http://127.0.0.1:{port}"),
                   retry_deadline=1.0)
    with pytest.raises(QuietError) as err:
        b.read("a")
    assert err.value.exitcode == ExitCode.BACKEND
    assert "after retries" in err.value.message


def test_requests_read_the_environment_once_per_client(gcs_emulator: Emulator, upload,
                                                      tmp_path, files: dict[str, bytes],
                                                      monkeypatch) -> None:
    write_files(str(tmp_path), files)
    b = gcs(gcs_emulator, upload(str(tmp_path), "env"))
    looked_up: list[str] = []
    lookup = requests.utils.get_environ_proxies

    def counted(url: str, no_proxy: str | None = None) -> dict[str, str]:
        looked_up.append(url)
        return lookup(url, no_proxy)

    monkeypatch.setattr(requests.utils, "get_environ_proxies", counted)
    monkeypatch.setattr(requests.sessions, "get_environ_proxies", counted)
    try:
        for key, data in files.items():
            assert b.read(key) == data
            assert b.read(key) == data
    finally:
        b.close()
    assert looked_up == [gcs_emulator.host]  # when the client was made, not per request


def test_a_proxy_in_the_environment_is_used(gcs_emulator: Emulator, gcs_bucket: str,
                                            monkeypatch) -> None:
    with socket.socket() as s:  # a proxy port that refuses connections
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{port}")
    b = GCSBackend(f"gs://{gcs_bucket}/x", StorageOptions(emulator_host=gcs_emulator.host),
                   retry_deadline=1.0)
    with pytest.raises(QuietError) as err:
        b.read("a")
    assert err.value.exitcode == ExitCode.BACKEND  # the emulator alone would say not found


@pytest.mark.parametrize("kind", ["file", "gs"])
def test_many_small_reads_concurrently(request: pytest.FixtureRequest, tmp_path,
                                       kind: str) -> None:
    rng = random.Random(3)
    small = {f"c{i % 10}/{i:04d}.bin": rng.randbytes(rng.randrange(1, 4000)) for i in range(120)}
    write_files(str(tmp_path), small)
    b = open_tree(request, kind, str(tmp_path))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            whole = dict(zip(small, pool.map(b.read, small)))
            heads = dict(zip(small, pool.map(lambda k: b.read(k, 0, 16), small)))
    finally:
        b.close()
    assert whole == small
    assert heads == {k: v[:16] for k, v in small.items()}
