"""``quiver bench``: benchmarks that write a JSON report with a ``summary`` object."""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable

from quiverfs.errors import ExitCode, QuietError
from quiverfs.option_types import FloatAtLeast

# name -> ("module:function", help). Each function takes (quick: bool, workdir: str),
# plot: str | None if it draws a figure, latency_ms: float if its bucket can have a
# first-byte latency, model: str and device: str if it trains a model, data_path: str
# if it chooses mountd's data path, kill_coordinator: bool if it can kill its coordinator,
# and returns a dict holding at least "summary".
BENCHMARKS: dict[str, tuple[str, str]] = {
    "digest": ("quiverfs.bench.digest:run",
               "digest load time and memory at 1.3 M entries, hashing throughput"),
    "read": ("quiverfs.bench.read:run",
             "exact reads through the mount vs local files (warm) and the bucket (cold)"),
    "substitution": ("quiverfs.bench.substitution:run",
                     "substitutable vs exact reads, cache 10-20%"),
    "item-cost": ("quiverfs.bench.item_cost:run",
                  "ms and mountd CPU per cached item: exact reads, sampler, view"),
    "cluster": ("quiverfs.bench.cluster:run",
                "coordinated chunks on 3 nodes vs direct and LRU reads, cache 20%"),
    "allocation": ("quiverfs.bench.allocation:run",
                   "benefit-aware allocation vs LRU, 3 job types, 2 workloads, cache 15/30/60/90%"),
    "loader": ("quiverfs.bench.loader:run",
               "chunk-load objects/s with 1 and 2 loader processes; read latency meanwhile"),
    "compare": ("quiverfs.bench.compare:run",
                "Quiver vs direct reads and rclone, cache 10-100%"),
    "train": ("quiverfs.bench.train:run",
              "a torchvision model trained through the mount vs from local files"),
}
# options that only some benchmarks take: passed to those that do
OPTIONAL = ("plot", "model", "device", "data_path", "kill_coordinator")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and write JSON",
                       description="Run a benchmark side by side with its baseline and write "
                       "a JSON report whose 'summary' holds the headline numbers.")
    p.add_argument("name", choices=sorted(BENCHMARKS) + ["all"],
                   help="; ".join(f"{k}: {v[1]}" for k, v in sorted(BENCHMARKS.items()))
                   .replace("%", "%%"))  # argparse formats help with %
    p.add_argument("--json", metavar="OUT", required=True, help="where to write the report")
    p.add_argument("--quick", action="store_true", help="a small version that runs in about "
                   "a minute")
    p.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    p.add_argument("--plot", metavar="OUT.png", help="draw the benchmark's figure into this "
                   "PNG (cluster: the timeline of resident chunks)")
    p.add_argument("--latency-ms", type=FloatAtLeast("--latency-ms", 0), metavar="MS",
                   help="delay the first byte of every response from the benchmark's "
                   "bucket by MS milliseconds, as a cloud bucket's time to first byte "
                   "(compare, read: default 0; loader: default 30)")
    p.add_argument("--model", metavar="NAME", help="train: the torchvision.models "
                   "classifier to train (default: resnet50; --quick: resnet18)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="train: where the model "
                   "trains (default: cuda if torch sees one, else cpu)")
    p.add_argument("--data-path", choices=("native", "passthrough", "python"), help="read: the data path "
                   "that the mountds it starts serve cached files through, passed to them "
                   "as --data-path (default: mountd's own)")
    p.add_argument("--kill-coordinator", action="store_true", default=None,
                   help="cluster: run its jobs on two coordinators sharing an etcd it "
                   "starts, SIGKILL the leader in the middle of an epoch, and report the "
                   "failover (needs etcd)")
    p.set_defaults(func=cmd_bench)


def machine() -> dict:
    """What the numbers were measured on."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gb": round(mem / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version()}


def _function(name: str) -> Callable[..., dict]:
    module, func = BENCHMARKS[name][0].split(":")
    return importlib.import_module(module).__dict__[func]


def takes(name: str, option: str) -> bool:
    """Whether benchmark ``name``'s function has the parameter ``option``."""
    return option in inspect.signature(_function(name)).parameters


def run_one(name: str, quick: bool, workdir: str | None,
            options: dict[str, object] | None = None) -> dict:
    """Run benchmark ``name``, passing it those of ``options`` (latency_ms and OPTIONAL,
    the ones given) that it takes."""
    fn = _function(name)
    extra = {k: v for k, v in (options or {}).items() if takes(name, k)}
    with tempfile.TemporaryDirectory(prefix=f"quiver-bench-{name}-", dir=workdir) as tmp:
        started = time.time()
        report = fn(quick=quick, workdir=tmp, **extra)
    report.update({"benchmark": name, "quick": quick, "machine": machine(),
                   "seconds": round(time.time() - started, 1),
                   "command": "quiver " + " ".join(sys.argv[1:])})
    return report


def cmd_bench(args: argparse.Namespace) -> int:
    if args.workdir and not os.path.isdir(args.workdir):
        raise QuietError(f"--workdir {args.workdir} is not a directory", ExitCode.NOT_FOUND)
    names = sorted(BENCHMARKS) if args.name == "all" else [args.name]
    options = {k: getattr(args, k) for k in ("latency_ms", *OPTIONAL)
               if getattr(args, k) is not None}
    for option in OPTIONAL:
        if option in options and not any(takes(n, option) for n in names):
            flag = "--" + option.replace("_", "-")
            raise QuietError(f"{flag}: the {args.name} benchmark takes no {flag} "
                             f"(these do: "
                             f"{', '.join(n for n in sorted(BENCHMARKS) if takes(n, option))})",
                             ExitCode.USAGE)
    if args.latency_ms is not None and not all(takes(n, "latency_ms") for n in names):
        raise QuietError(f"--latency-ms: only these benchmarks have a bucket latency: "
                         f"{', '.join(n for n in sorted(BENCHMARKS) if takes(n, 'latency_ms'))}",
                         ExitCode.USAGE)
    reports = {n: run_one(n, args.quick, args.workdir, options) for n in names}
    out = reports[names[0]] if len(names) == 1 else {"summary": {
        n: r["summary"] for n, r in reports.items()}, "reports": reports}
    tmp = args.json + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
    os.replace(tmp, args.json)
    print(json.dumps(out["summary"], indent=2))
    return ExitCode.OK
