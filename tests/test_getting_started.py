"""docs/getting-started.md's commands, run as written against the GCS emulator; and
``make demo``'s program, with what it prints."""
from __future__ import annotations

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

from quiverfs.bench import demo
from quiverfs.bench.processes import unmount
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
DEMO_TIMEOUT = 240  # seconds; it takes about a minute alone on 2 cores (under 2 minutes)
ROW = re.compile(r"^(exact reads|sampler|view) {2,}(.*)$", re.M)
CELL = re.compile(r"(\d\.\d\d) +(\d+) \(([\d.]+ [KMG]?i?B)\)")


@pytest.fixture(scope="module")
def demo_output() -> str:
    r = subprocess.run([sys.executable, "-m", "quiverfs.bench.demo"], capture_output=True,
                       text=True, timeout=DEMO_TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout


def demo_table(output: str) -> dict[str, list[tuple[float, int]]]:
    """way -> per epoch (hit ratio, items fetched from the bucket), from the printed table."""
    return {way: [(float(hits), int(fetched)) for hits, fetched, _ in CELL.findall(cells)]
            for way, cells in ROW.findall(output)}


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 30)
def test_demo_trains_through_the_mount_and_cleans_up(demo_output):
    accuracy = float(re.search(r"^test accuracy: ([\d.]+)%$", demo_output, re.M).group(1))
    assert accuracy > 80
    assert demo_output.count("mountd stopped") == 2
    roots = re.findall(r"^mountd stopped, (\S+) unmounted$", demo_output, re.M)
    assert roots and not any(is_mounted(r) for r in roots)


@pytest.mark.slow
def test_demo_prints_the_three_ways_side_by_side(demo_output):
    table = demo_table(demo_output)
    assert list(table) == [way.label for way in demo.WAYS]
    items = int(re.search(r"(\d+) digit images", demo_output).group(1))
    for way, epochs in table.items():
        assert len(epochs) == demo.COMPARE_EPOCHS, way
        assert all(0 <= hits <= 1 and fetched >= 0 for hits, fetched in epochs), way
    # a cold cache: the first epoch of exact reads fetches every item once
    assert table["exact reads"][0] == (0.0, items)


@pytest.mark.slow
def test_demo_substitution_hits_where_exact_reads_miss(demo_output):
    """In the steady epochs (after the first) exact reads through an LRU cache of 20%
    under a fresh shuffle nearly all miss; the sampler and the view nearly all hit."""
    table = demo_table(demo_output)
    steady = {way: [hits for hits, _ in epochs[1:]] for way, epochs in table.items()}
    assert max(steady["exact reads"]) < 0.1, steady
    for way in ("sampler", "view"):
        assert sum(steady[way]) / len(steady[way]) > 0.5, steady


@pytest.mark.slow
def test_demo_view_serves_an_item_of_the_same_label(demo_output):
    opened, served = re.search(r"^opening digits-view/(\S+) read the bytes of (\S+) ",
                               demo_output, re.M).groups()
    assert opened.split("/")[0] == served.split("/")[0]
