"""sim/shared.py: every thread of a simulated block gets the same ``cuda.shared.array``.

numba-cuda's simulator allocates a block's static shared arrays check-then-store without a lock;
a thread switch between the two lets threads of one block hold different arrays (the cause of
an intermittent CI failure: the DFlash drafter's logits read uninitialised shared memory). The
test widens that window (the allocation sleeps, releasing the GIL) so the race would hit almost
every launch, and checks that every thread still sees the others' writes.
"""
import time

import numpy as np
import pytest
from numba import cuda, float32

SIMULATED = bool(cuda.config.ENABLE_CUDASIM)
THREADS = 32


@cuda.jit
def _sum_of_shared(out):
    red = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    red[t] = float32(t + 1)
    cuda.syncthreads()  # every thread's value written
    total = float32(0)
    for i in range(cuda.blockDim.x):
        total += red[i]
    out[t] = total


@pytest.mark.skipif(not SIMULATED, reason="the simulator's allocation race (a GPU has one array per block)")
def test_threads_of_a_block_share_one_array_under_a_forced_race(monkeypatch):
    import numba.cuda.simulator.kernelapi as kernelapi

    import sim.shared as shared

    real_empty = np.empty

    class SlowNumpy:
        """numpy for sim/shared.py, whose np.empty sleeps first (a thread switch mid-allocation)."""

        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(*args, **kwargs):
            time.sleep(0.002)
            return real_empty(*args, **kwargs)

    monkeypatch.setattr(shared, "np", SlowNumpy())
    monkeypatch.setattr(kernelapi, "np", SlowNumpy())   # numba-cuda's own allocation, unfixed
    want = THREADS * (THREADS + 1) / 2
    for _ in range(5):
        out = np.zeros(THREADS, np.float32)
        _sum_of_shared[1, THREADS](out)
        np.testing.assert_array_equal(out, np.full(THREADS, want, np.float32))
    assert kernelapi.FakeCUDAShared.array is shared._array   # installed by sim.install (conftest)
