"""Two hot paths of the numba-cuda simulator made cheaper, with the same results for valid kernel
code (numba-stack.md §2, "Mechanics").

**Arrays inside kernels.** numba-cuda 0.30.x's simulator hands a kernel each device array as a
``FakeWithinKernelCUDAArray`` around a ``FakeCUDAArray`` around the array's NumPy buffer
(``numba/cuda/simulator/kernel.py``, ``FakeCUDAKernel.__call__``); the outer wrapper exists to
give structured dtypes ``recarray``-like field access (``a.x`` for ``a['x']``). Every element a
simulated thread reads then costs three Python calls and two ``isinstance`` checks on top of
NumPy's indexing. :func:`install` makes the simulator pass the NumPy buffer itself for every
array whose dtype has no fields (all of this package's arrays): element reads and writes (into
the device array's own buffer, the same memory), slices, ``size`` / ``ndim`` / ``dtype`` and the
simulator's atomics (which index and assign) behave as before. Structured arrays keep
numba-cuda's wrapper. What a kernel must not do anyway is more permissive now: whole-array
arithmetic (``a[0:2] * 2``: the wrapper had no operators; a GPU compile rejects it), ``bool(a)``
and a negative index into ``a.shape`` (the wrapper's ``FakeShape`` refused it; compiled numba
takes it) run, so the compile check (:mod:`sim.compile_check`) is what catches the first.

**Scalar casts.** Kernels cast with numba's types (``int32(i)``, ``float32(x)``, ``uint64(b)``),
which the simulator runs as ``numba.core.types.Type.__call__``: an import statement, an ABC
``isinstance`` test (is the argument a type, i.e. is this a signature?) and ``getattr(np, name)``
on every call, ~40 % of a simulated attention kernel's time (a sampling profile of
``test_score_first_skip_dead_keys_kimi_dims``). :func:`install` answers a call whose one argument
is a Python or NumPy scalar with the same NumPy constructor (numba's ``cast_python_value`` for
integers, floats and complex numbers; the type's own ``cast_python_value`` otherwise), looked up
once per type; every other call (signatures such as ``float32(int32, int32)``) goes to numba's
``__call__`` unchanged.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["install"]

# Arguments that are values, never numba types: the casts' fast path
_SCALAR_TYPES = frozenset({int, float, bool, complex, np.bool_, np.int8, np.int16, np.int32, np.int64,
                           np.uint8, np.uint16, np.uint32, np.uint64, np.float16, np.float32, np.float64,
                           np.complex64, np.complex128})

_installed = False
_numba_type_call: Callable[..., Any] | None = None   # numba's Type.__call__, kept for the other calls


def _cast_for(numba_type: Any) -> Callable[[Any], Any]:
    """The callable numba's ``cast_python_value`` amounts to for ``numba_type``."""
    from numba.core.types import scalars

    if type(numba_type) in (scalars.Integer, scalars.Float, scalars.Complex):
        return getattr(np, numba_type.name)   # what their cast_python_value calls
    return numba_type.cast_python_value


def install() -> None:
    """Install both fast paths (idempotent; simulator only)."""
    global _installed, _numba_type_call
    if _installed:
        return
    from numba.core.types import abstract
    from numba.cuda.simulator import kernel

    wrapper = kernel.FakeWithinKernelCUDAArray

    def within_kernel(item: Any) -> Any:
        buffer = item._ary   # the FakeCUDAArray's NumPy array (writes land in the device array)
        return buffer if buffer.dtype.fields is None else wrapper(item)

    kernel.FakeWithinKernelCUDAArray = within_kernel

    type_call = _numba_type_call = abstract.Type.__call__
    casts: dict[int, Callable[[Any], Any]] = {}   # id of an interned numba type -> its cast

    def call(self: Any, *args: Any) -> Any:
        if len(args) == 1 and type(args[0]) in _SCALAR_TYPES:
            cast = casts.get(id(self))
            if cast is None:
                cast = casts[id(self)] = _cast_for(self)
            return cast(args[0])
        return type_call(self, *args)

    abstract.Type.__call__ = call
    _installed = True
