"""An event-driven block scheduler for the numba-cuda simulator (numba-stack.md §2, "Mechanics").

numba-cuda 0.30.x (``numba/cuda/simulator/kernel.py``, ``BlockManager.run``) starts one Python
thread per CUDA thread of a block, then *busy-polls* them: a loop over the live threads that
reads ``syncthreads_blocked`` and calls ``is_alive()`` until every thread has finished, releasing
a ``syncthreads()`` once every live thread is blocked in it. That loop holds the GIL whenever it
gets it, so it competes with the simulated threads for the one interpreter, and does so most
when few of them are runnable (a block's tail, one warp's shuffles): a tiny ``generate`` run
spent 38 of its 68 s in ``is_alive`` (cProfile).

:func:`install` replaces ``BlockManager.run`` with the same semantics, driven by a condition
variable instead: a thread that blocks in ``syncthreads()`` or finishes says so under the
block's lock, and the manager sleeps until the count of blocked plus finished threads is the
block's size, then releases the barrier (or returns, or re-raises the first failure after
aborting the other threads, as the original does). The simulated threads, their barrier
events and their ``abort`` flags are numba-cuda's own; nothing a kernel sees changes.

The threads are pooled: numba-cuda starts (and ends) a Python thread for every CUDA thread of
every block, ~0.24 ms of thread start-up and teardown each here (an empty kernel of 100 blocks of
256 threads took 6.7 s; pooled, 1.4 s). :func:`install` keeps idle workers (``BlockThread``
subclasses started once, as many as the largest block so far) and hands each block's thread its
indices, manager and target instead: the thread ids, barrier events, ``abort`` flags and error
messages are those a new ``BlockThread`` would have. When a block fails, its workers that have
finished go back to the pool and those still unwinding end once they have, as numba-cuda's
threads do. Unlike ``BlockThread``, a worker reports any ``BaseException`` a kernel raises (a
``SystemExit`` or ``pytest.skip`` in a simulated kernel reaches the host rather than vanishing).
"""
from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

__all__ = ["SWITCH_INTERVAL_S", "install", "thread_local"]

# The interpreter's switch interval for simulated runs (sys.setswitchinterval; tests/conftest.py
# and ``generate`` set it): the threads block at barriers, so switch seldom; each forced switch
# among a block's runnable threads is a futex wake-up. numba-stack.md §2 (gotcha 11)'s 1 ms suited
# numba-cuda's busy-polling manager. With this scheduler 50 ms took the tree-attention and
# fused-posterior tests from 91 to 65 s under -n 2 on 2 cores (sys time 61 -> 42 s), and a block
# barrier of 256 threads from 18.0 to ~12 ms (20 ms and 200 ms: the same within noise).
SWITCH_INTERVAL_S = 0.05

kernel_dim3: Any = None   # numba-cuda's Dim3 (install() sets it: the simulator imported only then)
_host_locals = threading.local()   # thread_local() outside a pooled worker


def thread_local() -> dict:
    """The calling simulated thread's own state: a dict that is fresh for each CUDA thread of each
    block, as a new Python thread's ``threading.local`` was before the threads were pooled (a
    worker's ``threading.local`` outlives its block). Outside a simulated kernel: this host
    thread's."""
    state = getattr(threading.current_thread(), "sim_locals", None)
    if state is None:
        state = _host_locals.__dict__
    return state


class _Progress:
    """What one running block's threads report to its manager (under ``cond``)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.blocked: list[Any] = []   # threads waiting in syncthreads(), in arrival order
        self.finished = 0
        self.total = 0                 # the block's threads (set before any starts)
        self.failed: Any = None        # the first thread that ended with an exception
        self.done: list[Any] = []      # workers whose job has ended (idle, in report order)
        self.abandoned = False         # the block failed and the manager returned: workers end

    def managers_turn(self) -> bool:
        """Whether every unfinished thread waits in syncthreads() (a barrier to release, or the
        block's end) or one has failed: the reports that wake the manager (under ``cond``)."""
        return self.failed is not None or len(self.blocked) + self.finished == self.total


def _syncthreads(self: Any) -> None:
    """BlockThread.syncthreads: numba-cuda's, with the arrival reported to the manager."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    progress = self._manager._progress
    with progress.cond:
        self.syncthreads_blocked = True
        progress.blocked.append(self)
        if progress.managers_turn():
            progress.cond.notify()
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _make_worker_class(block_thread: type) -> type:
    class _Worker(block_thread):  # type: ignore[misc, valid-type]
        """A pooled ``BlockThread``: started once, then runs one CUDA thread of a block at a time
        (:meth:`assign`), reporting each end to that block's manager."""

        def __init__(self) -> None:
            threading.Thread.__init__(self, daemon=True)   # BlockThread's state comes with assign()
            self._wake = threading.Lock()   # held while idle; released to start a job
            self._wake.acquire()
            self._job: Any = None
            self.syncthreads_event = threading.Event()
            self.syncthreads_blocked = False
            self._manager = None
            self.exception = None
            self.abort = False
            self.debug = False
            self.sim_locals: dict = {}

        def assign(self, manager: Any, target: Any, grid_point: tuple, block_point: tuple,
                   thread_id: int) -> None:
            """Run ``target`` as thread ``block_point`` of block ``grid_point`` (what
            BlockThread.__init__ sets, then the wake-up)."""
            self._manager = manager
            self.blockIdx = kernel_dim3(*grid_point)
            self.threadIdx = kernel_dim3(*block_point)
            self.thread_id = thread_id
            self.exception = None
            self.abort = False
            self.debug = manager._debug
            self.syncthreads_blocked = False
            self.syncthreads_event.clear()
            self.sim_locals = {}   # thread_local(): nothing carried over from the last block
            self._job = target
            self._wake.release()

        def run(self) -> None:
            while True:
                self._wake.acquire()
                target, self._job = self._job, None
                progress = self._manager._progress
                try:
                    if self.debug:   # as BlockThread's debug wrapper
                        with np.errstate(divide="raise"):
                            target()
                    else:
                        target()
                except BaseException as e:   # (BlockThread catches Exception: a kernel's SystemExit or
                    self.exception = (_located(e, self), sys.exc_info()[2])   # pytest.skip reaches the host)
                finally:
                    target = None   # the launch's arguments are not kept alive by an idle worker
                    with progress.cond:   # always reported: a lost report would hang the manager
                        progress.finished += 1
                        if self.exception and progress.failed is None:
                            progress.failed = self
                        if progress.managers_turn():
                            progress.cond.notify()
                        retire = progress.abandoned   # the block failed and its manager has gone
                        if not retire:
                            progress.done.append(self)
                if retire:   # still unwinding when the block failed: end, as a BlockThread would
                    _clear(self)
                    return
                progress = None

    return _Worker


def _located(e: BaseException, thread: Any) -> BaseException:
    """``e`` again with BlockThread.run's message, ``tid=[..] ctaid=[..]: msg`` (a RuntimeError from
    ``e`` where its type takes no one-string constructor, e.g. UnicodeDecodeError)."""
    tid = "tid=%s" % list(thread.threadIdx)
    ctaid = "ctaid=%s" % list(thread.blockIdx)
    msg = "%s %s" % (tid, ctaid) if str(e) == "" else "%s %s: %s" % (tid, ctaid, e)
    try:
        return type(e)(msg)
    except Exception:
        located = RuntimeError(f"{type(e).__name__}: {msg}")
        located.__cause__ = e
        return located


def _clear(worker: Any) -> None:
    """Drop what a finished job left on ``worker``: its block, error (a traceback holds the
    kernel's arguments) and thread_local() state."""
    worker._manager = None
    worker.exception = None
    worker.sim_locals = {}


class _Pool:
    """Idle workers, handed out to one block at a time (a lock: host threads may launch)."""

    def __init__(self, worker_class: type) -> None:
        self.worker_class = worker_class
        self.idle: list[Any] = []
        self.lock = threading.Lock()

    def take(self, n: int) -> list[Any]:
        with self.lock:
            first = max(0, len(self.idle) - n)
            taken = self.idle[first:]
            del self.idle[first:]
        while len(taken) < n:
            worker = self.worker_class()
            worker.start()
            taken.append(worker)
        return taken

    def give_back(self, workers: list[Any]) -> None:
        """Return idle workers (each has reported its job's end) to the pool."""
        for worker in workers:
            _clear(worker)   # no block, error or thread_local() kept alive by an idle worker
        with self.lock:
            self.idle.extend(workers)


def _make_manager_run(pool: _Pool) -> Any:
    def run(self: Any, grid_point: tuple, *args: Any) -> None:
        """BlockManager.run: give every thread of the block to a pooled worker, release each
        syncthreads() once all unfinished threads wait in it, return when all have finished; on a
        thread's failure abort the others (their next barrier raises) and re-raise it without
        joining them (the finished ones' workers go back to the pool, the others end once
        unwound)."""
        progress = self._progress = _Progress()

        def target() -> None:
            self._f(*args)

        points = list(np.ndindex(*self._block_dim))   # (x, y, z): numba-cuda normalises to 3 dims
        bx, by, _ = self._block_dim
        threads = pool.take(len(points))
        progress.total = len(threads)
        with progress.cond:   # held while assigning: no report is lost before the first wait
            for thread, (x, y, z) in zip(threads, points):
                thread.assign(self, target, grid_point, (x, y, z), x + bx * (y + by * z))
            while True:
                if progress.failed is not None:
                    for other in threads:
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    error, trace = progress.failed.exception
                    progress.abandoned = True   # threads still running end when they finish
                    pool.give_back(progress.done)   # those that have finished are idle: reusable
                    raise error.with_traceback(trace)
                if progress.finished == progress.total:
                    break
                if progress.blocked and progress.managers_turn():
                    for thread in progress.blocked:
                        thread.syncthreads_blocked = False
                        thread.syncthreads_event.set()
                    progress.blocked = []
                    continue
                progress.cond.wait()
        pool.give_back(threads)
    return run


_installed = False


def install() -> None:
    """Install the scheduler into the simulator's ``BlockThread`` / ``BlockManager`` (idempotent;
    simulator only)."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernel

    global kernel_dim3
    kernel_dim3 = kernel.Dim3
    kernel.BlockThread.syncthreads = _syncthreads
    kernel.BlockManager.run = _make_manager_run(_Pool(_make_worker_class(kernel.BlockThread)))
    _installed = True
