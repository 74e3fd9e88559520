"""docs/getting-started.md's commands, run as written against the GCS emulator; and
``make demo``'s program, with what it prints."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from quiverfs.bench import compare, demo
from quiverfs.bench.processes import unmount
from quiverfs.errors import ExitCode
from quiverfs.mount_point import is_mounted
from tests.mountd_helpers import tree_hashes

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

DOC = Path(__file__).resolve().parent.parent / "docs" / "getting-started.md"
BIN = os.path.dirname(sys.executable)


def documented_commands() -> list[str]:
    (block,) = re.findall(r"## Your own bucket.*?```sh\n(.*?)```", DOC.read_text(), re.S)
    return [line for line in block.splitlines() if line.strip()]


def test_getting_started_commands(tmp_path, synthetic_tree, upload, gcs_emulator):
    uri = upload(synthetic_tree.root, "imagenet/train")
    bucket = uri[len("gs://"):].split("/", 1)[0]
    root = tmp_path / "mnt"
    (tmp_path / "empty.toml").write_text("")  # no /etc/quiver/quiver.toml of this machine
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "QUIVER_ROOT": str(root),
           "QUIVER_CONFIG": str(tmp_path / "empty.toml")}
    outputs = []
    try:
        for line in documented_commands():
            for original, moved in (("gs://my-bucket", f"gs://{bucket}"),
                                    ("--credentials /srv/key.json", "--anonymous"),
                                    ("/srv/", f"{tmp_path}/"), ("/mnt/quiver", str(root)),
                                    ("/var/cache/quiver", str(tmp_path / "cache"))):
                line = line.replace(original, moved)
            r = subprocess.run(shlex.split(line), env=env, capture_output=True, text=True,
                               timeout=120, stdin=subprocess.DEVNULL)
            assert r.returncode == 0, (line, r.stdout, r.stderr)
            outputs.append(r.stdout)
        status, listing = outputs[4], outputs[5]
        assert "imagenet-train" in status
        classes = sorted({p.split("/")[0] for p in tree_hashes(synthetic_tree.root)})
        assert listing.split() == classes
        assert not (root / "imagenet-train").exists()  # unmounted by the last command
    finally:
        stop_background_mountd(root, env)
    assert not is_mounted(str(root))


def stop_background_mountd(root: Path, env: dict[str, str]) -> None:
    r = subprocess.run(["quiver", "status", "--json"], env=env, capture_output=True,
                       text=True, timeout=30)
    if r.returncode == 0:
        os.kill(json.loads(r.stdout)["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 30
        while is_mounted(str(root)) and time.monotonic() < deadline:
            time.sleep(0.1)
    unmount(str(root))


# -- make demo -------------------------------------------------------------------------
# The demo's own path at its tiny size (about a minute alone on 2 cores).
DEMO_TIMEOUT = 240  # seconds
ROW = re.compile(r"^(rclone mount|Quiver exact reads|Quiver sampler|Quiver view|"
                 r"sampler, 1 job alone) +((?:\d+\.\d\d s +)+)(-?\d\.\d\d)[* ] +"
                 r"([\d.]+ [KMG]?i?B) \(([\d.]+)x\) +(\S+)$", re.M)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
QUIVER_WAYS = ["Quiver exact reads", "Quiver sampler", "Quiver view", "sampler, 1 job alone"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One way's row of the demo's table."""

    epochs: list[float]  # seconds
    hits: float
    bucket_per_dataset: float
    speedup: str  # "1.23x", or "-" where there is nothing to compare with


def demo_rows(output: str) -> dict[str, Row]:
    return {way: Row([float(x) for x in re.findall(r"([\d.]+) s", epochs)], float(hits),
                     float(ratio), speedup)
            for way, epochs, hits, _, ratio, speedup in ROW.findall(output)}


def demo_roots(output: str) -> list[str]:
    return re.findall(r"^mountd stopped, (\S+) unmounted$", output, re.M)


def processes_naming(text: str) -> list[str]:
    """The command lines of running processes that name ``text`` (the demo's work dir)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if text in cmdline:
            found.append(cmdline)
    return found


def assert_cleaned_up(output: str) -> None:
    """Nothing of the demo is left: no mount, no process naming its work dir, no dir."""
    roots = demo_roots(output)
    assert roots, output[-2000:]
    work = os.path.dirname(roots[0])
    assert not any(is_mounted(r) for r in roots)
    assert not processes_naming(work)
    assert not os.path.exists(work)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[str, Path]:
    chart = tmp_path_factory.mktemp("demo") / "chart.png"
    r = subprocess.run([sys.executable, "-m", "quiverfs.bench.demo", "--size", "tiny",
                        "--chart", str(chart)], capture_output=True, text=True,
                       timeout=DEMO_TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout, chart


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 30)
def test_demo_trains_through_the_mount_and_cleans_up(demo_run):
    output, _ = demo_run
    accuracy = float(re.search(r"^test accuracy: ([\d.]+)%$", output, re.M).group(1))
    assert 0 <= accuracy <= 100
    assert output.count("mountd stopped") == 1
    assert_cleaned_up(output)


@pytest.mark.slow
def test_demo_prints_every_quiver_way(demo_run):
    rows = demo_rows(demo_run[0])
    assert [w for w in rows if w != "rclone mount"] == QUIVER_WAYS
    epochs = demo.SIZES["tiny"].sweep.epochs
    for way, row in rows.items():
        assert len(row.epochs) == epochs and all(s > 0 for s in row.epochs), way
        assert row.bucket_per_dataset > 0, way
        if way != "rclone mount":  # rclone's: 1 - bucket bytes / bytes read
            assert 0 <= row.hits <= 1, way
    assert rows["sampler, 1 job alone"].speedup == "-"
    assert re.search(r"^A job alone shares with no one: at a 20% cache it still read "
                     r"[\d.]+x the dataset", demo_run[0], re.M)


@pytest.mark.slow
def test_demo_puts_rclone_beside_quiver(demo_run):
    if not compare.rclone_available():
        pytest.skip("rclone is not installed (apt-get install rclone): the demo leaves "
                    "its row out")
    rows = demo_rows(demo_run[0])
    assert list(rows) == ["rclone mount", *QUIVER_WAYS]
    assert rows["rclone mount"].speedup == "1.00x"
    for way in ("Quiver exact reads", "Quiver sampler", "Quiver view"):
        assert re.fullmatch(r"\d+\.\d\dx", rows[way].speedup), rows[way]


@pytest.mark.slow
def test_demo_writes_its_chart(demo_run):
    output, chart = demo_run
    assert re.search(rf"^chart: {re.escape(str(chart))}$", output, re.M)
    with open(chart, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    with Image.open(chart) as image:
        image.verify()  # the whole file decodes
    with Image.open(chart) as image:
        assert image.width > 500 and image.height > 300


@pytest.mark.slow
def test_demo_view_serves_an_item_of_the_same_label(demo_run):
    opened, served = re.search(r"^opening digits-view/(\S+) read the bytes of (\S+) ",
                               demo_run[0], re.M).groups()
    assert opened.split("/")[0] == served.split("/")[0]


def test_demo_refuses_a_chart_it_cannot_write(tmp_path):
    chart = tmp_path / "missing" / "chart.png"
    r = subprocess.run([sys.executable, "-m", "quiverfs.bench.demo", "--size", "tiny",
                        "--chart", str(chart)], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == ExitCode.NOT_FOUND, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("demo: error: cannot write "
                                                              f"the chart to {chart}")
    assert r.stdout == ""


def _interruptible() -> None:
    """SIGINT as a terminal's foreground job has it: a suite started in the background
    by a shell (``cmd &``) ignores SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT)
def test_demo_interrupted_stops_and_unmounts_everything(tmp_path):
    """Ctrl-C (SIGINT to the demo's whole process group, as a terminal sends it) while it
    trains through the mount: one line, exit 130, nothing left behind."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "quiverfs.bench.demo", "--size",
                             "tiny", "--chart", str(tmp_path / "chart.png")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_interruptible)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("training a small CNN"):
                break
        root = os.path.join(os.path.dirname(re.search(r"--root (\S+)", "".join(lines))
                                            .group(1)), "mnt")
        assert is_mounted(root)
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err == "demo: interrupted; everything stopped and unmounted\n"
    assert_cleaned_up("".join(lines) + rest)
    assert not (tmp_path / "chart.png").exists()
