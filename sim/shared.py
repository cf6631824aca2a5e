"""A thread-safe ``cuda.shared.array`` for the numba-cuda simulator.

numba-cuda 0.30.x (``simulator/kernelapi.py``, ``FakeCUDAShared.array``) hands out a block's
static shared arrays from a dict keyed by the calling line, check-then-store without a lock::

    res = self._allocations.get(caller)
    if res is None:
        res = np.empty(shape, dtype)
        self._allocations[caller] = res

Its threads (one Python thread per CUDA thread) all reach those lines at the start of the
launch's first block; a GIL switch between the get and the store lets several threads each
allocate their own ``np.empty`` array, and the last store wins. The threads holding a losing
array then write where nobody reads and read memory nobody wrote (uninitialised: garbage such
as 7e32, or stale values), intermittently (switch interval, CPU load). :func:`install` replaces
the method with the same keying under a lock, so every thread of a launch gets one array.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
from numba.core import types
from numba.np import numpy_support

__all__ = ["install"]

_lock = threading.Lock()


def _array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> np.ndarray:
    """``FakeCUDAShared.array`` with the allocation under a lock (same keying: the caller's
    file and line; dynamic shared memory, ``shape == 0``, unchanged)."""
    if alignment is not None:
        raise RuntimeError("Array alignment is not supported in cudasim")
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    frame = sys._getframe(1)  # the kernel line (what traceback.extract_stack()[-2][:2] gave)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    res = self._allocations.get(caller)
    if res is None:
        with _lock:  # re-check: the first thread allocates, every other one gets its array
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
    return res


def install() -> None:
    """Replace the simulator's ``FakeCUDAShared.array`` (idempotent; simulator only)."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    FakeCUDAShared.array = _array
