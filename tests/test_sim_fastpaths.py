"""sim/fastpaths.py: plain NumPy arrays inside simulated kernels and numba's scalar casts answered
without numba's type machinery, with the same results for valid kernel code."""
import numpy as np
import pytest
from numba import cuda, types

from sim.install import simulator_active

SIMULATED = simulator_active()
pytestmark = pytest.mark.skipif(not SIMULATED, reason="simulator fast paths (a GPU runs compiled code)")

RECORD = np.dtype([("x", np.float32), ("n", np.int32)])


@cuda.jit
def _kinds(a, kinds):
    """kinds[0] = 1 if ``a`` is a plain ndarray in the kernel; a[i] += i (a write back)."""
    i = cuda.threadIdx.x
    if i == 0:
        kinds[0] = 1 if type(a) is np.ndarray else 0
    a[i] += i


@cuda.jit
def _record_fields(r):
    i = cuda.threadIdx.x
    r[i].x = r[i].n * 2   # recarray-like field access: numba-cuda's wrapper kept for structured dtypes


def test_the_fast_paths_are_installed():
    from numba.cuda.simulator import kernel
    from numba.core.types import abstract

    assert kernel.FakeWithinKernelCUDAArray.__module__ == "sim.fastpaths"
    assert abstract.Type.__call__.__module__ == "sim.fastpaths"


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint64])
def test_plain_arrays_reach_the_kernel_as_ndarrays_and_writes_land_on_the_device(dtype):
    host = np.arange(8, dtype=dtype)
    device = cuda.to_device(host)
    kinds = cuda.to_device(np.zeros(1, np.int32))
    _kinds[1, 8](device, kinds)
    assert kinds.copy_to_host()[0] == 1
    np.testing.assert_array_equal(device.copy_to_host(), host + np.arange(8, dtype=dtype))
    as_host = host.copy()   # a NumPy argument: copied in and back out, as before
    _kinds[1, 8](as_host, kinds)
    np.testing.assert_array_equal(as_host, host + np.arange(8, dtype=dtype))


def test_structured_arrays_keep_field_access():
    records = np.zeros(4, RECORD)
    records["n"] = [1, 2, 3, 4]
    device = cuda.to_device(records)
    _record_fields[1, 4](device)
    np.testing.assert_array_equal(device.copy_to_host()["x"], [2, 4, 6, 8])


def test_out_of_bounds_reads_still_raise():
    with pytest.raises(IndexError):
        _kinds[1, 9](cuda.to_device(np.zeros(8, np.float32)), cuda.to_device(np.zeros(1, np.int32)))


CAST_TYPES = [types.int8, types.int16, types.int32, types.int64, types.uint8, types.uint32, types.uint64,
              types.float16, types.float32, types.float64, types.complex64, types.boolean, types.intp]
VALUES = [0, 1, -1, 7, 2**31 - 1, 2**31, 2**40, -(2**63), 2**64 - 1, 0.5, -2.75, 1e30, float("inf"), float("nan"),
          True, np.int32(-5), np.uint32(4000000000), np.int64(-(2**40)), np.uint64(2**63), np.float32(3.25),
          np.float64(-1e-40), np.float16(0.1), np.bool_(True), 1 + 2j]


def _outcome(call, numba_type, value):
    """(type, value) of the cast, or the exception's type (overflow, a complex to a real, ...)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = call(numba_type, value)
    except Exception as exc:   # the same failure is part of the same semantics
        return type(exc)
    return type(result), np.asarray(result).tobytes()


@pytest.mark.parametrize("numba_type", CAST_TYPES, ids=str)
def test_casts_equal_numbas_own(numba_type):
    """Every (type, value) pair: the same result type and bits as numba's Type.__call__, or the same
    exception."""
    from numba.core.types import abstract
    from sim import fastpaths

    for value in VALUES:
        assert _outcome(abstract.Type.__call__, numba_type, value) == _outcome(
            fastpaths._numba_type_call, numba_type, value), (numba_type, value)


def test_signatures_and_type_arguments_still_go_to_numba():
    from numba.core.typing import Signature

    sig = types.float32(types.int32, types.float32[:])
    assert isinstance(sig, Signature) and sig.return_type == types.float32 and sig.args[0] == types.int32
    assert types.void(types.int32).return_type == types.void
    assert isinstance(types.int64(types.int32), Signature)   # one argument that is a type: a signature
