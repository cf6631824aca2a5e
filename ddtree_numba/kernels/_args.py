"""Host-side argument checks shared by the kernel wrappers and the engine.

Every check raises before any work or launch, with a message that starts with the argument's
name: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong value, rank, shape or
layout (docs/ARCHITECTURE.md, "Errors").
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda


def is_device_array(x: Any) -> bool:
    """A numba device array (a simulator FakeCUDAArray under the simulator)."""
    return cuda.devicearray.is_cuda_ndarray(x)


def as_kernel_array(x: Any, name: str) -> Any:
    """``x`` as something a kernel takes: a NumPy array, a numba device array, or any object
    with ``__cuda_array_interface__`` (wrapped without copying)."""
    if isinstance(x, np.ndarray) or is_device_array(x):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x)
    raise TypeError(f"{name} must be a NumPy array or a CUDA device array, got {type(x).__name__}")


def data_address(x: Any) -> int:
    """The address of an array's first element, for alignment checks: a numba device array's
    pointer (cheaper than building its ``__cuda_array_interface__``), else the interface's, else
    a NumPy array's."""
    pointer = getattr(x, "device_ctypes_pointer", None)
    if pointer is not None:
        return pointer.value or 0
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is not None:
        return int(interface["data"][0])
    return int(x.ctypes.data)


def is_c_contiguous(x: Any) -> bool:
    """C-contiguity of a NumPy or numba device array."""
    return x.flags.c_contiguous if isinstance(x, np.ndarray) else x.is_c_contiguous()


def check_shape(x: Any, name: str, shape: tuple[int, ...]) -> None:
    """``x.shape == shape``, else ValueError naming ``name``."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_array(x: Any, name: str, dtypes: Any, ndim: int | None = None, *,
                shape: tuple[int, ...] | None = None) -> Any:
    """``x`` (see :func:`as_kernel_array`) with a dtype in ``dtypes`` (one dtype or a tuple of
    them), rank ``ndim`` and / or exactly ``shape`` (where given), C-contiguous.

    Raises:
        TypeError: not an array, or a wrong dtype.
        ValueError: a wrong rank or shape, or not C-contiguous.
    """
    x = as_kernel_array(x, name)
    wanted = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, tuple) else (dtypes,)))
    if np.dtype(x.dtype) not in wanted:
        names = " or ".join(d.name for d in wanted)
        raise TypeError(f"{name} must have dtype {names}, got {np.dtype(x.dtype).name}")
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if shape is not None:
        check_shape(x, name, shape)
    if not is_c_contiguous(x):
        raise ValueError(f"{name} must be C-contiguous")
    return x


def host_values(x: Any) -> np.ndarray | None:
    """The values of a host (NumPy) array, None for a device array (not read: no sync)."""
    return x if isinstance(x, np.ndarray) else None


def int_arg(value: Any, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A Python or NumPy integer (bools rejected) in ``[minimum, maximum]``, as ``int``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def positive_real(value: Any, name: str) -> np.float32:
    """A finite real number > 0 (bools rejected), as the float32 a kernel takes."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not (math.isfinite(float(value)) and float(value) > 0.0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return np.float32(value)
