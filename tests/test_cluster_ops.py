"""The coordinator and a node started as their units start them, with the docs' config."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from quiverfs.bench.processes import free_port
from tests.notify_daemon import notify_daemon  # noqa: F401
from tests.test_metrics import scrape, value
from tests.test_systemd import MOUNTD_UNIT, UNITS, exec_lines, render

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

CLUSTER_DOC = Path(__file__).resolve().parent.parent / "docs" / "cluster.md"
COORDINATOR_UNIT = UNITS / "quiver-coordinator.service"


def documented_cluster_config(tmp_path: Path) -> tuple[str, dict[str, int]]:
    """docs/cluster.md's config with paths in ``tmp_path`` and free loopback ports."""
    (example,) = re.findall(r"```toml\n(# /etc/quiver/quiver.toml on vm1.*?)```",
                            CLUSTER_DOC.read_text(encoding="utf-8"), re.S)
    ports = {name: free_port() for name in ("rpc", "peer", "node_metrics", "co_metrics")}
    for original, moved in (("/mnt/quiver", f"{tmp_path}/mnt"),
                            ("/var/cache/quiver", f"{tmp_path}/cache"),
                            ("/var/lib/quiver/coordinator", f"{tmp_path}/coordinator"),
                            ("/etc/quiver/cluster.secret", f"{tmp_path}/cluster.secret"),
                            ("10.0.0.1:7070", f"127.0.0.1:{ports['rpc']}"),
                            ("10.0.0.1:7071", f"127.0.0.1:{ports['peer']}"),
                            ("127.0.0.1:9100", f"127.0.0.1:{ports['node_metrics']}"),
                            ("127.0.0.1:9101", f"127.0.0.1:{ports['co_metrics']}")):
        assert original in example, f"the example no longer shows {original}"
        example = example.replace(original, moved)
    return f'control-socket = "{tmp_path}/ctl.sock"\n' + example, ports


def test_coordinator_and_node_from_their_units_with_the_documented_config(
        notify_daemon, quiver, tmp_path, synthetic_tree):
    etc = tmp_path / "etc"
    etc.mkdir()
    text, ports = documented_cluster_config(tmp_path)
    (etc / "quiver.toml").write_text(text, encoding="utf-8")
    (tmp_path / "cluster.secret").write_text("a-cluster-secret-for-the-test\n")
    (tmp_path / "mnt").mkdir()
    # (the coordinator mounts nothing: its "root" is only its work directory)
    for unit, workdir, root in ((COORDINATOR_UNIT, "co", tmp_path / "co"),
                                (MOUNTD_UNIT, "node", tmp_path / "mnt")):
        (tmp_path / workdir).mkdir()
        ((argv, _),) = exec_lines(render(unit, tmp_path / "units", etc), "ExecStart")
        daemon = notify_daemon(argv, str(tmp_path / workdir), str(root))
        assert "READY=1" in daemon.messages
    cfg = str(etc / "quiver.toml")
    digest = str(tmp_path / "syn.qd")
    assert quiver("--config", cfg, "digest", "create", synthetic_tree.root, "-o",
                  digest).returncode == 0
    assert quiver("--config", cfg, "mount", digest, "--name", "syn").returncode == 0
    files = [p for p in (tmp_path / "mnt" / "syn").rglob("*") if p.is_file()]
    for path in files:
        path.read_bytes()

    node = scrape(ports["node_metrics"])
    assert value(node, "quiver_hits_total", tier="bucket") == len(files)
    co = scrape(ports["co_metrics"])
    assert value(co, "quiver_coordinator_nodes", state="live") == 1
    assert value(co, "quiver_coordinator_budget_bytes") > 0
    status = quiver("--config", cfg, "status", "--cluster")
    assert status.returncode == 0 and "vm1" in status.stdout, status.stderr
