"""The view files of ``ROOT/.quiver`` served by the native plane (mountd/native/view.c).

The process that serves that connection (mountd.fs.control_mount_process) hands mountd
its ``/dev/fuse`` descriptor once mounted, with a socket whose other end its session
reads requests from. The plane's threads then read the connection: they answer the
OPEN of a view file by a process of a job with a hit queued for it, and that open's
READ, GETATTR, FLUSH and RELEASE, and forward every other request to the process, which
asks mountd as before. Here: what the plane is told of the view jobs
(mountd.view.native_queue.ViewPlane), the connection's descriptors, and what it served,
drained to the view jobs with the read counters.
"""
from __future__ import annotations

import array
import logging
import os

import trio

from mountd.fetch.read_stats import ReadStats
from mountd.view.view_jobs import ViewJobs

log = logging.getLogger(__name__)


class NativeViews:
    """The native plane's side of the views, for one mountd."""

    def __init__(self, plane: object, views: ViewJobs, stats: ReadStats, threads: int) -> None:
        self.plane = plane  # mountd.native._dataplane.Plane, attached (NativePlane.plane)
        self.views = views
        self.threads = threads
        self.serving = False  # a connection's descriptors are the plane's
        views.serve_natively(self)
        stats.sources.append(self.drain)

    # -- the view jobs (ViewPlane) ----------------------------------------------------
    def job(self, job_id: int, base: int, uid: int) -> bool:
        try:
            self.plane.view_job(job_id, base, uid)
        except OSError as exc:  # not registered (yet): its opens go through Python
            log.debug("view job %d is not served natively: %s", job_id, exc)
            return False
        return True

    def forget(self, job_id: int) -> None:
        self.plane.view_forget(job_id)

    def pid(self, job_id: int, pid: int, pgid: int) -> bool:
        try:
            self.plane.view_pid(job_id, pid, pgid)
        except OSError:  # too many processes named: this one opens through Python
            return False
        return True

    def push(self, job_id: int, pool: int, items: list[int], number: int) -> bool:
        try:
            self.plane.view_push(job_id, pool, array.array("I", items), number)
        except OSError:  # the view went, or memory ran out: Python's opens take them
            return False
        return True

    def passed(self, job_id: int, pool: int, number: int) -> None:
        self.plane.view_pass(job_id, pool, number)

    def decline(self, job_id: int, pool: int) -> None:
        self.plane.view_decline(job_id, pool)

    def waiting(self, job_id: int, pool: int) -> int:
        return self.plane.view_waiting(job_id, pool)

    def take(self, job_id: int, pool: int) -> tuple[int, int] | None:
        return self.plane.view_take(job_id, pool)

    async def woken(self) -> None:
        fd = self.plane.view_wake_fd()
        if fd < 0:  # no eventfd: the read counters drain every 0.1 s
            await trio.sleep_forever()
        await trio.lowlevel.wait_readable(fd)
        try:
            os.read(fd, 8)
        except BlockingIOError:  # another reader took it
            pass

    # -- the connection ---------------------------------------------------------------
    def start(self, dev_fd: int, fwd_fd: int) -> bool:
        """Serve the connection on ``dev_fd``, forwarding to ``fwd_fd`` (both the
        plane's from now on, even where it cannot)."""
        try:
            self.plane.control_start(dev_fd, fwd_fd, self.threads)
        except OSError as exc:
            log.error("the native plane cannot serve ROOT/.quiver (%s)", exc)
            return False
        self.serving = True
        return True

    def stop(self) -> None:
        """The connection ended: its threads joined, its descriptors and open files
        closed. Blocking, briefly."""
        self.plane.control_stop()
        self.serving = False

    def opened(self, pid: int, inode: int) -> int | None:
        """The item ``pid``'s latest open of the view file at ``inode`` here serves."""
        return self.plane.view_opened(pid, inode)

    def python_opened(self, pid: int, inode: int, delta: int) -> bool:
        """mountd opened (1) or released (-1, or -2 for one not recorded) a view file
        for ``pid`` at ``inode``; whether recorded."""
        return self.plane.view_python_open(pid, inode, delta)

    def drain(self) -> None:
        """What the plane did with the jobs' queued items, to the view jobs."""
        events = self.plane.view_drain()
        if events and self.views.native is not None:
            self.views.native.drained(events)
