"""A benchmark's job, on the parent's side: a child process spoken to in lines on its
stdin, answering in JSON lines on its stdout, its stderr in a log file whose tail every
error names."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any


class JobChild:
    """One job process (``argv``), called ``name`` in errors; ``env``: variables added to
    the parent's environment for it (such as ``QUIVER_JOB``, which mountd's views read
    from the reading process's environment, so it must be there when the process starts)."""

    def __init__(self, name: str, argv: list[str], log_path: str,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "ab") as log_file:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log_file, bufsize=0,
                                         env={**os.environ, **env} if env else None)
        self._buffer = b""

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next JSON line, or an error naming the job's last log lines."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError(f"job {self.name} sent nothing for {timeout:.0f} s: "
                                       f"{self.log_tail()}")
                data = os.read(fd, 1 << 20)
                if not data:
                    raise RuntimeError(f"job {self.name} exited ({self.proc.wait()}): "
                                       f"{self.log_tail()}")
                self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def log_tail(self, n: int = 15) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:]) or "(no output)"

    def finish(self, timeout: float) -> None:
        """Tell the job to exit (the line ``exit``, then end of input); it must exit 0."""
        self.send("exit")
        self.proc.stdin.close()
        rc = self.proc.wait(timeout)
        if rc != 0:
            raise RuntimeError(f"job {self.name} exited {rc}: {self.log_tail()}")

    def stop(self, timeout: float) -> int:
        """Close its stdin and wait for it (killed after ``timeout``); its status."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc.stdout.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


class JobProcess(JobChild):
    """A job child running ``python -m MODULE SPEC`` (``spec`` a dataclass, as JSON)."""

    def __init__(self, name: str, module: str, spec: Any, log_path: str,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(name, [sys.executable, "-m", module,
                                json.dumps(dataclasses.asdict(spec))], log_path, env)
        self.spec = spec
        self.job_id: str | None = None  # mountd's, for a job with a sampler


@contextlib.contextmanager
def running_jobs(module: str, specs: dict[str, Any], log_dir: str, start_timeout: float,
                 envs: dict[str, dict[str, str]] | None = None) -> Iterator[list[JobProcess]]:
    """Started job processes (name -> spec; ``envs``: name -> added environment), all
    ready, each logging to ``log_dir/job-NAME.log``; killed on exit if they have not
    finished."""
    jobs: list[JobProcess] = []
    try:
        for name, spec in specs.items():
            jobs.append(JobProcess(name, module, spec, os.path.join(log_dir, f"job-{name}.log"),
                                   (envs or {}).get(name)))
        for job in jobs:
            job.job_id = job.receive(start_timeout).get("job")
        yield jobs
    finally:
        for job in jobs:
            job.kill()


def run_epoch(jobs: Sequence[JobChild], timeout: float, command: str = "go"
              ) -> tuple[list[dict[str, Any]], float]:
    """Start an epoch on every job at once (``command``); their replies and the wall
    seconds until the last one answered."""
    start = time.monotonic()
    for job in jobs:
        job.send(command)
    replies = [job.receive(timeout) for job in jobs]
    return replies, time.monotonic() - start
