"""bench.stream_floor: its stream and empty kernels' results (simulator and GPU alike), its fit,
its sizing rules, its arguments and its HDF5 output. The timing itself needs a GPU."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.bench import stream_floor as sf


@pytest.mark.parametrize("unroll, blocks, threads, n_vec", [(1, 1, 32, 5), (4, 2, 32, 37), (8, 3, 64, 400),
                                                             (3, 2, 32, 0)])
def test_stream_kernel_sums_every_float_once(unroll, blocks, threads, n_vec):
    """Thread sums add up to the buffer's first 4 n_vec floats (whole rounds, the partial round,
    and an empty buffer), whatever the unroll and grid; floats past them are not read."""
    rng = np.random.default_rng(unroll * 100 + n_vec)
    host = rng.integers(-8, 9, 4 * n_vec + 12).astype(np.float32)   # integers: every sum exact
    host[4 * n_vec:] = np.nan                                        # past n_vec: must not be read
    out = cuda.to_device(np.full(blocks * threads, np.nan, np.float32))
    sf.get_stream_kernel(unroll)[blocks, threads](cuda.to_device(host), np.int64(n_vec), out)
    got = out.copy_to_host()
    assert np.isfinite(got).all()
    assert got.astype(np.float64).sum() == host[:4 * n_vec].astype(np.float64).sum()


def test_empty_kernel_writes_one_value_a_block():
    out = cuda.to_device(np.full(3, np.nan, np.float32))
    sf.get_empty_kernel()[3, 32](out)
    assert out.copy_to_host().tolist() == [0.0, 0.0, 0.0]


def test_fit_recovers_a_line():
    sizes = np.array([4e6, 11e6, 64e6, 268e6])
    a, bw = sf.fit_line(sizes, 7.5 + sizes / 3.0e6)     # 3.0e6 bytes a us = 3000 GB/s
    assert a == pytest.approx(7.5) and bw == pytest.approx(3000.0)
    assert all(np.isnan(v) for v in sf.fit_line([4e6], [9.0]))
    assert all(np.isnan(v) for v in sf.fit_line([4e6, 4e6], [9.0, 9.5]))


@pytest.mark.parametrize("size, l2", [(1 << 20, 50 << 20), (268 << 20, 50 << 20), (11 << 20, 60 << 20), (1000, 60 << 20)])
def test_a_graph_reads_past_the_l2_within_bounds(size, l2):
    n = sf.launches_for(size, l2)
    assert sf.MIN_LAUNCHES <= n <= sf.MAX_LAUNCHES
    assert n * size >= sf.L2_PASSES * l2 or n == sf.MAX_LAUNCHES


@pytest.mark.parametrize("cols", [[128], [128, 32768], [1344, 2048]])
def test_pool_holds_two_of_the_largest_slice_and_the_l2s(cols):
    l2 = 50 << 20
    floats = sf.pool_floats(cols, l2)
    slice_floats = sf.K_DIM * max(cols)
    assert floats // slice_floats >= 2 and 4 * floats >= sf.L2_PASSES * l2 - 4 * 4 * sf.K_DIM
    assert floats % (4 * sf.K_DIM) == 0


@pytest.mark.parametrize("argv, name", [(["--cols", "0"], "--cols"), (["--variants", "stream,copy"], "--variants"),
                                        (["--unroll", "0"], "--unroll"), (["--blocks-per-sm", "9"], "--blocks-per-sm"),
                                        (["--reps", "2"], "--reps"), (["--forward", "78"], "--forward"),
                                        (["--forward", "0,10"], "--forward")])
def test_bad_arguments_are_refused_before_the_device_check(argv, name, capsys):
    with pytest.raises(SystemExit):
        sf.main(argv)
    err = capsys.readouterr().err
    assert name in err and "needs a CUDA GPU" not in err


def test_needs_a_gpu(capsys):
    if not cuda.config.ENABLE_CUDASIM:
        pytest.skip("the simulator's refusal")
    with pytest.raises(SystemExit):
        sf.main([])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_results_go_to_hdf5_with_provenance(tmp_path):
    import xarray as xr

    from ddtree_numba.bench.common import write_run

    results = [dict(variant="empty", cols=128, bytes=0, launches=157, median_us=1.1, min_us=1.0, max_us=1.4,
                    gbps=0.0, checked=True)]
    results += [dict(variant=v, cols=c, bytes=4 * sf.K_DIM * c, launches=40, median_us=t, min_us=t - 0.2,
                     max_us=t + 0.3, gbps=4 * sf.K_DIM * c / t / 1e3, checked=True)
                for v, c, t in (("stream", 128, 4.0), ("stream", 1344, 7.0), ("gemv", 1344, 11.0))]
    args = argparse.Namespace(unroll=8, blocks_per_sm=4, reps=20, variants=["empty", "stream", "gemv"],
                              forward=(78, 1463.0))
    fits = {"stream": (3.0, 2800.0)}
    group = write_run(tmp_path / "floor.h5", sf.to_dataset(results, fits, args))
    with xr.open_dataset(tmp_path / "floor.h5", group=group, engine="h5netcdf") as back:
        assert back.attrs["benchmark"] == "stream_floor" and "git_sha" in back.attrs
        assert json.loads(back.attrs["config"])["forward"] == [78, 1463.0]
        assert list(back["variant"].values) == ["empty", "stream", "gemv"] and list(back["cols"].values) == [128, 1344]
        assert back["median_us"].sel(variant="gemv", cols=1344) == 11.0
        assert np.isnan(back["median_us"].sel(variant="gemv", cols=128))
        assert not bool(back["checked"].sel(variant="gemv", cols=128))
        assert back["fit_intercept_us"].sel(variant="stream") == 3.0 and np.isnan(back["fit_gbps"].sel(variant="gemv"))
