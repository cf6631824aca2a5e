"""Registry of every Numba CUDA kernel with the signatures it is really launched with.

The simulator does no type inference (stack §2, gotcha 2), so each kernel is also compiled for
sm_90 / sm_120 by :mod:`sim.compile_check`, which finds the kernels here. A kernel module
registers at import time::

    warp_sum = register("warp_sum_f32", _warp_sum_kernel, ((float32[::1], float32[::1]),),
                        "sum of each warp's values")

Works in and out of the simulator: the kernel is a numba ``CUDADispatcher`` or, under the
simulator, a ``FakeCUDAKernel``; both expose ``py_func``, which is what gets compiled.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from numba.core import types as nbtypes

__all__ = ["KernelSpec", "register", "all_kernels", "get"]

K = TypeVar("K")
MAX_BLOCK_THREADS = 1024  # every supported profile (limits §4)

_REGISTRY: dict[str, "KernelSpec"] = {}


@dataclass(frozen=True)
class KernelSpec:
    """One registered kernel.

    Attributes:
        name: unique name (used by ``ddtree-numba compile-check --kernel NAME``).
        kernel: the ``@cuda.jit`` dispatcher (``FakeCUDAKernel`` under the simulator).
        signatures: the argument-type tuples it is launched with, e.g.
            ``((float32[::1], int32),)``.
        description: one line saying what it computes.
        smem_opt_in: the kernel needs more than the 48 KiB default shared memory (limits §4),
            so the compile check holds it to the opt-in limit instead.
        block_threads: the largest block its host wrapper launches (None: not stated); the
            compile check fails when the kernel's registers do not allow a block that large.
        archs: the architectures it is launched on (e.g. ``("sm_90",)`` for a tiling that only
            fits Hopper's register file without spilling); None: every architecture.
    """

    name: str
    kernel: Any
    signatures: tuple[tuple[nbtypes.Type, ...], ...]
    description: str
    smem_opt_in: bool = False
    block_threads: int | None = None
    archs: tuple[str, ...] | None = None


def _check_signatures(signatures: Sequence[Sequence[nbtypes.Type]]) -> tuple[tuple[nbtypes.Type, ...], ...]:
    """A non-empty sequence of tuples of numba types -> a tuple of tuples."""
    if not isinstance(signatures, (tuple, list)) or not signatures:
        raise ValueError(f"signatures must be a non-empty tuple of argument-type tuples, got {signatures!r}")
    checked = []
    for sig in signatures:
        if not isinstance(sig, (tuple, list)):
            raise TypeError(f"signatures: each signature must be a tuple of numba types, got {sig!r}")
        for arg in sig:
            if not isinstance(arg, nbtypes.Type):
                raise TypeError(f"signatures: {arg!r} in {sig!r} is not a numba type")
        checked.append(tuple(sig))
    return tuple(checked)


def _same_definition(a: Any, b: Any) -> bool:
    """The same kernel object, or the same function re-decorated by a module reload."""
    if a is b:
        return True
    fa, fb = a.py_func, b.py_func
    return (fa.__module__, fa.__qualname__) == (fb.__module__, fb.__qualname__)


def register(
    name: str,
    kernel: K,
    signatures: Sequence[Sequence[nbtypes.Type]],
    description: str,
    *,
    smem_opt_in: bool = False,
    block_threads: int | None = None,
    archs: Sequence[str] | None = None,
) -> K:
    """Register ``kernel`` under ``name`` and return it unchanged.

    Raises:
        TypeError: ``name``/``description`` not a str, ``kernel`` without ``py_func``, a
            signature that is not a tuple of numba types, ``block_threads`` not an int.
        ValueError: empty ``name``/``description``, no signatures, ``block_threads`` not in
            [1, 1024], ``archs`` empty or not of the form ``sm_XY``, or ``name`` already taken
            by a different kernel (re-registering the same definition, as a module reload
            does, replaces the entry).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError("name must not be empty")
    if not callable(getattr(kernel, "py_func", None)):
        raise TypeError(f"kernel must be a @cuda.jit kernel (with py_func), got {type(kernel).__name__}")
    if not isinstance(description, str):
        raise TypeError(f"description must be a str, got {type(description).__name__}")
    if not description:
        raise ValueError("description must not be empty")
    if block_threads is not None:
        if isinstance(block_threads, bool) or not isinstance(block_threads, int):
            raise TypeError(f"block_threads must be an int or None, got {type(block_threads).__name__}")
        if not 1 <= block_threads <= MAX_BLOCK_THREADS:
            raise ValueError(f"block_threads must be in [1, {MAX_BLOCK_THREADS}], got {block_threads}")
    if archs is not None:
        given = archs
        archs = () if isinstance(archs, str) else tuple(archs)  # one pass over any iterable
        if not archs or not all(isinstance(a, str) and a.startswith("sm_") for a in archs):
            raise ValueError(f"archs must be a non-empty sequence of 'sm_XY' strings or None, got {given!r}")
    spec = KernelSpec(name, kernel, _check_signatures(signatures), description, bool(smem_opt_in), block_threads,
                      archs)
    existing = _REGISTRY.get(name)
    if existing is not None and not _same_definition(existing.kernel, kernel):
        raise ValueError(
            f"name: kernel {name!r} is already registered by "
            f"{existing.kernel.py_func.__module__}.{existing.kernel.py_func.__qualname__}"
        )
    _REGISTRY[name] = spec
    return kernel


# Packages whose modules register kernels: the round kernels and the engine's glue kernels.
KERNEL_PACKAGES = ("ddtree_numba.kernels", "ddtree_numba.engine")


def _import_kernel_modules() -> None:
    """Import every module of the kernel packages so that each has registered its kernels."""
    for name in KERNEL_PACKAGES:
        package = importlib.import_module(name)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{name}.{module.name}")


def all_kernels() -> list[KernelSpec]:
    """Every registered kernel, sorted by name, after importing all kernel modules."""
    _import_kernel_modules()
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def get(name: str) -> KernelSpec:
    """The kernel registered as ``name``.

    Raises:
        ValueError: no such kernel; the message lists the registered names.
    """
    if name not in _REGISTRY:
        _import_kernel_modules()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"name: no kernel registered as {name!r}; registered: {', '.join(sorted(_REGISTRY)) or '(none)'}"
        ) from None
