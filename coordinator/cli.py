"""``quiver coordinator``."""
from __future__ import annotations

import argparse
import os

import trio

from quiverfs.errors import ExitCode


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the cluster coordinator (foreground)",
                       description="Keep cluster membership, datasets by digest identity "
                       "and their chunk cycles; mountd nodes join with --coordinator.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where to listen")
    p.add_argument("--state-dir", required=True, help="where state is persisted")
    p.add_argument("--cluster-secret-file", help="shared secret of the cluster (or "
                   "$QUIVER_CLUSTER_SECRET); at least 16 bytes")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a heartbeat before a node is dead (default 5)")
    p.add_argument("--force-evict-after", type=float, default=120.0,
                   help="seconds a marked chunk may outlive its first release (default 120)")
    p.set_defaults(func=cmd_coordinator, daemon=True)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.server import CoordinatorServer
    from coordinator.state import CoordinatorState
    from quiverfs.rpc import load_secret, parse_address

    host, port = parse_address(args.listen, "--listen")
    secret = load_secret(args.cluster_secret_file)
    state = CoordinatorState(os.path.abspath(args.state_dir), args.heartbeat_timeout,
                             args.force_evict_after)
    trio.run(CoordinatorServer(state, secret).serve, host, port)
    return ExitCode.OK
