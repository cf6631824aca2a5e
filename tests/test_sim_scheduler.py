"""sim/scheduler.py: the event-driven block scheduler keeps the simulator's barrier semantics.

Barriers release only when every unfinished thread of the block waits in them (threads that
returned early do not hold a barrier, as in numba-cuda's polling loop), ``syncthreads_count``
and friends still count, several blocks and launches never share state, and a failing thread
raises its own error at once, with the block's other threads aborted rather than left waiting.
"""
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
    _ring_rounds[1, 8](np.zeros((1, 8), np.int32))   # the scheduler is usable afterwards


def test_the_scheduler_is_installed():
    from numba.cuda.simulator import kernel

    assert kernel.BlockManager.run.__module__ == "sim.scheduler"
    assert kernel.BlockThread.syncthreads.__module__ == "sim.scheduler"
