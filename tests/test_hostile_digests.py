"""Hostile digests sent to a real mountd by an ordinary user: each is refused with exit 4
and one line, and a good dataset mounted beside them keeps serving correct bytes."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest

from quiverfs.errors import ExitCode
from tests.mountd_helpers import call_as, make_digest, mount, read_hashes, tree_hashes
from tests.mountd_helpers import mountd_factory  # noqa: F401 (a fixture)
from tests.test_digest_errors import HOSTILE, craft

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

USER = 1000  # any local user may send a digest to root's mountd


def test_hostile_digests_are_refused_and_the_good_dataset_survives(
        subtests, quiver, shared_workdir, mountd_factory, synthetic_tree, tmp_path) -> None:
    src = os.path.join(shared_workdir, "src")
    shutil.copytree(synthetic_tree.root, src)
    subprocess.run(["chmod", "-R", "a+rX", src], check=True)
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"))
    os.chmod(m.cache_dir, 0o755)  # the control socket lives there
    mount(m, make_digest(src, "good"), "good")
    expected = tree_hashes(src)
    good = os.path.join(m.root, "good")

    def assert_good_dataset_intact(case: str) -> None:
        assert read_hashes(good, sorted(expected)) == expected, f"{case}: wrong bytes"
        names = [d["name"] for d in m.status()["datasets"]]
        assert names == ["good"], f"{case}: mountd lists {names}"

    for case, (kwargs, words) in HOSTILE.items():
        with subtests.test(case=case):
            # The source is real and readable by the user: only the crafted part is wrong.
            data = craft(**{"source": f"file://{src}", **kwargs})
            reply = call_as(USER, USER, m.socket, {"op": "mount", "name": "hostile",
                                                   "digest": data})
            assert not reply["ok"] and reply["code"] == ExitCode.BAD_DIGEST, reply
            assert "\n" not in reply["error"], reply["error"]
            for word in words:
                assert word in reply["error"], (word, reply["error"])
            assert_good_dataset_intact(case)

    with subtests.test(case="dataset name with a trailing newline"):
        reply = call_as(USER, USER, m.socket, {"op": "mount", "name": "evil\n",
                                               "digest": make_digest(src, "evil")})
        assert not reply["ok"] and reply["code"] == ExitCode.USAGE, reply
        assert "invalid dataset name 'evil\\n'" in reply["error"]
        assert "evil\n" not in os.listdir(m.root)
        assert_good_dataset_intact("name with a newline")

    with subtests.test(case="job name with a trailing newline"):
        with pytest.raises(OSError) as info:
            os.mkdir(os.path.join(m.root, ".quiver", "jobs", "evil\n"))
        assert info.value.errno == errno.EINVAL

    with subtests.test(case="quiver mount of a digest with a non-UTF-8 path"):
        path = tmp_path / "hostile.qd"
        path.write_bytes(craft([b"a/caf\xe9.jpg"], source=f"file://{src}"))
        r = quiver("mount", str(path), "--root", m.root, "--control-socket", m.socket)
        assert r.returncode == ExitCode.BAD_DIGEST, r.stderr
        assert r.stderr.splitlines() == [
            f"quiver: error: {path}: path 'a/caf\\\\xe9.jpg' is not valid UTF-8: recreate it "
            "with 'quiver digest create'"]
        assert_good_dataset_intact("quiver mount")
