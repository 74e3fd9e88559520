"""``quiver coordinator``."""
from __future__ import annotations

import argparse
import os
import re
from typing import TYPE_CHECKING

from coordinator.etcd_client import EtcdAccess, EtcdEndpoints
from coordinator.state import (FORGET_AFTER, FORGET_DATASETS_AFTER, HEARTBEAT_TIMEOUT,
                               REPROBE_AFTER)
from quiverfs.cycle_cli import add_cycle_options
from quiverfs.errors import ExitCode, QuietError
from quiverfs.option_types import Address, ByteSize, FloatAtLeast, IntAtLeast
from quiverfs.peer_network import PeerNetworks

if TYPE_CHECKING:
    from coordinator.leadership import Leadership
    from coordinator.server import CoordinatorServer
    from coordinator.state import CoordinatorState

LEASE_TTL = 5  # seconds a leader leads on without renewing its lease in etcd
_ETCD_ACCESS = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")
PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # an --etcd-prefix, in full


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the cluster coordinator (foreground)",
                       description="Keep cluster membership, datasets by digest identity "
                       "and their chunk cycles; mountd nodes join with --coordinator.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", type=Address("--listen"),
                   help="where to listen")
    p.add_argument("--state-dir", help="where state is persisted (one coordinator; "
                   "or --etcd)")
    p.add_argument("--etcd", metavar="URL[,URL...]", type=EtcdEndpoints("--etcd"),
                   help="keep the state in etcd at these client URLs (https://HOST:PORT "
                   "or http://, comma-separated) instead of --state-dir: several "
                   "coordinators share it, one leads and the others stand by")
    p.add_argument("--etcd-ca", metavar="FILE",
                   help="with https --etcd URLs: the CA certificates (PEM) that etcd's "
                   "certificate must be signed by (default: $REQUESTS_CA_BUNDLE, or the CAs "
                   "of Python's requests)")
    p.add_argument("--etcd-cert", metavar="FILE",
                   help="with https --etcd URLs: this coordinator's client certificate "
                   "(PEM), for an etcd that checks its clients' (--client-cert-auth)")
    p.add_argument("--etcd-key", metavar="FILE", help="the --etcd-cert's key (PEM, no "
                   "passphrase)")
    p.add_argument("--etcd-user", metavar="NAME",
                   help="for an etcd with auth enabled: the user to authenticate as (it "
                   "needs read and write on /quiver/PREFIX/)")
    p.add_argument("--etcd-password-file", metavar="FILE",
                   help="the file holding --etcd-user's password")
    p.add_argument("--etcd-prefix", default="default", metavar="NAME",
                   help="the cluster's keys in etcd are /quiver/NAME/... "
                   "(default %(default)s)")
    p.add_argument("--lease-ttl", default=LEASE_TTL, metavar="SECONDS",
                   type=IntAtLeast("--lease-ttl", 1),
                   help="with --etcd: seconds a leader that cannot renew its lease leads on, "
                   "and a standby waits for a lost leader (default %(default)s)")
    p.add_argument("--advertise", metavar="HOST:PORT", type=Address("--advertise", True),
                   help="with --etcd: the address nodes reach this coordinator at, which a "
                   "standby names as the leader's (default: the --listen address)")
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
    if (args.state_dir is None) == (args.etcd is None):
        raise QuietError("give --state-dir (one coordinator) or --etcd (several sharing "
                         "etcd, one leading), not both or neither", ExitCode.USAGE)
    etcd_only = [f"--{name.replace('_', '-')}" for name in _ETCD_ACCESS
                 if getattr(args, name) is not None]
    if args.etcd is None and etcd_only:
        raise QuietError(f"{etcd_only[0]} is for --etcd: give --etcd URLs, or leave it out "
                         "with --state-dir", ExitCode.USAGE)
    if args.etcd is not None and not PREFIX.fullmatch(args.etcd_prefix):
        raise QuietError(f"--etcd-prefix {args.etcd_prefix!r} is not valid: give letters, "
                         "digits, '.', '_' and '-' (at most 64)", ExitCode.USAGE)
    secret = load_secret(args.cluster_secret_file)
    state = CoordinatorState(
        args.state_dir and os.path.abspath(args.state_dir), args.heartbeat_timeout,
        args.force_evict_after, budget=args.cache_budget, probe_batches=args.probe_batches,
        reprobe_after=args.reprobe_after, forget_after=args.forget_after,
        forget_datasets_after=args.forget_datasets_after)
    if args.state_dir is not None:
        try:
            state.save()  # an unwritable state directory fails now, not at the first join
        except OSError as exc:
            raise QuietError(f"cannot write coordinator state in {args.state_dir}: "
                             f"{exc.strerror}", ExitCode.PERMISSION) from None
    raise_open_file_limit()
    server = CoordinatorServer(state, secret, args.listen, None, args.peer_network or ())
    if args.etcd is not None:
        server.leadership = _leadership(args, state, server)
    if args.metrics:
        server.metrics = MetricsServer(args.metrics,
                                       CoordinatorCollector(state, server.leadership))
    trio.run(server.serve)
    return ExitCode.OK


def _leadership(args: argparse.Namespace, state: CoordinatorState,
                server: CoordinatorServer) -> Leadership:
    """The leader election and the state's keys in etcd, for ``server``."""
    from coordinator.etcd_client import EtcdClient
    from coordinator.etcd_store import EtcdState
    from coordinator.leadership import RENEWS_PER_TTL, Leadership

    if args.advertise is not None:
        advertise = "%s:%d" % args.advertise
    elif args.listen[0] in ("0.0.0.0", "::", ""):
        raise QuietError(f"--listen {server.address} is no address a node can reach: "
                         "give --advertise HOST:PORT", ExitCode.USAGE)
    else:
        advertise = server.address
    # A call to etcd gives up within a renewal period: the leader tries again in time.
    timeout = args.lease_ttl / RENEWS_PER_TTL
    access = _access(args)
    store = EtcdState(EtcdClient(access, timeout), args.etcd_prefix, args.heartbeat_timeout)
    return Leadership(state, store, EtcdClient(access, timeout), advertise,
                      args.lease_ttl, admit=server.admit)


def _access(args: argparse.Namespace) -> EtcdAccess:
    """--etcd and how to reach it: TLS files checked, the password read."""
    if (args.etcd_cert is None) != (args.etcd_key is None):
        raise QuietError("give --etcd-cert and --etcd-key together", ExitCode.USAGE)
    if (args.etcd_user is None) != (args.etcd_password_file is None):
        raise QuietError("give --etcd-user and --etcd-password-file together",
                         ExitCode.USAGE)
    password = None
    if args.etcd_password_file is not None:
        try:
            with open(args.etcd_password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or "not UTF-8 text"
            raise QuietError(f"cannot read --etcd-password-file "
                             f"{args.etcd_password_file}: {reason}",
                             ExitCode.PERMISSION) from None
    access = EtcdAccess(args.etcd, args.etcd_ca, args.etcd_cert, args.etcd_key,
                        args.etcd_user, password)
    access.check()
    return access
