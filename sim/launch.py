"""Launch-configuration check against a device profile, enforced in the simulator too.

The numba-cuda simulator runs ``kernel[1, 2048]`` without complaint (stack §2, gotcha 8), so a
kernel tested only there could fail on the first real launch. :func:`check_launch` applies the
profile's limits (limits §4: 1024 threads per block, 48 KiB shared memory without opt-in);
:func:`launch` checks and then launches (every host wrapper goes through it), and
:func:`install_simulator_hook` makes the simulator check every ``kernel[grid, block, ...]``.
:func:`opt_in_shared` lets a GPU launch use more than 48 KiB of dynamic shared memory (numba-cuda
has no public way, limits §4 and NVIDIA/numba-cuda#94). :func:`programmatic_launches` launches the
kernels that call ``ddtree_numba.kernels.pdl``'s wait with programmatic dependent launch (PDL),
every launch of them in its scope, also the ones that do not pass through :func:`launch`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import math
import numbers
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .profiles import DeviceProfile, active_profile

__all__ = ["LaunchConfigError", "Dim3", "check_launch", "launch", "launch_bounds", "opt_in_shared",
           "install_simulator_hook", "programmatic_launches", "programmatic_launches_active",
           "programmatic_launch_count", "takes_programmatic_launch"]

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
    # numba caches configured launches (kernel[...] returns the same object for the same
    # configuration): append once, or every eager launch would lengthen the list.
    if callbacks is not None and dynamic_shared_bytes > 0 and _raise_dynamic_limit not in callbacks:
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


# --- programmatic dependent launch (ddtree_numba.kernels.pdl) ------------------------------------

_PROGRAMMATIC = contextvars.ContextVar("ddtree_programmatic_launches", default=False)
_THIS_LAUNCH = contextvars.ContextVar("ddtree_programmatic_this_launch", default=False)
_PDL_MARKER = "__ddtree_programmatic__"
_INSTALL_LOCK = threading.Lock()
_PROGRAMMATIC_CONFIGS = [0]   # launch configurations made programmatic since import (all threads)


def programmatic_launch_count() -> int:
    """How many launches have carried the programmatic attribute since import: a test or a
    benchmark reads it before and after a run to see that PDL really happened (a numba-cuda that
    launched another way would leave it unchanged)."""
    return _PROGRAMMATIC_CONFIGS[0]


@functools.lru_cache(maxsize=None)
def _code_calls_pdl(code: types.CodeType) -> bool:
    # lazily: importing the package wires the simulator (as compile_check's atomic_path import)
    from ddtree_numba.kernels.pdl import ENTRY_POINTS

    names = set(code.co_names) | set(code.co_freevars)
    return any(name in names for name in ENTRY_POINTS)


def takes_programmatic_launch(kernel: Any) -> bool:
    """Whether ``kernel`` (a numba dispatcher, compiled kernel, simulator kernel or plain Python
    function) calls ``pdl_begin`` / ``pdl_begin_early`` / ``pdl_wait`` in its body (kernels.pdl's
    ENTRY_POINTS), by name: only such a kernel may be
    launched before its predecessor has completed (:mod:`ddtree_numba.kernels.pdl`)."""
    func = getattr(kernel, "py_func", kernel)
    code = getattr(func, "__code__", None)
    return isinstance(code, types.CodeType) and _code_calls_pdl(code)


def programmatic_launches_active() -> bool:
    """Whether launches in this context use PDL (inside :func:`programmatic_launches`)."""
    return _PROGRAMMATIC.get()


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True) -> Iterator[None]:
    """In its scope (this thread / context), every GPU launch of a kernel that
    :func:`takes_programmatic_launch` sets ``programmatic_stream_serialization`` (cuda.core >=
    1.2): such a kernel may start while the previous kernel of its stream drains. A stream capture
    in the scope records programmatic edges, so a CUDA graph replays them. ``enabled=False``
    makes a scope of ordinary launches (e.g. inside an enabled one). Under the simulator, which
    runs launches one after another, it changes nothing.

    Raises:
        TypeError: ``enabled`` is not a bool.
        RuntimeError: enabled on a GPU of compute capability below 9.0 (PDL needs sm_90), or with
            a numba-cuda whose launch does not build cuda.core's ``LaunchConfig`` (the hooks could
            not apply).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if enabled:
        _install_programmatic_hooks()
    token = _PROGRAMMATIC.set(enabled)
    try:
        yield
    finally:
        _PROGRAMMATIC.reset(token)


def _programmatic_kernel_launch(original: Callable[..., Any]) -> Callable[..., Any]:
    """numba's ``_Kernel.launch`` wrapped: for the length of the call, whether this launch is
    programmatic (the mode is on and the compiled kernel's ``py_func`` waits)."""
    @functools.wraps(original)
    def launch_kernel(self: Any, *args: Any, **kwargs: Any) -> Any:
        # (a kernel rebuilt from a cache has no py_func: launched ordinarily)
        token = _THIS_LAUNCH.set(_PROGRAMMATIC.get() and takes_programmatic_launch(getattr(self, "py_func", None)))
        try:
            return original(self, *args, **kwargs)
        finally:
            _THIS_LAUNCH.reset(token)

    setattr(launch_kernel, _PDL_MARKER, True)
    return launch_kernel


def _programmatic_launch_config(core_config: Callable[..., Any]) -> Callable[..., Any]:
    """cuda.core's ``LaunchConfig`` as numba's ``_Kernel.launch`` calls it, with
    ``programmatic_stream_serialization=True`` added for a programmatic launch."""
    def launch_config(*args: Any, **kwargs: Any) -> Any:
        if _THIS_LAUNCH.get():
            kwargs["programmatic_stream_serialization"] = True
            _PROGRAMMATIC_CONFIGS[0] += 1   # (host-side, under the GIL; a count, not a lock)
        return core_config(*args, **kwargs)

    setattr(launch_config, _PDL_MARKER, True)
    launch_config.wrapped = core_config
    return launch_config


def _install_programmatic_hooks() -> bool:
    """Wrap numba-cuda's kernel launch so that a programmatic launch passes the attribute
    (idempotent; False, and nothing done, under the simulator). numba-cuda 0.30.4 (pinned) builds
    ``LaunchConfig(grid=..., block=..., shmem_size=..., is_cooperative=...)`` in
    ``_Kernel.launch`` from its module's name ``LaunchConfig`` and has no launch-attribute
    option; the two wrappers add one keyword where that mode is on and change nothing else."""
    from numba import cuda

    if cuda.config.ENABLE_CUDASIM:
        return False
    major, minor = cuda.get_current_device().compute_capability
    if major < 9:
        raise RuntimeError("programmatic dependent launch needs compute capability 9.0 or newer, the "
                           f"current device has {major}.{minor}")
    dispatcher = importlib.import_module("numba.cuda.dispatcher")
    from cuda.core import LaunchConfig

    with _INSTALL_LOCK:   # two threads entering their first scope at once install once
        if getattr(dispatcher._Kernel.launch, _PDL_MARKER, False):
            return True
        if dispatcher.LaunchConfig is not LaunchConfig:
            raise RuntimeError("numba.cuda.dispatcher.LaunchConfig is not cuda.core's LaunchConfig: this "
                               "numba-cuda launches kernels another way; programmatic launches are not "
                               "supported with it")
        dispatcher.LaunchConfig = _programmatic_launch_config(LaunchConfig)
        dispatcher._Kernel.launch = _programmatic_kernel_launch(dispatcher._Kernel.launch)
    return True
