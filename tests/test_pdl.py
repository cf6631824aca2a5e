"""Programmatic dependent launch: the device calls, which kernels take it, the launch hooks.

Under the simulator the device calls are no-ops and launches run one after another, so what is
checked there is the structure that makes PDL safe on a GPU: every engine kernel's first statement
is ``pdl_begin()`` (the wait comes before any memory access), the host marks exactly those kernels,
and the hooks add the launch attribute only inside ``programmatic_launches`` and only for them.
The GPU tests run chains of dependent kernels with programmatic launches, eagerly and replayed
from a captured graph, and compare exact values.
"""
import ast
import inspect
import textwrap

import numpy as np
import pytest
from numba import cuda, float32

from ddtree_numba.kernels import pdl
from ddtree_numba.kernels.pdl import pdl_begin, pdl_release, pdl_wait
from ddtree_numba.kernels.registry import all_kernels
from sim import launch as launch_mod
from sim.launch import programmatic_launches, programmatic_launches_active, takes_programmatic_launch

# Registered kernels that no engine step launches (the warp building blocks' own test kernels).
NOT_ENGINE = ("warp_",)
THREADS = 256


@cuda.jit
def add_one_kernel(src, dst):
    """dst[i] = src[i] + 1, after the previous grid (the engine's rule: pdl_begin first)."""
    pdl_begin()
    i = cuda.grid(1)
    if i < dst.shape[0]:
        dst[i] = src[i] + float32(1.0)


@cuda.jit
def add_weight_kernel(weight, src, dst):
    """dst[i] = src[i] + weight[i]: the weight (written by no kernel of the chain) is read before
    the wait, the dependent input after it; the release comes last."""
    i = cuda.grid(1)
    w = weight[i] if i < dst.shape[0] else float32(0.0)
    pdl_wait()
    if i < dst.shape[0]:
        dst[i] = src[i] + w
    pdl_release()


@cuda.jit
def plain_kernel(out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = float32(i)


def _first_statement(func):
    """The first statement of ``func``'s body after its docstring and shared-array declarations."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    body = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)).body
    i = 1 if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    while i < len(body) and "cuda.shared.array" in ast.unparse(body[i]):
        i += 1
    return body[i]


def test_entry_points_agree():
    """sim.launch finds waiting kernels by the names kernels.pdl exports."""
    assert launch_mod.PDL_ENTRY_POINTS == pdl.ENTRY_POINTS
    assert all(hasattr(pdl, name) for name in pdl.ENTRY_POINTS)


def test_every_engine_kernel_begins_with_pdl_begin():
    """The wait before any memory access: each engine kernel's first statement (shared arrays
    aside) is pdl_begin(), and the host takes each for programmatic launches; the others are not."""
    specs = all_kernels()
    engine = [s for s in specs if not s.name.startswith(NOT_ENGINE)]
    assert len(engine) > 100
    seen = set()
    for spec in engine:
        func = spec.kernel.py_func
        assert takes_programmatic_launch(spec.kernel), spec.name
        if func.__code__ in seen:
            continue
        seen.add(func.__code__)
        assert ast.unparse(_first_statement(func)) == "pdl_begin()", spec.name
    assert len(seen) >= 40   # distinct kernel bodies
    for spec in specs:
        if spec.name.startswith(NOT_ENGINE):
            assert not takes_programmatic_launch(spec.kernel), spec.name


def test_takes_programmatic_launch_by_name():
    def begins():
        pdl_begin()

    def waits():
        pdl_wait()

    def releases_only():
        pdl_release()

    assert takes_programmatic_launch(add_one_kernel) and takes_programmatic_launch(add_weight_kernel)
    assert takes_programmatic_launch(begins) and takes_programmatic_launch(waits)
    assert not takes_programmatic_launch(releases_only)   # releasing early without a wait is not safe
    assert not takes_programmatic_launch(plain_kernel)
    assert not takes_programmatic_launch(object()) and not takes_programmatic_launch(len)


def test_programmatic_launches_scope():
    assert not programmatic_launches_active()
    with programmatic_launches():
        assert programmatic_launches_active()
        with programmatic_launches(False):
            assert not programmatic_launches_active()
        assert programmatic_launches_active()
    assert not programmatic_launches_active()
    with pytest.raises(TypeError, match="enabled"):
        with programmatic_launches("yes"):
            pass
    assert not programmatic_launches_active()


def test_launch_hooks_add_the_attribute_for_waiting_kernels_in_scope():
    """The wrapped numba launch marks a launch programmatic only in scope and only for a kernel
    that waits; the wrapped LaunchConfig then sets programmatic_stream_serialization."""
    from cuda.core import LaunchConfig

    make_config = launch_mod._programmatic_launch_config(LaunchConfig)
    configs = []

    def numba_launch(self, args, griddim, blockdim, stream=0, sharedmem=0):
        configs.append(make_config(grid=griddim, block=blockdim, shmem_size=sharedmem, is_cooperative=False))

    hooked = launch_mod._programmatic_kernel_launch(numba_launch)

    class Compiled:
        def __init__(self, kernel):
            self.py_func = kernel.py_func

    waiting, other = Compiled(add_one_kernel), Compiled(plain_kernel)
    hooked(waiting, (), (1, 1, 1), (32, 1, 1))
    with programmatic_launches():
        hooked(waiting, (), (1, 1, 1), (32, 1, 1))
        hooked(other, (), (1, 1, 1), (32, 1, 1))
        with programmatic_launches(False):
            hooked(waiting, (), (1, 1, 1), (32, 1, 1))
    hooked(waiting, (), (1, 1, 1), (32, 1, 1))
    assert [c.programmatic_stream_serialization for c in configs] == [False, True, False, False, False]
    assert make_config(grid=1, block=32).programmatic_stream_serialization is False   # outside a launch


def _chain(src, dst, weight, launches, stream):
    """``launches`` dependent kernels ping-ponging between src and dst (every 4th adds weight)."""
    n = src.shape[0]
    grid = -(-n // THREADS)
    bufs = (src, dst)
    for k in range(launches):
        a, b = bufs[k % 2], bufs[(k + 1) % 2]
        if k % 4 == 3:
            add_weight_kernel[grid, THREADS, stream](weight, a, b)
        else:
            add_one_kernel[grid, THREADS, stream](a, b)


def _expected(x0, weight, launches):
    x = x0.copy()
    for k in range(launches):
        x = x + (weight if k % 4 == 3 else np.float32(1.0))
    return x


@pytest.mark.parametrize("n", [1, 300])
def test_chain_in_the_simulator(n):
    """The device calls run (as no-ops) and the chain computes what it should (a partial last
    block at 300)."""
    rng = np.random.default_rng(n)
    x0 = rng.integers(-50, 50, n).astype(np.float32)
    weight = rng.integers(-4, 5, n).astype(np.float32)
    src, dst, w = cuda.to_device(x0), cuda.device_array(n, np.float32), cuda.to_device(weight)
    with programmatic_launches():
        _chain(src, dst, w, 8, 0)
    np.testing.assert_array_equal(src.copy_to_host(), _expected(x0, weight, 8))


@pytest.mark.gpu
def test_gpu_programmatic_chain_eager_and_replayed():
    """64 dependent launches over 4 Mi floats (16 k blocks, many waves) with programmatic
    launches: eagerly, then captured once and replayed 20 times; exact values each time (a
    kernel reading before its predecessor finished would leave stale elements)."""
    from cuda.core import Device

    from ddtree_numba.engine.graphs import StepGraph

    n, launches = 1 << 22, 64
    rng = np.random.default_rng(0)
    x0 = rng.integers(-1000, 1000, n).astype(np.float32)
    weight = rng.integers(-4, 5, n).astype(np.float32)
    src, dst, w = cuda.to_device(x0), cuda.device_array(n, np.float32), cuda.to_device(weight)
    stream = Device().create_stream()
    with programmatic_launches():
        _chain(src, dst, w, launches, stream)
        stream.sync()
        expected = _expected(x0, weight, launches)
        np.testing.assert_array_equal(src.copy_to_host(), expected)
        graph = StepGraph(lambda s: _chain(src, dst, w, launches, s), stream)
        graph.warm_up()
        expected = _expected(expected, weight, launches)
        for _ in range(20):
            graph.replay()
            expected = _expected(expected, weight, launches)
        stream.sync()
        graph.close()
    np.testing.assert_array_equal(src.copy_to_host(), expected)
    assert launch_mod._install_programmatic_hooks()   # installed, idempotent
