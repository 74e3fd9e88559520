"""A local GCS emulator (``gcp-storage-emulator``) for tests, demos and benchmarks.

The emulator runs as a subprocess on a free 127.0.0.1 port with in-memory storage;
``running_emulator()`` waits until it answers and always reaps it.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from quiverfs.errors import ExitCode, QuietError

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0  # seconds until a started emulator must answer
POLL_INTERVAL = 0.05  # seconds between readiness probes
STOP_TIMEOUT = 5.0  # seconds to wait after SIGTERM before SIGKILL
START_ATTEMPTS = 3  # a free port can be taken between choosing and binding it


# The emulator rewrites all its metadata as indented JSON after every change, so each
# upload costs time in proportion to the objects already stored, and uploading a
# dataset takes time quadratic in its items. In memory that copy is never read back
# (only at start), so skip it.
_LAUNCHER = """
import sys
from gcp_storage_emulator import __main__ as cli, storage
storage.Storage._write_config_to_file = lambda self: None
{concurrent}cli.main(sys.argv[1:])
"""
# The emulator serves one request at a time (http.server.HTTPServer, with a listen
# backlog of 5) and closes the connection after each (HTTP/1.0), where a bucket serves
# many at once over kept-alive connections. Past the backlog the kernel drops a client's
# SYN, and the client tries again after TCP's first retransmission timeout, a second:
# 16 requests in flight (a chunk load) stalled the bucket for a second at a time. Every
# benchmark therefore asks for a bucket as GCS is: a thread per connection and a backlog
# that takes a burst of them; tests keep the emulator as shipped.
# (Without TCP_NODELAY, kept-alive responses would wait out the client's delayed ACK.)
_CONCURRENT = """
from http import server
import gcp_storage_emulator.server as emulator_server
class ThreadingServer(server.ThreadingHTTPServer):
    request_queue_size = 256
emulator_server.server.HTTPServer = ThreadingServer
emulator_server.RequestHandler.protocol_version = "HTTP/1.1"
emulator_server.RequestHandler.disable_nagle_algorithm = True
"""


def emulator_available() -> bool:
    """Whether the ``gcp_storage_emulator`` package is importable by this interpreter."""
    return importlib.util.find_spec("gcp_storage_emulator") is not None


def gcs_client(host: str) -> storage.Client:
    """An anonymous google-cloud-storage client talking to the emulator at ``host``."""
    return storage.Client(project="quiver", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": host})


@dataclasses.dataclass
class Emulator:
    """A running emulator: its endpoint (``http://127.0.0.1:PORT``) and process."""

    host: str
    process: subprocess.Popen

    def create_bucket(self, name: str) -> None:
        """Create an empty bucket ``name``."""
        client = gcs_client(self.host)
        try:
            client.create_bucket(name)
        finally:
            client.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(host: str) -> bool:
    try:
        with urllib.request.urlopen(f"{host}/storage/v1/b?project=quiver", timeout=1.0) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _start(log_file: int, concurrent: bool, niceness: int) -> Emulator | None:
    """Start one emulator; None if it died or never answered (e.g. its port was taken)."""
    host = f"http://127.0.0.1:{_free_port()}"
    port = host.rsplit(":", 1)[1]
    launcher = _LAUNCHER.format(concurrent=_CONCURRENT if concurrent else "")
    process = subprocess.Popen(
        ["nice", "-n", str(niceness), sys.executable, "-c", launcher, "start",
         "--host", "127.0.0.1", "--port", port, "--in-memory", "--quiet"],
        stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        if _answers(host):
            log.debug("GCS emulator pid %d answers at %s", process.pid, host)
            return Emulator(host, process)
        time.sleep(POLL_INTERVAL)
    _stop(process)
    return None


@contextlib.contextmanager
def running_emulator(concurrent: bool = False, niceness: int = 0) -> Iterator[Emulator]:
    """Start an in-memory GCS emulator, yield it, and always stop and reap it;
    ``concurrent``: one serving requests in parallel, as a bucket does; ``niceness``:
    its scheduling priority (a bucket elsewhere takes no CPU from this machine)."""
    if not emulator_available():
        raise QuietError("gcp-storage-emulator is not installed: pip install "
                         "gcp-storage-emulator", ExitCode.NOT_FOUND)
    with tempfile.TemporaryFile(prefix="quiver-gcs-emulator-") as log_file:
        for _ in range(START_ATTEMPTS):
            emulator = _start(log_file.fileno(), concurrent, niceness)
            if emulator is not None:
                break
        else:
            log_file.seek(0)
            tail = log_file.read()[-2000:].decode(errors="replace").strip()
            raise QuietError(f"the GCS emulator did not start: {tail or 'no output'}",
                             ExitCode.BACKEND)
        try:
            yield emulator
        finally:
            _stop(emulator.process)


def upload_tree(host: str, bucket: str, prefix: str, local_dir: str, workers: int = 8) -> int:
    """Upload every file under ``local_dir`` to ``gs://bucket/prefix/REL``; return the count.

    Each worker thread has its own client (clients are not shared between threads).
    """
    root = os.path.abspath(local_dir)
    files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
    local = threading.local()
    clients: list[storage.Client] = []
    lock = threading.Lock()

    def upload(path: str) -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = gcs_client(host)
            with lock:
                clients.append(client)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        name = f"{prefix.strip('/')}/{rel}" if prefix.strip("/") else rel
        client.bucket(bucket).blob(name).upload_from_filename(path)

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(upload, files))
    finally:
        for client in clients:
            client.close()
    return len(files)
