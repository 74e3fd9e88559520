"""docs/getting-started.md's commands, run as written against the GCS emulator."""
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
