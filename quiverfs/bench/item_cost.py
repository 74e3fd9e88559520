"""``quiver bench item-cost``: what one item costs when every item is cached, read each
of the three ways ``make demo`` reads: exact reads, ``QuiverBatchSampler``, the
substitutable view.

The scikit-learn digits (``write_digits_tree``) are digested and mounted from a local
directory, exactly and as a view (``--view substitutable``), on one mountd whose cache
holds them all several times over; every item is read once beforehand, so every read
after is a hit and what an epoch takes is Quiver's own cost per item, with torchvision's
``ImageFolder`` and a ``DataLoader`` with worker processes, as the demo trains:

- ``exact``: ``DataLoader(shuffle=True)`` over the exact mount;
- ``sampler``: ``QuiverBatchSampler`` over the exact mount (allotted ``full``);
- ``view``: ``DataLoader(shuffle=True)`` over the view.

No model is trained: the loop only takes the batches. Each file's pages are dropped
after its read (``compare.load_image``), so the kernel's page cache does not stand in for
the cache. Per way, after a warm-up epoch: the wall milliseconds per item, mountd's CPU
milliseconds per item (mountd and every process under it, the control connection's
child among them), and the FUSE requests per item that reached mountd's Python (by
opcode; the native plane's own answers are counted apart).
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import time
from typing import Any

from digest_tools.create import create_digest
from quiverfs.bench.data import write_digits_tree
from quiverfs.bench.processes import MountdProcess, running_mountd
from quiverfs.bench.reading_job import READERS, MountSource

DATASET = "digits"
VIEW = "digits-view"
BATCH_SIZE = 64
WORKERS = 2  # DataLoader worker processes, as make demo
WAYS = ("exact", "sampler", "view")
MODE_TIMEOUT = 60.0  # seconds the coordinator may take to allot the dataset full
EPOCHS = {"full": 6, "quick": 3}  # per way; the first is the warm-up


def _cpu_ticks(root_pid: int) -> tuple[int, int]:
    """User and system clock ticks of ``root_pid``, and of every live process under it
    (the ``.quiver`` connection's child, the loader processes)."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        stats[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    under = {root_pid}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in stats.items():
            if ppid in under and pid not in under:
                under.add(pid)
                grew = True
    own = stats[root_pid][1] if root_pid in stats else 0
    return own, sum(stats[pid][1] for pid in under if pid in stats) - own


def _loader(root: str, way: str, seed: int) -> tuple[Any, Any]:
    """The DataLoader of ``way`` over the mount at ``root``, and its sampler (or None)."""
    import torch
    import torchvision

    from quiverfs.bench.compare import load_image
    from quiverfs.torch import QuiverBatchSampler

    tf = torchvision.transforms.Compose([torchvision.transforms.Grayscale(),
                                         torchvision.transforms.ToTensor()])
    data = torchvision.datasets.ImageFolder(
        os.path.join(root, VIEW if way == "view" else DATASET), transform=tf,
        loader=load_image)
    if way == "sampler":
        sampler = QuiverBatchSampler(data.root, BATCH_SIZE, seed=seed, dataset=data)
        return torch.utils.data.DataLoader(data, batch_sampler=sampler,
                                           num_workers=WORKERS), sampler
    return torch.utils.data.DataLoader(
        data, batch_size=BATCH_SIZE, shuffle=True, num_workers=WORKERS,
        generator=torch.Generator().manual_seed(seed)), None


def _requests(m: MountdProcess) -> collections.Counter[str]:
    """The FUSE requests that reached mountd's Python, by opcode, and the view files
    the native plane opened itself (``native.view_opens``)."""
    status = m.status()
    requests = collections.Counter(status["fuse_requests"])
    requests["native.view_opens"] = (status.get("native") or {}).get("view_opens", 0)
    return requests


def measure_way(m: MountdProcess, way: str, epochs: int) -> dict[str, Any]:
    """Run ``epochs`` epochs of ``way``; its costs per item over all but the first."""
    loader, sampler = _loader(m.root, way, seed=0)
    if m.proc is None:
        raise RuntimeError("mountd is not running")
    tick = os.sysconf("SC_CLK_TCK")
    seconds = items = 0.0
    cpu = [0.0, 0.0]  # mountd's own, the processes under it
    requests: collections.Counter[str] = collections.Counter()
    try:
        for epoch in range(epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            before_requests, before_cpu = _requests(m), _cpu_ticks(m.proc.pid)
            start = time.monotonic()
            n = sum(len(y) for _, y in loader)
            took = time.monotonic() - start
            if epoch == 0:
                if sampler is not None:  # the job told the coordinator: it allots full
                    m.wait_for_mode("full", MODE_TIMEOUT)
                continue
            seconds += took
            items += n
            cpu = [c + (a - b) / tick
                   for c, a, b in zip(cpu, _cpu_ticks(m.proc.pid), before_cpu)]
            requests += _requests(m) - before_requests
    finally:
        if sampler is not None:
            sampler.close()
    return {"items": int(items), "seconds": round(seconds, 3),
            "wall_ms_per_item": round(1000 * seconds / items, 3),
            "mountd_cpu_ms_per_item": round(1000 * sum(cpu) / items, 3),
            "mountd_children_cpu_ms_per_item": round(1000 * cpu[1] / items, 3),
            "requests_per_item": {op: round(k / items, 3) for op, k in sorted(requests.items())}}


def run(quick: bool, workdir: str) -> dict[str, Any]:
    """The benchmark (``quick``: fewer epochs)."""
    tree = write_digits_tree(os.path.join(workdir, "digits"))
    digest = create_digest(tree.root, DATASET, workers=2)
    epochs = EPOCHS["quick" if quick else "full"]
    ways: dict[str, Any] = {}
    with running_mountd(workdir, cache_size="1G", name="item-cost",
                        extra_args=("--probe-batches", "0")) as m:
        m.call({"op": "mount", "name": DATASET, "digest": digest, "emulator_host": None})
        m.call({"op": "mount", "name": VIEW, "digest": digest, "emulator_host": None,
                "view": "substitutable"})
        source = MountSource(os.path.join(m.root, DATASET))
        with concurrent.futures.ThreadPoolExecutor(READERS) as pool:
            sum(pool.map(source.read, source.paths()))  # every item in the store
        for way in WAYS:
            ways[way] = measure_way(m, way, epochs)
        data_path = m.status().get("data_path")
    exact = ways["exact"]
    summary: dict[str, Any] = {"items": tree.files, "data_path": data_path}
    for way, got in ways.items():
        summary[f"wall_ms_per_item_{way}"] = got["wall_ms_per_item"]
        summary[f"mountd_cpu_ms_per_item_{way}"] = got["mountd_cpu_ms_per_item"]
        if way != "exact":
            summary[f"{way}_vs_exact"] = round(
                exact["wall_ms_per_item"] / got["wall_ms_per_item"], 3)
    return {"settings": {"epochs": epochs, "batch_size": BATCH_SIZE, "workers": WORKERS},
            "ways": ways, "summary": summary,
            "definitions": {
                "wall_ms_per_item": "wall ms of the epochs after the first / items",
                "mountd_cpu_ms_per_item": "user + system CPU ms of mountd and every "
                                          "process under it over those epochs / items",
                "mountd_children_cpu_ms_per_item": "the part of it of the processes under "
                                                   "mountd (the .quiver connection's child "
                                                   "answers the view's requests)",
                "requests_per_item": "FUSE requests that reached mountd's Python handlers "
                                     "over those epochs / items, by opcode ('control.': "
                                     "the .quiver connection's, where the view is); "
                                     "'native.view_opens': view files the native plane "
                                     "opened itself",
                "*_vs_exact": "items/s of the way / exact reads'"}}
