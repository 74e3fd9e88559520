"""``quiver coordinator``."""
from __future__ import annotations

import argparse
import os

from coordinator.state import (FORGET_AFTER, FORGET_DATASETS_AFTER, HEARTBEAT_TIMEOUT,
                               REPROBE_AFTER)
from quiverfs.cycle_cli import add_cycle_options
from quiverfs.errors import ExitCode, QuietError
from quiverfs.option_types import Address, ByteSize, FloatAtLeast
from quiverfs.peer_network import PeerNetworks


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the cluster coordinator (foreground)",
                       description="Keep cluster membership, datasets by digest identity "
                       "and their chunk cycles; mountd nodes join with --coordinator.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", type=Address("--listen"),
                   help="where to listen")
    p.add_argument("--state-dir", required=True, help="where state is persisted")
    p.add_argument("--cluster-secret-file", help="shared secret of the cluster (or "
                   "$QUIVER_CLUSTER_SECRET); at least 16 bytes")
    p.add_argument("--heartbeat-timeout", default=HEARTBEAT_TIMEOUT,
                   type=FloatAtLeast("--heartbeat-timeout", 0, minimum_ok=False),
                   help="seconds without a heartbeat before a node is dead "
                   "(default %(default)s)")
    p.add_argument("--forget-after", metavar="SECONDS",
                   type=FloatAtLeast("--forget-after", 0, minimum_ok=False),
                   help="seconds without a heartbeat before a node is forgotten: gone from "
                   "the membership and from every dataset, restarts included; at least "
                   f"--heartbeat-timeout (default {FORGET_AFTER:g}, or --heartbeat-timeout "
                   "where longer)")
    p.add_argument("--forget-datasets-after", metavar="SECONDS",
                   default=FORGET_DATASETS_AFTER,
                   type=FloatAtLeast("--forget-datasets-after", 0, minimum_ok=False),
                   help="seconds no node reports a dataset (no node has a job on it) "
                   "before it is forgotten with its chunk cycle, restarts included "
                   "(default %(default)g)")
    p.add_argument("--peer-network", metavar="CIDR[,CIDR...]",
                   type=PeerNetworks("--peer-network"),
                   help="refuse nodes whose peer address is outside these networks, or is "
                   "a host name (default: any address)")
    p.add_argument("--cache-budget", type=ByteSize("--cache-budget", zero_ok=True),
                   help="cluster-wide cache bytes to allocate, e.g. 2T "
                   "(default: the sum of the live nodes' cache sizes)")
    add_cycle_options(p, min_probe_batches=1)
    p.add_argument("--reprobe-after", default=REPROBE_AFTER,
                   type=FloatAtLeast("--reprobe-after", 0, minimum_ok=False),
                   help="seconds between probes of a job (default %(default)s)")
    p.add_argument("--metrics", metavar="HOST:PORT", type=Address("--metrics"),
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    p.set_defaults(func=cmd_coordinator, daemon=True)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.metrics import CoordinatorCollector
    from coordinator.server import CoordinatorServer
    import trio  # here: every quiver command imports this module to list its options

    from coordinator.state import CoordinatorState
    from quiverfs.metrics_server import MetricsServer
    from quiverfs.process_limits import raise_open_file_limit
    from quiverfs.rpc import load_secret

    if args.forget_after is not None and args.forget_after < args.heartbeat_timeout:
        raise QuietError(f"--forget-after must be at least --heartbeat-timeout "
                         f"({args.heartbeat_timeout:g}), not {args.forget_after:g}",
                         ExitCode.USAGE)
    secret = load_secret(args.cluster_secret_file)
    state = CoordinatorState(
        os.path.abspath(args.state_dir), args.heartbeat_timeout, args.force_evict_after,
        budget=args.cache_budget, probe_batches=args.probe_batches,
        reprobe_after=args.reprobe_after, forget_after=args.forget_after,
        forget_datasets_after=args.forget_datasets_after)
    try:
        state.save()  # an unwritable state directory fails now, not at the first join
    except OSError as exc:
        raise QuietError(f"cannot write coordinator state in {args.state_dir}: "
                         f"{exc.strerror}", ExitCode.PERMISSION) from None
    metrics = (MetricsServer(args.metrics, CoordinatorCollector(state))
               if args.metrics else None)
    raise_open_file_limit()
    server = CoordinatorServer(state, secret, args.listen, metrics, args.peer_network or ())
    trio.run(server.serve)
    return ExitCode.OK
