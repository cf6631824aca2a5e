"""sim/scheduler.py: the event-driven block scheduler keeps the simulator's barrier semantics.

Barriers release only when every unfinished thread of the block waits in them (threads that
returned early do not hold a barrier, as in numba-cuda's polling loop), ``syncthreads_count``
and friends still count, several blocks and launches never share state, and a failing thread
raises its own error at once, with the block's other threads aborted rather than left waiting.
The threads are pooled: a worker runs one block's thread after another with that thread's own
indices and a fresh thread_local(), and keeps no launch's arguments alive.
"""
import gc
import threading
import time
import weakref

import numpy as np
import pytest
from numba import cuda, int32

SIMULATED = bool(cuda.config.ENABLE_CUDASIM)
pytestmark = pytest.mark.skipif(not SIMULATED, reason="simulator scheduler (a GPU schedules its own blocks)")
ROUNDS = 5


@cuda.jit
def _ring_rounds(out):
    """Each round, thread t adds its left neighbour's value from the last round: ROUNDS barrier
    pairs, so any early release reads a value of the wrong round."""
    buf = cuda.shared.array(128, int32)
    t = cuda.threadIdx.x
    n = cuda.blockDim.x
    value = t + 100 * cuda.blockIdx.x
    for _ in range(ROUNDS):
        buf[t] = value
        cuda.syncthreads()  # every thread's value of this round written
        value = value + buf[(t + n - 1) % n]
        cuda.syncthreads()  # every read done before the next round's writes
    out[cuda.blockIdx.x, t] = value


def _ring_reference(blocks, threads):
    out = np.zeros((blocks, threads), np.int64)
    for b in range(blocks):
        value = np.arange(threads) + 100 * b
        for _ in range(ROUNDS):
            value = value + np.roll(value, 1)
        out[b] = value
    return out


@pytest.mark.parametrize("blocks, threads", [(1, 1), (3, 33), (2, 128)])
def test_barriers_release_rounds_in_order(blocks, threads):
    out = np.zeros((blocks, threads), np.int32)
    _ring_rounds[blocks, threads](out)
    np.testing.assert_array_equal(out, _ring_reference(blocks, threads).astype(np.int32))


@cuda.jit
def _early_exit_then_barrier(out):
    """The upper half returns before the barrier: the lower half's barrier still releases."""
    buf = cuda.shared.array(64, int32)
    t = cuda.threadIdx.x
    half = cuda.blockDim.x // 2
    if t >= half:
        return
    buf[t] = t
    cuda.syncthreads()  # the lower half's writes
    out[t] = buf[half - 1 - t]


def test_threads_that_returned_do_not_hold_a_barrier():
    out = np.full(32, -1, np.int32)
    _early_exit_then_barrier[1, 64](out)
    np.testing.assert_array_equal(out, np.arange(31, -1, -1, dtype=np.int32))


@cuda.jit
def _counts(out):
    t = cuda.threadIdx.x
    out[0, t] = cuda.syncthreads_count(t % 3 == 0)
    out[1, t] = cuda.syncthreads_and(t < 1000)
    out[2, t] = cuda.syncthreads_or(t == 5)


def test_syncthreads_count_and_or():
    out = np.zeros((3, 40), np.int32)
    _counts[1, 40](out)
    assert (out[0] == 14).all() and (out[1] == 1).all() and (out[2] == 1).all()


@cuda.jit
def _fails_after_a_barrier(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()  # every thread here once
    if t == 7:
        out[10 ** 6] = 1   # out of bounds: an IndexError in thread 7 only
    cuda.syncthreads()  # the others wait here: they must be aborted, not left waiting
    out[t] = 1


def test_a_failing_thread_raises_and_the_block_does_not_hang():
    out = np.zeros(32, np.int32)
    with pytest.raises(IndexError, match=r"tid=\[7, 0, 0\]"):
        _fails_after_a_barrier[1, 32](out)
    out = np.zeros((2, 32), np.int32)   # usable afterwards, with a block as large as the failed one
    _ring_rounds[2, 32](out)
    np.testing.assert_array_equal(out, _ring_reference(2, 32).astype(np.int32))


def test_the_scheduler_is_installed():
    from numba.cuda.simulator import kernel

    assert kernel.BlockManager.run.__module__ == "sim.scheduler"
    assert kernel.BlockThread.syncthreads.__module__ == "sim.scheduler"


@cuda.jit
def _indices(out):
    """Each thread writes its indices and lane where its linear (block, thread) id says."""
    t = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
    b = cuda.blockIdx.x + cuda.gridDim.x * cuda.blockIdx.y
    row = b * cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z + t
    out[row, 0] = cuda.threadIdx.x
    out[row, 1] = cuda.threadIdx.y
    out[row, 2] = cuda.threadIdx.z
    out[row, 3] = cuda.blockIdx.x
    out[row, 4] = cuda.blockIdx.y
    out[row, 5] = cuda.laneid


@pytest.mark.parametrize("grid, block", [((2, 3), (5, 3, 2)), ((4, 1), (40, 1, 1)), ((1, 2), (1, 1, 1))])
def test_pooled_threads_take_each_blocks_indices(grid, block):
    """Several launches of different shapes on the same pool: every thread its own indices."""
    bx, by, bz = block
    out = np.full((grid[0] * grid[1] * bx * by * bz, 6), -1, np.int32)
    _indices[grid, block](out)
    want = []
    for gy in range(grid[1]):
        for gx in range(grid[0]):
            for z in range(bz):
                for y in range(by):
                    for x in range(bx):
                        t = x + bx * (y + by * z)
                        want.append((x, y, z, gx, gy, t % 32))
    np.testing.assert_array_equal(out, np.array(want, np.int32))


@cuda.jit
def _noop(out):
    out[cuda.blockIdx.x] = 1


@cuda.jit
def _thread_idents(out):
    out[cuda.blockIdx.x, cuda.threadIdx.x] = threading.get_ident()   # simulator-only: plain Python


def test_workers_are_reused_across_blocks_and_launches():
    """30 blocks of 64 threads, twice, run on 64 threads in all (numba-cuda's own simulator
    started 1920 a launch), a block's threads all different."""
    idents = np.zeros((2, 30, 64), np.int64)
    _thread_idents[30, 64](idents[0])
    _thread_idents[30, 64](idents[1])
    assert all(len(set(block)) == 64 for block in idents.reshape(60, 64).tolist())
    assert len(np.unique(idents)) == 64


def test_a_failed_blocks_workers_end_or_return_to_the_pool():
    """Launches that fail leave no thread behind for good: the unwound workers end, the finished
    ones are reused (three failing 1024-thread blocks, then the thread count settles within one
    block of where it was)."""
    out = np.zeros(1024, np.int32)
    _ring_rounds[1, 128](np.zeros((1, 128), np.int32))
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(IndexError, match=r"tid=\[7, 0, 0\]"):
            _fails_after_a_barrier[1, 1024](out)
    deadline = time.monotonic() + 30.0
    while threading.active_count() > before + 1024 and time.monotonic() < deadline:
        time.sleep(0.05)   # the aborted threads unwinding (host-side wait)
    assert threading.active_count() <= before + 1024


@cuda.jit
def _raises_without_a_message_constructor(out):
    if cuda.threadIdx.x == 3:
        b"\xff".decode("utf-8")   # UnicodeDecodeError takes five arguments: type(e)(msg) fails
    cuda.syncthreads()  # the others wait here: aborted
    out[cuda.threadIdx.x] = 1


def test_an_error_whose_type_takes_no_message_still_ends_the_launch():
    """The thread's error is re-raised as a RuntimeError naming it and the thread (caused by it),
    not lost with the launch left waiting."""
    with pytest.raises(RuntimeError, match=r"UnicodeDecodeError: tid=\[3, 0, 0\]") as info:
        _raises_without_a_message_constructor[1, 32](np.zeros(32, np.int32))
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


@cuda.jit
def _reads_thread_local(out):
    from sim.scheduler import thread_local   # a simulator-only test kernel: plain Python

    state = thread_local()
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    out[row] = len(state)
    state["seen"] = row


def test_thread_local_is_fresh_for_each_block_thread():
    """What a thread left in thread_local() is gone for the next block its worker runs."""
    out = np.full(6 * 16, -1, np.int32)
    _reads_thread_local[6, 16](out)
    assert (out == 0).all()


def test_a_launch_keeps_no_argument_alive():
    """Idle workers drop their last job: an array launched on is freed once the caller drops it."""
    a = cuda.to_device(np.zeros(64, np.int32))   # the simulator's device array: its host buffer
    ref = weakref.ref(a._ary)                    # is what a kernel's arguments hold
    _noop[8, 32](a)
    del a
    gc.collect()
    assert ref() is None
