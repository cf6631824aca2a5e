"""Launch-configuration check, its simulator hook and the launch() helper."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda, float32

from sim import launch as launch_mod
from sim.launch import LaunchConfigError, check_launch, launch
from sim.profiles import H200, PROFILES, RTX_PRO_6000_BLACKWELL

ALL = list(PROFILES.values())
KIB = 1024
N_THREADS = 32
SENTINEL = -7.0

needs_sim = pytest.mark.skipif(not cuda.config.ENABLE_CUDASIM, reason="tests the simulator hook")


@cuda.jit
def fill_thread_ids(out):
    """out[i] = i for each thread of the grid (x only)."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = i


@cuda.jit
def copy_via_dynamic_smem(src, out):
    """Stage src through dynamic shared memory, then write it reversed within the block."""
    buf = cuda.shared.array(0, float32)  # sized by the 4th launch parameter
    i = cuda.threadIdx.x
    buf[i] = src[i]
    cuda.syncthreads()  # every element staged before any thread reads another's
    out[i] = buf[cuda.blockDim.x - 1 - i]


# ------------------------------------------------------------------------------------------
# check_launch
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", ALL, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "grid,block,expected",
    [
        (1, 1, ((1, 1, 1), (1, 1, 1))),
        (132, 1024, ((132, 1, 1), (1024, 1, 1))),
        ((4, 2), (32, 32), ((4, 2, 1), (32, 32, 1))),
        ([2**31 - 1], (16, 4, 16), ((2**31 - 1, 1, 1), (16, 4, 16))),
        ((1, 65535, 65535), (1, 1, 64), ((1, 65535, 65535), (1, 1, 64))),
        (np.int64(3), (np.int32(64),), ((3, 1, 1), (64, 1, 1))),
    ],
)
def test_check_launch_accepts_and_normalises(p, grid, block, expected):
    assert check_launch(grid, block, profile=p) == expected


@pytest.mark.parametrize("p", ALL, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "grid,block,match",
    [
        (1, 2048, "2048 threads per block.*limit of 1024"),
        (1, (32, 33), "1056 threads per block"),
        (1, (1, 1, 65), "dimension z = 65 is over the limit of 64"),
        (1, (1, 1025), "1025 threads per block"),  # x/y limits equal the thread limit
        (2**31, 32, r"griddim.*dimension x = 2147483648 is over the limit of 2147483647"),
        ((1, 65536), 32, "dimension y = 65536 is over the limit of 65535"),
        ((1, 1, 65536), 32, "dimension z = 65536"),
        (0, 32, "griddim must be positive"),
        (1, (32, 0), "blockdim must be positive"),
        (-1, 32, "griddim must be positive"),
        ((1, 1, 1, 1), 32, "griddim must have 1-3 dimensions"),
        ((), 32, "griddim must have 1-3 dimensions"),
    ],
)
def test_check_launch_rejects(p, grid, block, match):
    with pytest.raises(LaunchConfigError, match=match) as err:
        check_launch(grid, block, profile=p)
    assert isinstance(err.value, ValueError)
    if "limit" in match:
        assert f"'{p.name}'" in str(err.value) and p.arch in str(err.value)


@pytest.mark.parametrize(
    "grid,block,dyn,static,exc,match",
    [
        (1.0, 32, 0, 0, TypeError, "griddim"),
        (1, "32", 0, 0, TypeError, "blockdim"),
        (1, (32, 2.0), 0, 0, TypeError, "blockdim"),
        (True, 32, 0, 0, TypeError, "griddim"),
        (1, 32, 1.5, 0, TypeError, "dynamic_shared_bytes"),
        (1, 32, -1, 0, LaunchConfigError, "dynamic_shared_bytes"),
        (1, 32, 0, -4, LaunchConfigError, "static_shared_bytes"),
    ],
)
def test_check_launch_bad_types_and_values(grid, block, dyn, static, exc, match):
    with pytest.raises(exc, match=match):
        check_launch(grid, block, dyn, static_shared_bytes=static, profile=H200)


def test_check_launch_rejects_non_profile():
    with pytest.raises(TypeError, match="profile"):
        check_launch(1, 32, profile="h200")


@pytest.mark.parametrize("p", ALL, ids=lambda p: p.name)
def test_shared_memory_default_limit(p):
    check_launch(1, 128, 48 * KIB, profile=p)
    check_launch(1, 128, 16 * KIB, static_shared_bytes=32 * KIB, profile=p)
    with pytest.raises(LaunchConfigError, match=r"49153 B .*default \(no opt-in\) limit of 49152 B") as err:
        check_launch(1, 128, 48 * KIB + 1, profile=p)
    assert p.name in str(err.value)
    with pytest.raises(LaunchConfigError, match=r"static 40960 \+ dynamic_shared_bytes 8193"):
        check_launch(1, 128, 8 * KIB + 1, static_shared_bytes=40 * KIB, profile=p)


def test_shared_memory_opt_in_differs_between_profiles():
    check_launch(1, 256, 200 * KIB, opt_in=True, profile=H200)
    check_launch(1, 256, 227 * KIB, opt_in=True, profile=H200)
    with pytest.raises(LaunchConfigError, match="opt-in limit of 232448 B"):
        check_launch(1, 256, 227 * KIB + 1, opt_in=True, profile=H200)
    check_launch(1, 256, 99 * KIB, opt_in=True, profile=RTX_PRO_6000_BLACKWELL)
    with pytest.raises(LaunchConfigError, match="opt-in limit of 101376 B.*rtx-pro-6000"):
        check_launch(1, 256, 200 * KIB, opt_in=True, profile=RTX_PRO_6000_BLACKWELL)


dims = st.lists(st.integers(-2, 2**31 + 2), min_size=1, max_size=3)
small_dims = st.lists(st.integers(-1, 1100), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(grid=dims, block=small_dims, smem=st.integers(0, 240 * KIB), opt_in=st.booleans(), p=st.sampled_from(ALL))
def test_check_launch_accepts_exactly_the_valid_configs(grid, block, smem, opt_in, p):
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    valid = (
        all(v > 0 for v in g + b)
        and all(v <= lim for v, lim in zip(b, p.max_block_dim))
        and math.prod(b) <= p.max_threads_per_block
        and all(v <= lim for v, lim in zip(g, p.max_grid_dim))
        and smem <= (p.smem_per_block_optin if opt_in else p.smem_per_block_default)
    )
    if valid:
        assert check_launch(grid, block, smem, opt_in=opt_in, profile=p) == (g, b)
    else:
        with pytest.raises(LaunchConfigError):
            check_launch(grid, block, smem, opt_in=opt_in, profile=p)


# ------------------------------------------------------------------------------------------
# The simulator hook
# ------------------------------------------------------------------------------------------


@needs_sim
def test_hook_is_installed_and_idempotent():
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    hooked = FakeCUDAKernel.__getitem__
    assert getattr(hooked, "__ddtree_launch_check__", False)
    assert launch_mod.install_simulator_hook() is True
    assert FakeCUDAKernel.__getitem__ is hooked  # not wrapped twice


@needs_sim
@pytest.mark.parametrize(
    "config,match",
    [
        ((1, 2048), "2048 threads per block"),
        ((1, (32, 64)), "2048 threads per block"),
        ((1, (1, 1, 128)), "dimension z = 128"),
        ((0, 32), "griddim must be positive"),
        ((1, 32, 0, 64 * KIB), "65536 B .*limit of 49152 B"),
        ((1, 32, 0, 48 * KIB + 4), "49156 B"),
    ],
)
def test_hook_rejects_before_any_thread_runs(config, match):
    out = np.full(N_THREADS, SENTINEL, dtype=np.float32)
    with pytest.raises(LaunchConfigError, match=match):
        fill_thread_ids[config](out)
    assert np.all(out == SENTINEL)  # untouched: no simulated thread started


@needs_sim
def test_hook_rejects_malformed_configuration():
    with pytest.raises(LaunchConfigError, match="launch configuration"):
        fill_thread_ids[1,]
    with pytest.raises(LaunchConfigError, match="launch configuration"):
        fill_thread_ids[1, 32, 0, 0, 0]


def test_hook_accepts_valid_launches():
    out = np.full(N_THREADS, SENTINEL, dtype=np.float32)
    fill_thread_ids[1, N_THREADS](out)
    np.testing.assert_array_equal(out, np.arange(N_THREADS, dtype=np.float32))
    src = np.arange(N_THREADS, dtype=np.float32) * 3 + 1
    out2 = np.full(N_THREADS, SENTINEL, dtype=np.float32)
    copy_via_dynamic_smem[1, N_THREADS, 0, N_THREADS * 4](src, out2)
    np.testing.assert_array_equal(out2, src[::-1])


@needs_sim
def test_hook_resets_dynamic_shared_memory_like_a_gpu():
    assert fill_thread_ids[1, 32, 0, 256].dynshared_size == 256
    assert fill_thread_ids[1, 32].dynshared_size == 0
    assert fill_thread_ids[1, 32, 0, 128].dynshared_size == 128
    assert fill_thread_ids[1, 32, 0].dynshared_size == 0


# ------------------------------------------------------------------------------------------
# launch()
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [0, None])
def test_launch_helper_default_stream(stream):
    src = np.linspace(-1, 1, N_THREADS, dtype=np.float32)
    out = np.zeros(N_THREADS, dtype=np.float32)
    launch(copy_via_dynamic_smem, 1, N_THREADS, stream, N_THREADS * 4, src, out)
    np.testing.assert_array_equal(out, src[::-1])


def test_launch_helper_numba_stream_and_grid():
    stream = cuda.stream()
    # Device arrays: numba-cuda 0.30.4 on a GPU rejects host arrays on a non-default stream.
    out = cuda.to_device(np.full(3 * N_THREADS, SENTINEL, dtype=np.float32), stream=stream)
    launch(fill_thread_ids, (3,), (N_THREADS,), stream, 0, out, profile=RTX_PRO_6000_BLACKWELL)
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(3 * N_THREADS, dtype=np.float32))


@pytest.mark.parametrize(
    "grid,block,smem,exc",
    [(1, 1025, 0, LaunchConfigError), (1, 32, 49 * KIB, LaunchConfigError), (1, 32.0, 0, TypeError)],
)
def test_launch_helper_checks_before_launching(grid, block, smem, exc):
    out = np.full(N_THREADS, SENTINEL, dtype=np.float32)
    with pytest.raises(exc):
        launch(fill_thread_ids, grid, block, 0, smem, out)
    assert np.all(out == SENTINEL)


def test_launch_helper_rejects_none_arguments():
    """A None argument raises TypeError naming its position before anything runs, in the simulator
    as on a GPU: numba-cuda on a GPU cannot marshal None (NotImplementedError at the launch), and the
    simulator would pass it, hiding the bug from CI (the engine's MoE routing did, at c5f6b2e)."""
    out = np.full(N_THREADS, SENTINEL, dtype=np.float32)
    with pytest.raises(TypeError, match="argument 1 is None"):
        launch(copy_via_dynamic_smem, 1, N_THREADS, 0, N_THREADS * 4, out, None)
    assert np.all(out == SENTINEL)


def test_launch_bounds_options():
    """launch_bounds: the option the GPU needs (threads, or threads and the resident minimum), none
    under the simulator, which rejects it; the result is accepted by cuda.jit either way."""
    if cuda.config.ENABLE_CUDASIM:
        assert launch_mod.launch_bounds(256) == {} and launch_mod.launch_bounds(256, 1) == {}
    else:
        assert launch_mod.launch_bounds(256) == {"launch_bounds": 256}
        assert launch_mod.launch_bounds(512, 2) == {"launch_bounds": (512, 2)}
    kernel = cuda.jit(**launch_mod.launch_bounds(N_THREADS, 1))(fill_thread_ids.py_func)
    out = np.zeros(N_THREADS, np.float32)
    kernel[1, N_THREADS](out)
    assert np.array_equal(out, np.arange(N_THREADS, dtype=np.float32))


def test_opt_in_shared_registers_its_callback_once():
    """numba returns one cached configuration object per (grid, block, stream, smem): opting it
    in on every launch must not grow its callback list (it did, one entry a launch)."""
    class Configured:
        pre_launch_callbacks: list = []

    configured = Configured()
    configured.pre_launch_callbacks = []
    for _ in range(3):
        assert launch_mod.opt_in_shared(configured, 64 * KIB) is configured
    assert configured.pre_launch_callbacks == [launch_mod._raise_dynamic_limit]
    other = Configured()
    other.pre_launch_callbacks = []
    launch_mod.opt_in_shared(other, 0)   # nothing to raise
    assert other.pre_launch_callbacks == []
