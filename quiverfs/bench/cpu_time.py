"""CPU seconds: of another process, of this one, and of everything else on the machine."""
from __future__ import annotations

import os
import time
from collections import Counter


def _stat_cpu_seconds(path: str) -> float:
    """User + system CPU seconds in a /proc ``stat`` file (a process's or a thread's)."""
    with open(path, encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def thread_cpu_seconds(pid: int) -> Counter[str]:
    """User + system CPU seconds of a live process's threads, summed by thread name
    (mountd's data plane threads are ``quiver-plane``; Python's are ``python`` or
    what ``threading`` named them). Threads that end meanwhile are left out."""
    out: Counter[str] = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8") as f:
                name = f.read().strip()
            out[name] += _stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
    return out


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (not idle or waiting for I/O)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class BackgroundCpu:
    """CPU time that other processes used during a measurement, from /proc/stat."""

    cores = 0.0  # after the block: the average number of CPUs others kept busy

    def __enter__(self) -> BackgroundCpu:
        self.started = time.perf_counter()
        self.busy0, self.own0 = machine_busy_seconds(), own_cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.started
        others = (machine_busy_seconds() - self.busy0) - (own_cpu_seconds() - self.own0)
        self.cores = max(0.0, others / wall)
