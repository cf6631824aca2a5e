"""Launch-configuration check against a device profile, enforced in the simulator too.

The numba-cuda simulator runs ``kernel[1, 2048]`` without complaint (stack §2, gotcha 8), so a
kernel tested only there could fail on the first real launch. :func:`check_launch` applies the
profile's limits (limits §4: 1024 threads per block, 48 KiB shared memory without opt-in);
:func:`launch` checks and then launches (every host wrapper goes through it), and
:func:`install_simulator_hook` makes the simulator check every ``kernel[grid, block, ...]``.
:func:`opt_in_shared` lets a GPU launch use more than 48 KiB of dynamic shared memory (numba-cuda
has no public way, limits §4 and NVIDIA/numba-cuda#94).
"""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

from .profiles import DeviceProfile, active_profile

__all__ = ["LaunchConfigError", "Dim3", "check_launch", "launch", "launch_bounds", "opt_in_shared",
           "install_simulator_hook"]

Dim3 = tuple[int, int, int]
_HOOK_MARKER = "__ddtree_launch_check__"


class LaunchConfigError(ValueError):
    """A launch configuration the target device would reject."""


def launch_bounds(threads: int, min_blocks: int | None = None) -> dict[str, Any]:
    """``cuda.jit`` options that cap a kernel's registers for ``threads`` per block (and
    ``min_blocks`` resident per SM): ``launch_bounds`` on a GPU, none under the simulator, which
    rejects the option."""
    from .install import simulator_active   # imports numba.cuda

    if simulator_active():
        return {}
    return {"launch_bounds": threads if min_blocks is None else (threads, min_blocks)}


def _normalise_dims(dims: int | Sequence[int], name: str) -> Dim3:
    """An int or a 1-3 sequence of positive ints -> a 3-tuple padded with 1s."""
    values = [dims] if isinstance(dims, numbers.Integral) and not isinstance(dims, bool) else dims
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"{name} must be an int or a tuple of 1-3 ints, got {type(dims).__name__}")
    if not 1 <= len(values) <= 3:
        raise LaunchConfigError(f"{name} must have 1-3 dimensions, got {len(values)}: {dims!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must contain ints, got {type(v).__name__} in {dims!r}")
        if v <= 0:
            raise LaunchConfigError(f"{name} must be positive in every dimension, got {dims!r}")
    return tuple(int(v) for v in values) + (1,) * (3 - len(values))


def _check_bytes(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise LaunchConfigError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_launch(
    griddim: int | Sequence[int],
    blockdim: int | Sequence[int],
    dynamic_shared_bytes: int = 0,
    *,
    static_shared_bytes: int = 0,
    opt_in: bool = False,
    profile: DeviceProfile | None = None,
) -> tuple[Dim3, Dim3]:
    """Check a launch configuration against ``profile`` (default :func:`active_profile`).

    Args:
        griddim, blockdim: int or 1-3 tuple of ints.
        dynamic_shared_bytes: the 4th launch parameter.
        static_shared_bytes: the kernel's ``cuda.shared.array`` total (from the compile check).
        opt_in: the kernel opted in to more than 48 KiB (limits §4), so the opt-in limit applies.

    Returns:
        ``(grid, block)``, each a 3-tuple of ints.

    Raises:
        TypeError: a dimension or byte count is not an int, or ``profile`` not a DeviceProfile.
        LaunchConfigError (a ValueError): non-positive or over-limit dimensions, too many threads
            per block, or too much shared memory; the message names the value, limit and profile.
    """
    if profile is None:
        profile = active_profile()
    elif not isinstance(profile, DeviceProfile):
        raise TypeError(f"profile must be a DeviceProfile, got {type(profile).__name__}")
    grid = _normalise_dims(griddim, "griddim")
    block = _normalise_dims(blockdim, "blockdim")
    dynamic = _check_bytes(dynamic_shared_bytes, "dynamic_shared_bytes")
    static = _check_bytes(static_shared_bytes, "static_shared_bytes")
    where = f"for profile {profile.describe()}"

    threads = math.prod(block)
    if threads > profile.max_threads_per_block:
        raise LaunchConfigError(
            f"blockdim {block}: {threads} threads per block is over the limit of "
            f"{profile.max_threads_per_block} {where}"
        )
    for axis, (value, limit) in enumerate(zip(block, profile.max_block_dim)):
        if value > limit:
            raise LaunchConfigError(
                f"blockdim {block}: dimension {'xyz'[axis]} = {value} is over the limit of {limit} {where}"
            )
    for axis, (value, limit) in enumerate(zip(grid, profile.max_grid_dim)):
        if value > limit:
            raise LaunchConfigError(
                f"griddim {grid}: dimension {'xyz'[axis]} = {value} is over the limit of {limit} {where}"
            )
    smem_limit = profile.smem_per_block_optin if opt_in else profile.smem_per_block_default
    if static + dynamic > smem_limit:
        kind = "opt-in" if opt_in else "default (no opt-in)"
        raise LaunchConfigError(
            f"shared memory {static + dynamic} B (static {static} + dynamic_shared_bytes {dynamic}) "
            f"is over the {kind} limit of {smem_limit} B per block {where}"
        )
    return grid, block


def launch(
    kernel: Any,
    griddim: int | Sequence[int],
    blockdim: int | Sequence[int],
    stream: Any,
    dynamic_shared_bytes: int,
    *args: Any,
    profile: DeviceProfile | None = None,
) -> None:
    """Check the configuration, then run ``kernel[griddim, blockdim, stream, dynamic_shared_bytes](*args)``.

    ``stream`` may be 0 or None (the default stream), a numba stream, or a ``cuda.core``
    Stream / GraphBuilder, which numba accepts directly (stack §4). Nothing is launched when
    the check fails, or when an argument is None: numba-cuda marshals no None argument on a GPU
    (``NotImplementedError: (none, None)`` at the launch), while the simulator passes it, so the
    simulator's tests would miss a launch that only the GPU rejects; kernels take compile-time
    flags and placeholders instead (``model_ops.PLACEHOLDER``).
    """
    grid, block = check_launch(griddim, blockdim, dynamic_shared_bytes, profile=profile)
    missing = [i for i, a in enumerate(args) if a is None]   # identity: `in` would compare arrays
    if missing:
        raise TypeError(f"launch of {getattr(kernel, '__name__', kernel)!r}: argument "
                        f"{missing[0]} is None, which a GPU launch cannot pass; specialise the "
                        "kernel on the array's absence and pass a placeholder")
    kernel[grid, block, 0 if stream is None else stream, dynamic_shared_bytes](*args)


_OPTED_IN: dict[int, int] = {}  # CUkernel handle -> dynamic shared bytes its attribute allows


def _raise_dynamic_limit(kernel: Any, launch_config: Any) -> None:
    """numba pre-launch callback: set the compiled kernel's
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES to this launch's amount (once per kernel and
    amount; numba-cuda's own carveout setter calls cuKernelSetAttribute the same way). A host
    attribute call, not stream work: the first, eager launch of a graph-captured step sets it."""
    from numba.cuda.cudadrv import driver as drv

    cufunc = kernel._codelibrary.get_cufunc()
    key, need = int(cufunc.handle), int(launch_config.sharedmem)
    if _OPTED_IN.get(key, -1) >= need:
        return
    attr = drv.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    drv.driver.cuKernelSetAttribute(attr, need, cufunc.handle, cufunc.device.id)
    _OPTED_IN[key] = need


def opt_in_shared(configured: Any, dynamic_shared_bytes: int) -> Any:
    """``configured`` (``kernel[grid, block, stream, dynamic_shared_bytes]``), opted in to
    ``dynamic_shared_bytes`` of dynamic shared memory (the caller checked the amount with
    :func:`check_launch` and ``opt_in=True``): when called, numba compiles the kernel for the
    arguments' types, the callback raises its limit, then it launches. The simulator has no
    such limit and no callbacks: returned as is."""
    callbacks = getattr(configured, "pre_launch_callbacks", None)
    if callbacks is not None and dynamic_shared_bytes > 0:
        callbacks.append(_raise_dynamic_limit)
    return configured


def install_simulator_hook() -> bool:
    """Make the numba-cuda simulator check every launch configuration; return whether it is on.

    Wraps ``FakeCUDAKernel.__getitem__`` (idempotent: a second call changes nothing), so
    ``kernel[grid, block, stream, sharedmem]`` raises :class:`LaunchConfigError` before any
    simulated thread starts. The simulator cannot know a kernel's static shared memory, so
    only the dynamic amount is checked here; the compile check covers static shared memory.
    It also resets the dynamic size to 0 for a 2- or 3-item configuration, as on a GPU (the
    simulator would otherwise keep the previous launch's value). Outside the simulator this
    is a no-op returning False.
    """
    from numba import cuda

    if not cuda.config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    original = FakeCUDAKernel.__getitem__
    if getattr(original, _HOOK_MARKER, False):
        return True

    @functools.wraps(original)
    def checked_getitem(self, configuration):
        if not isinstance(configuration, tuple) or len(configuration) not in (2, 3, 4):
            raise LaunchConfigError(
                f"launch configuration must be [grid, block], [grid, block, stream] or "
                f"[grid, block, stream, sharedmem], got {configuration!r}"
            )
        dynamic = configuration[3] if len(configuration) == 4 else 0
        check_launch(configuration[0], configuration[1], dynamic)
        configured = original(self, configuration)
        configured.dynshared_size = dynamic
        return configured

    setattr(checked_getitem, _HOOK_MARKER, True)
    FakeCUDAKernel.__getitem__ = checked_getitem
    return True
