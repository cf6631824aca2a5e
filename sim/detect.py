"""Find out, without importing ``numba.cuda``, whether a real CUDA GPU is usable.

``NUMBA_ENABLE_CUDASIM`` is read once, when ``numba.cuda`` is first imported
(numba-stack.md §1), so the decision to simulate must be taken before that import.
"""
from __future__ import annotations

import ctypes
import functools
import os

__all__ = ["gpu_available", "simulator_requested", "enable_simulator_if_no_gpu"]


@functools.cache
def gpu_available() -> bool:
    """True when the CUDA driver loads and reports at least one device."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        try:
            if lib.cuInit(0) != 0:
                return False
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return False
        except AttributeError:
            return False
        return count.value > 0
    return False


def simulator_requested() -> bool:
    """True when the environment asks numba-cuda for its CPU simulator."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def enable_simulator_if_no_gpu() -> bool:
    """Turn the CUDA simulator on when no GPU is found; return whether it is on.

    Must run before the first ``import numba.cuda``; an explicit
    ``NUMBA_ENABLE_CUDASIM`` set by the user is left as it is.
    """
    if "NUMBA_ENABLE_CUDASIM" not in os.environ and not gpu_available():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    return simulator_requested()
