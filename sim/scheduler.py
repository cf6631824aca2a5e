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
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["install"]


class _Progress:
    """What one running block's threads report to its manager (under ``cond``)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.blocked: list[Any] = []   # threads waiting in syncthreads(), in arrival order
        self.finished = 0
        self.failed: Any = None        # the first thread that ended with an exception


def _syncthreads(self: Any) -> None:
    """BlockThread.syncthreads: numba-cuda's, with the arrival reported to the manager."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    progress = self._manager._progress
    with progress.cond:
        self.syncthreads_blocked = True
        progress.blocked.append(self)
        progress.cond.notify()
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _make_thread_run(original_run: Any) -> Any:
    def run(self: Any) -> None:
        """BlockThread.run: numba-cuda's (it stores any exception), then the exit reported."""
        try:
            original_run(self)
        finally:
            progress = self._manager._progress
            with progress.cond:
                progress.finished += 1
                if self.exception and progress.failed is None:
                    progress.failed = self
                progress.cond.notify()
    return run


def _make_manager_run(block_thread: type) -> Any:
    def run(self: Any, grid_point: tuple, *args: Any) -> None:
        """BlockManager.run: start every thread of the block, release each syncthreads() once
        all unfinished threads wait in it, return when all have finished; on a thread's failure
        abort the others (their next barrier raises) and re-raise it without joining them."""
        progress = self._progress = _Progress()
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            def target() -> None:
                self._f(*args)
            thread = block_thread(target, self, grid_point, block_point, self._debug)
            threads.append(thread)
        with progress.cond:   # held while starting: no report is lost before the first wait
            for thread in threads:
                thread.start()
            total = len(threads)
            while True:
                if progress.failed is not None:
                    for other in threads:
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    failed = progress.failed
                    raise failed.exception[0].with_traceback(failed.exception[1])
                if progress.finished == total:
                    return
                if progress.blocked and len(progress.blocked) + progress.finished == total:
                    for thread in progress.blocked:
                        thread.syncthreads_blocked = False
                        thread.syncthreads_event.set()
                    progress.blocked = []
                    continue
                progress.cond.wait()
    return run


_installed = False


def install() -> None:
    """Install the scheduler into the simulator's ``BlockThread`` / ``BlockManager`` (idempotent;
    simulator only)."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernel

    kernel.BlockThread.syncthreads = _syncthreads
    kernel.BlockThread.run = _make_thread_run(kernel.BlockThread.run)
    kernel.BlockManager.run = _make_manager_run(kernel.BlockThread)
    _installed = True
