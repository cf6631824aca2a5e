"""Argument checks shared by the reference modules.

Every check raises before any work: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a
wrong value or shape, and the message always starts with the argument's name.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

_KINDS = {
    "float": ("f", "a floating dtype (float16/32/64)"),
    "int": ("iu", "an integer dtype"),
    "bool": ("b", "dtype bool"),
}


def require_int(value: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """A Python or NumPy integer (bool rejected) within ``[minimum, maximum]``, as ``int``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def require_real(value: Any, name: str) -> float:
    """A finite real number (bool rejected), as ``float``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def require_array(value: Any, name: str, kind: str, ndim: int | None = None) -> np.ndarray:
    """``value`` as an ndarray of dtype kind ``kind`` ('float', 'int' or 'bool') and rank ``ndim``."""
    codes, wanted = _KINDS[kind]
    arr = np.asarray(value)
    if arr.dtype.kind not in codes:
        raise TypeError(f"{name} must have {wanted}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr


def require_finite(arr: np.ndarray, name: str) -> None:
    """No NaN or infinity anywhere in ``arr``."""
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite (found NaN or infinity)")


def require_shape(arr: np.ndarray, name: str, shape: tuple[int, ...]) -> None:
    """``arr.shape == shape`` exactly."""
    if arr.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {arr.shape}")


def as_int64(arr: np.ndarray, name: str) -> np.ndarray:
    """An integer array as int64, rejecting uint64 values that do not fit."""
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} has values that do not fit in int64")
    return arr.astype(np.int64)
