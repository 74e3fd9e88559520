"""``quiver coordinator``."""
from __future__ import annotations

import argparse
import os

from coordinator.state import HEARTBEAT_TIMEOUT, REPROBE_AFTER
from quiverfs.cycle_cli import add_cycle_options
from quiverfs.errors import ExitCode, QuietError
from quiverfs.option_types import Address


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the cluster coordinator (foreground)",
                       description="Keep cluster membership, datasets by digest identity "
                       "and their chunk cycles; mountd nodes join with --coordinator.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", type=Address("--listen"),
                   help="where to listen")
    p.add_argument("--state-dir", required=True, help="where state is persisted")
    p.add_argument("--cluster-secret-file", help="shared secret of the cluster (or "
                   "$QUIVER_CLUSTER_SECRET); at least 16 bytes")
    p.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT,
                   help="seconds without a heartbeat before a node is dead "
                   "(default %(default)s)")
    p.add_argument("--cache-budget", help="cluster-wide cache bytes to allocate, e.g. 2T "
                   "(default: the sum of the live nodes' cache sizes)")
    add_cycle_options(p)
    p.add_argument("--reprobe-after", type=float, default=REPROBE_AFTER,
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

    secret = load_secret(args.cluster_secret_file)
    from quiverfs.sizes import parse_size

    if args.probe_batches < 1:
        raise QuietError("--probe-batches must be at least 1", ExitCode.USAGE)
    state = CoordinatorState(
        os.path.abspath(args.state_dir), args.heartbeat_timeout, args.force_evict_after,
        budget=parse_size(args.cache_budget, "--cache-budget") if args.cache_budget else None,
        probe_batches=args.probe_batches, reprobe_after=args.reprobe_after)
    try:
        state.save()  # an unwritable state directory fails now, not at the first join
    except OSError as exc:
        raise QuietError(f"cannot write coordinator state in {args.state_dir}: "
                         f"{exc.strerror}", ExitCode.PERMISSION) from None
    metrics = (MetricsServer(args.metrics, CoordinatorCollector(state))
               if args.metrics else None)
    raise_open_file_limit()
    trio.run(CoordinatorServer(state, secret, args.listen, metrics).serve)
    return ExitCode.OK
