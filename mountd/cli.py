"""The daemon-side subcommands: mountd, mount, umount, status, prefetch."""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from mountd.control.replies import (ClusterReply, CoordinatorsStatus, MountReply,
                                    PrefetchReply, StatusReply)
from quiverfs import control_client
from quiverfs import digest as digest_format
from quiverfs.chunk_cycle import ChunkState
from quiverfs.counters import ReadCounter, SamplerJobCounter
from quiverfs.cycle_cli import add_cycle_options
from quiverfs.dataset_name import check_name
from quiverfs.errors import ExitCode, QuietError
from quiverfs.gcs_endpoint import GcsEndpoints
from quiverfs.job_protocol import VIEWS
from quiverfs.backends.base import FETCH_DEADLINE
from quiverfs.option_types import Address, Addresses, ByteSize, FloatAtLeast, IntAtLeast
from quiverfs.peer_network import PeerNetworks
from quiverfs.sizes import human
from quiverfs.storage_cli import add_storage_options, storage_options

if TYPE_CHECKING:
    from mountd.cluster.membership import EmbeddedFactory

STARTUP_TIMEOUT = 120.0  # seconds a backgrounded mountd may take to answer
THREADS = 16  # mountd's blocking workers, by default
# The native data plane's threads, by default. Each waits for the kernel's next request
# or, serving a READ, for the disk: they are the store reads in flight, so even a
# 2-core machine needs more than its cores (docs/benchmarks.md: warm_ratio_16 0.3 with
# 2 threads, 0.85 with 16, in one quick run on 2 cores).
FUSE_THREADS = max(16, os.cpu_count() or 1)
PUSH_MEMORY = 256 << 20  # bytes, by default (mountd.fetch.page_push)
SCRUB_MB_S = 8.0  # MB a second, by default (mountd.store.scrubber)
MEMORY_PER_USER = 2 << 30  # bytes, by default (mountd.datasets.memory_budget)
DIGEST_BYTES_PER_USER = 2 << 30  # bytes, by default (mountd.control.quotas)
MAX_LOADER_PROCESSES = 64


def default_loader_processes() -> int:
    """Loader processes by default: one per core this process may run on but the one
    that serves FUSE, at least one and at most 4 (each keeps 16 fetches in flight)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) - 1))


def _root_arg(p: argparse.ArgumentParser) -> None:
    # $QUIVER_ROOT is applied by quiverfs.config, between the command line and the file.
    p.add_argument("--root", default=control_client.DEFAULT_ROOT,
                   help="mount root of the mountd to talk to (default: $QUIVER_ROOT or "
                   "%(default)s)")
    p.add_argument("--control-socket", help="its control socket (default: derived from --root)")


def add_parsers(sub: argparse._SubParsersAction,
                embedded_coordinator: EmbeddedFactory) -> None:
    """The daemon-side subcommands; ``embedded_coordinator`` makes the coordinator a
    single node runs in-process (the caller brings it: mountd does not import it)."""
    d = sub.add_parser("mountd", help="run the per-VM mount daemon",
                       description="Mount a read-only Quiver filesystem at ROOT, backed by a "
                       "content-addressed cache in CACHE_DIR. Datasets appear at ROOT/NAME "
                       "after 'quiver mount'. Runs in the background unless --foreground.")
    _root_arg(d)
    d.add_argument("--cache-dir", required=True, help="SSD directory for the cache and state")
    d.add_argument("--cache-size", required=True, type=ByteSize("--cache-size"),
                   help="cache bound, e.g. 200G")
    d.add_argument("--foreground", action="store_true", help="stay in the foreground")
    d.add_argument("--log-file", help="log file when in the background "
                   "(default: CACHE_DIR/mountd.log)")
    d.add_argument("--threads", type=IntAtLeast("--threads", 1), default=THREADS,
                   help="workers for short blocking I/O (the store, status), and as many "
                   "for fetches in mountd (default %(default)s)")
    d.add_argument("--loader-processes", metavar="N",
                   type=IntAtLeast("--loader-processes", 0, MAX_LOADER_PROCESSES),
                   default=default_loader_processes(),
                   help="processes that fetch, check and store items from gs:// buckets, "
                   "off the process that serves reads: N (at least 2) for the misses "
                   "readers wait on and N for chunk loads; 0 fetches everything in mountd "
                   "(default: one per core but one, at least 1, at most 4: %(default)s "
                   "here)")
    d.add_argument("--fetch-deadline", metavar="SECONDS",
                   type=FloatAtLeast("--fetch-deadline", 0, minimum_ok=False),
                   default=FETCH_DEADLINE,
                   help="seconds a read of an item from a gs:// bucket may take in all, "
                   "retries included; past it the read fails with EIO (default %(default)g)")
    d.add_argument("--push-memory", metavar="BYTES", type=ByteSize("--push-memory", zero_ok=True),
                   default=PUSH_MEMORY,
                   help="bytes of substitutable jobs' planned items pushed into the "
                   "kernel's page cache ahead of their reads and not yet read, at most; "
                   "0 pushes nothing (default 256M). Used where files are served through "
                   "Python (--data-path python, --fuse-opens): the native data plane's reads "
                   "cost less than pushes. Without --fuse-opens a push counts until its job "
                   "asks for the manifest after the next one")
    d.add_argument("--scrub-mb-s", metavar="MB", type=FloatAtLeast("--scrub-mb-s", 0),
                   default=SCRUB_MB_S,
                   help="megabytes (10^6 bytes) of the store hashed again each second, in "
                   "the background, one pass over every entry after another: an entry "
                   "whose bytes changed on disk is dropped and fetched again at its next "
                   "read; 0 turns this off (default %(default)g)")
    d.add_argument("--fuse-opens", action="store_true",
                   help="serve dataset files with FUSE OPEN and RELEASE requests, as with a "
                   "pyfuse3 without mountd's patch (by default mountd runs without them "
                   "where its pyfuse3 allows: fewer requests per file)")
    d.add_argument("--data-path", choices=("native", "passthrough", "python"),
                   default="native",
                   help="how cached dataset files are served: 'native', by mountd's C "
                   "threads (READ, LOOKUP and GETATTR of stored, verified items), Python "
                   "for the rest; 'passthrough', the same threads answer OPEN with the "
                   "store's file and the kernel reads it (FUSE passthrough: Linux 6.9, "
                   "else as 'native'); 'python', every request through Python. Where the "
                   "native module cannot start, mountd serves through Python and says so "
                   "(default %(default)s)")
    d.add_argument("--fuse-threads", metavar="N", type=IntAtLeast("--fuse-threads", 1, 256),
                   default=FUSE_THREADS,
                   help="the native data plane's threads: they read the datasets' FUSE "
                   "connection and serve cached files, as many store reads in flight "
                   "(default: 16, or one per core where more: %(default)s here)")
    d.add_argument("--memory-per-user", metavar="BYTES", type=ByteSize("--memory-per-user"),
                   default=MEMORY_PER_USER,
                   help="memory the registrations of one user (root excepted) may take: "
                   "decoded digests, their trees and view pools, each shared copy counted "
                   "once; a registration past it is refused (default 2G)")
    d.add_argument("--memory-total", metavar="BYTES", type=ByteSize("--memory-total"),
                   help="memory the registrations of all users together, root's too, may "
                   "take (default: a quarter of physical memory)")
    d.add_argument("--gcs-endpoint", metavar="URL[,URL...]", type=GcsEndpoints("--gcs-endpoint"),
                   default=(),
                   help="GCS endpoints (http[s]://HOST[:PORT], such as an emulator's) that "
                   "users other than root may name with STORAGE_EMULATOR_HOST, comma-"
                   "separated; in the config file, an array of strings (default: none, only "
                   "Google's own; root may name any)")
    d.add_argument("--digest-bytes-per-user", metavar="BYTES",
                   type=ByteSize("--digest-bytes-per-user"), default=DIGEST_BYTES_PER_USER,
                   help="bytes of digest files the registrations of one user (root "
                   "excepted) may keep in the state directory, each digest counted once "
                   "however many names it is registered under (default 2G)")
    d.add_argument("--metrics", metavar="HOST:PORT", type=Address("--metrics"),
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    d.add_argument("--chunk-size", type=ByteSize("--chunk-size"),
                   help="chunk size for substitutable jobs, e.g. 15G "
                   "(default: the smallest of 10%% of a dataset, 15 GiB and, without "
                   "--coordinator, an eighth of --cache-size)")
    add_cycle_options(d, applies=", without --coordinator")
    c = d.add_argument_group("cluster (without --coordinator, mountd is a single node)")
    c.add_argument("--coordinator", metavar="HOST:PORT[,HOST:PORT...]",
                   type=Addresses("--coordinator"),
                   help="the coordinator to join; several, comma-separated (in the config "
                   "file, an array of strings): the node follows the one that leads, "
                   "and tries the others in order when it stops answering")
    c.add_argument("--listen", metavar="HOST:PORT", type=Address("--listen"),
                   help="address of this node's peer server (default 127.0.0.1:0)")
    c.add_argument("--node-id", help="this node's name in the cluster (default: hostname)")
    c.add_argument("--peer-network", metavar="CIDR[,CIDR...]",
                   type=PeerNetworks("--peer-network"),
                   help="never dial a member whose peer address is outside these networks, "
                   "or is a host name (default: any address)")
    c.add_argument("--cluster-secret-file", help="shared cluster secret (or "
                   "$QUIVER_CLUSTER_SECRET), at least 16 bytes")
    d.set_defaults(func=functools.partial(cmd_mountd,
                                          embedded_coordinator=embedded_coordinator),
                   daemon=True)

    m = sub.add_parser("mount", help="register a digest: its tree appears at ROOT/NAME",
                       description="Register DIGEST with the running mountd. Only you (and "
                       "root) can list or read ROOT/NAME.")
    m.add_argument("digest", help="digest file made by 'quiver digest create'")
    m.add_argument("--name", type=check_name,
                   help="directory name under ROOT (default: the digest's name)")
    m.add_argument("--prefetch", action="store_true", help="warm the cache in the background")
    m.add_argument("--view", choices=VIEWS, default="exact",
                   help="exact (default): every path reads its own bytes. substitutable: "
                   "opening a file of a class folder reads an item of that folder this job "
                   "has not had in its current pass, cached ones first (docs/view.md)")
    _root_arg(m)
    add_storage_options(m)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="remove ROOT/NAME (the cache keeps its content)")
    u.add_argument("name", type=check_name, help="dataset name")
    _root_arg(u)
    u.set_defaults(func=cmd_umount)

    s = sub.add_parser("status", help="datasets, cache use, hits/misses and bytes per tier")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--cluster", action="store_true",
                   help="nodes, ownership shares, chunk states and jobs of the cluster")
    _root_arg(s)
    s.set_defaults(func=cmd_status)

    f = sub.add_parser("prefetch", help="warm the cache with a whole dataset, in the background")
    f.add_argument("name", type=check_name, help="dataset name")
    _root_arg(f)
    f.set_defaults(func=cmd_prefetch)


def _socket(args: argparse.Namespace) -> str:
    return args.control_socket or control_client.default_socket(args.root)


def _call(args: argparse.Namespace, request: dict) -> dict:
    return control_client.call(_socket(args), request, root=args.root)


def cmd_mountd(args: argparse.Namespace, embedded_coordinator: EmbeddedFactory) -> int:
    from mountd.daemon import MountdConfig, check_cluster_config, prepare_root, run_mountd
    from mountd.fs.native_plane import DataPath

    root = os.path.abspath(args.root)
    cfg = MountdConfig(root=root, cache_dir=os.path.abspath(args.cache_dir),
                       cache_size=args.cache_size,
                       control_socket=args.control_socket or control_client.default_socket(root),
                       threads=args.threads, loader_processes=args.loader_processes,
                       fetch_deadline=args.fetch_deadline,
                       push_memory=args.push_memory, fuse_opens=args.fuse_opens,
                       data_path=DataPath(args.data_path), fuse_threads=args.fuse_threads,
                       scrub_mb_s=args.scrub_mb_s,
                       memory_per_uid=args.memory_per_user, memory_total=args.memory_total,
                       digest_bytes_per_uid=args.digest_bytes_per_user,
                       chunk_bytes=args.chunk_size, metrics=args.metrics,
                       force_evict_after=args.force_evict_after,
                       probe_batches=args.probe_batches,
                       coordinator=args.coordinator, listen=args.listen,
                       cluster_secret_file=args.cluster_secret_file,
                       peer_networks=args.peer_network or (),
                       gcs_endpoints=args.gcs_endpoint)
    if args.node_id:
        cfg.node_id = args.node_id
    if args.coordinator:
        from quiverfs.rpc import load_secret
        check_cluster_config(cfg)
        load_secret(args.cluster_secret_file)  # fail here, before mounting
    try:
        os.makedirs(cfg.cache_dir, mode=0o700, exist_ok=True)  # the store is everyone's data
    except OSError as exc:
        raise QuietError(f"cannot create --cache-dir {cfg.cache_dir}: {exc.strerror}",
                         ExitCode.PERMISSION) from None
    prepare_root(root)
    if args.foreground:
        run_mountd(cfg, embedded_coordinator)
        return ExitCode.OK
    return _spawn_background(args, cfg.control_socket,
                             args.log_file or os.path.join(cfg.cache_dir, "mountd.log"))


def _spawn_background(args: argparse.Namespace, socket_path: str, log_file: str) -> int:
    """Start ``quiver mountd --foreground`` detached; return once it answers."""
    argv = [sys.executable, "-m", "quiverfs.cli"] + [a for a in sys.argv[1:]] + ["--foreground"]
    try:
        log = open(log_file, "ab")
    except OSError as exc:
        raise QuietError(f"cannot write the log file {log_file}: {exc.strerror}: pick "
                         "another --log-file or run with --foreground",
                         ExitCode.PERMISSION) from None
    with log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise QuietError(f"mountd exited with status {proc.returncode}: "
                             f"{_last_line(log_file)}", ExitCode(proc.returncode)
                             if proc.returncode in ExitCode._value2member_map_ else ExitCode.DAEMON)
        try:
            control_client.call(socket_path, {"op": "status"}, timeout=5)
        except QuietError:
            time.sleep(0.1)
            continue
        print(f"mountd {proc.pid} serving {os.path.abspath(args.root)} (log: {log_file})")
        return ExitCode.OK
    proc.terminate()
    raise QuietError(f"mountd did not start within {STARTUP_TIMEOUT:.0f} s; see {log_file}",
                     ExitCode.DAEMON)


def _last_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "(no output)"


def cmd_mount(args: argparse.Namespace) -> int:
    digest = digest_format.load(args.digest)
    name = args.name or _digest_name(args.digest, digest.name)
    with open(args.digest, "rb") as f:
        data = f.read()
    opts = storage_options(args)
    # Only a bucket has an endpoint: an emulator's variable set in the shell does not
    # make a local dataset's registration name one (which mountd may refuse).
    endpoint = opts.emulator_host if digest.source.startswith("gs://") else None
    reply = _call(args, {"op": "mount", "name": name, "digest": data,
                         "credentials": opts.credentials_info,
                         "emulator_host": endpoint, "anonymous": opts.anonymous,
                         "prefetch": args.prefetch, "view": args.view})
    mounted = control_client.typed(reply, MountReply, "mount")
    view = " (substitutable view)" if mounted.view == "substitutable" else ""
    print(f"{mounted.path}: {mounted.items} items, {human(mounted.bytes)}{view}")
    return ExitCode.OK


def _digest_name(path: str, name: str) -> str:
    """The digest's own dataset name, if it is a valid one (digests made before the name
    rule held for ``digest create`` may carry any string)."""
    try:
        return check_name(name)
    except QuietError as exc:
        raise QuietError(f"{path}: {exc.message}: pass --name NAME", exc.exitcode) from None


def cmd_umount(args: argparse.Namespace) -> int:
    _call(args, {"op": "umount", "name": args.name})
    return ExitCode.OK


def cmd_prefetch(args: argparse.Namespace) -> int:
    reply = control_client.typed(_call(args, {"op": "prefetch", "name": args.name}),
                                 PrefetchReply, "prefetch")
    print(f"prefetching {reply.items} items of {reply.name} "
          "(progress: 'quiver status')")
    return ExitCode.OK


def cmd_status(args: argparse.Namespace) -> int:
    if args.cluster:
        return _cluster_status(args)
    raw = _call(args, {"op": "status"})
    reply = control_client.typed(raw, StatusReply, "status")
    if args.json:
        return _print_json(raw, "status")
    cache = reply.cache
    c = reply.counters
    print(f"root {reply.root} (mountd pid {reply.pid}), cached files served by "
          f"{'Python' if reply.data_path == 'python' else 'native code'} "
          f"(data path {reply.data_path})")
    print(f"cache: {human(cache.used_bytes)} of {human(cache.size_limit)} used, "
          f"{cache.items} items")
    m = reply.memory
    mine = (f"{human(m.uid_in_use)}" if m.per_uid_limit is None
            else f"{human(m.uid_in_use)} of {human(m.per_uid_limit)}")
    print(f"memory of registrations: uid {m.uid} {mine}, all users {human(m.in_use)} "
          f"of {human(m.total_limit)}")
    if reply.cluster is not None and reply.cluster.coordinators is not None:
        print(_coordinators(reply.cluster.coordinators, reply.cluster.coordinator_ok))
    if not cache.writable:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(cache.write_error_since))
        print(f"cache NOT WRITABLE since {since}: {cache.write_error}; reads are served "
              f"uncached ({cache.write_failures} items not stored); mountd tries again "
              "every few seconds")
    if cache.scrub_failures:
        print(f"cache scrub: {cache.scrub_failures} entries found changed on disk and "
              "dropped (each fetched again at its next read)")
    print(f"reads: {c.get(ReadCounter.LOCAL_HITS, 0)} local hits "
          f"({human(c.get(ReadCounter.LOCAL_BYTES, 0))}), "
          f"{c.get(ReadCounter.PAGE_CACHE_OPENS, 0)} from the page cache, "
          f"{c.get(ReadCounter.PEER_HITS, 0)} peer hits "
          f"({human(c.get(ReadCounter.PEER_BYTES, 0))}), "
          f"{c.get(ReadCounter.MISSES, 0)} misses, "
          f"{c.get(ReadCounter.BUCKET_FETCHES, 0)} bucket fetches "
          f"({human(c.get(ReadCounter.BUCKET_BYTES, 0))}), "
          f"{c.get(ReadCounter.INTEGRITY_FAILURES, 0)} integrity failures, "
          f"{c.get(ReadCounter.BUCKET_ERRORS, 0)} storage errors")
    causes = [f"{cause} {n.fetches} ({human(n.bytes)})"
              for cause, n in reply.bucket_fetch_causes.items() if n.fetches]
    if causes:
        print(f"bucket fetches by cause: {', '.join(causes)}")
    for ds in reply.datasets:
        line = (f"  {ds.name:<20} {ds.items:>9} items {human(ds.bytes):>10}  "
                f"hits {ds.counters.get(ReadCounter.LOCAL_HITS, 0)}  "
                f"misses {ds.counters.get(ReadCounter.MISSES, 0)}  {ds.source}")
        pf = ds.prefetch
        if pf is not None:
            state = "done" if pf.finished else "running"
            line += (f"  prefetch {state} {pf.done_items}/{pf.total_items}"
                     + (f" ({pf.failed} failed)" if pf.failed else ""))
        print(line)
    return ExitCode.OK


def _cluster_status(args: argparse.Namespace) -> int:
    raw = _call(args, {"op": "cluster"})
    reply = control_client.typed(raw, ClusterReply, "cluster")
    if args.json:
        return _print_json(raw, "cluster")
    state = "reachable" if reply.coordinator_ok else "UNREACHABLE"
    print(f"node {reply.node}, membership {reply.version}, coordinator {state}")
    if reply.coordinators is not None:
        print(_coordinators(reply.coordinators, reply.coordinator_ok))
    for n in reply.nodes:
        print(f"  {n.id:<16} {n.peer:<22} {'live' if n.live else 'down':<5} "
              f"owns {100 * n.share:.1f}% of keys")
    for identity, cycle in reply.cycles.items():
        states = " ".join("." if s is ChunkState.EVICTED else s.value[0].upper()
                          for s in cycle.states)
        print(f"  dataset {identity[:12]}: chunks [{states}] (L loading, A active, "
              f"M marked), up to {cycle.capacity} resident, most so far "
              f"{cycle.max_resident}")
    for job in reply.jobs:
        print(f"  job {job.job}: epoch {job.epoch}, batch {job.batches_planned}/"
              f"{job.batches_per_epoch}, hits {job.counters.get(SamplerJobCounter.HITS, 0)}, "
              f"fetched {job.counters.get(SamplerJobCounter.FETCHED, 0)}")
    return ExitCode.OK


def _coordinators(c: CoordinatorsStatus, ok: bool) -> str:
    """One line: the coordinator in use among --coordinator's, and the switches."""
    state = "reachable" if ok else "UNREACHABLE"
    used = f"{c.in_use} ({state})" if c.in_use is not None else "none answered yet"
    last = ("" if c.last_switch is None else ", the last at "
            + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.last_switch)))
    return (f"coordinator in use: {used}, of {', '.join(c.addresses)}; "
            f"switches {c.switches}{last}")


def _print_json(reply: dict, op: str) -> int:
    """Print a (checked) reply as JSON, all of it or, if JSON cannot hold it, nothing."""
    reply.pop("ok", None)
    try:
        text = json.dumps(reply, indent=2)
    except (TypeError, ValueError) as exc:  # bytes, or map keys JSON has no form for
        raise control_client.malformed(op, str(exc)) from None
    print(text)
    return ExitCode.OK
