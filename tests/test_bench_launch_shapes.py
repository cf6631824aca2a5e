"""bench.launch_shapes: its routings, its variants (the plan's is expert_linear's launch) and its
argument checks. The timing itself needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_numba.bench import launch_shapes as ls
from ddtree_numba.kernels import linear as lin


@pytest.mark.parametrize("rows, experts, top_k, seed", [(1, 16, 4, 0), (33, 16, 4, 1), (7, 5, 5, 2)])
def test_routing_is_a_csr_of_distinct_experts(rows, experts, top_k, seed):
    offsets, index, counts = ls.routing(rows, experts, top_k, seed)
    assert offsets[0] == 0 and offsets[-1] == rows * top_k and np.all(np.diff(offsets) == counts)
    assert sorted(index.tolist()) == sorted(list(range(rows)) * top_k)
    for e in range(experts):   # rows ascending within an expert, each row at most once
        rows_e = index[offsets[e]:offsets[e + 1]]
        assert np.all(np.diff(rows_e) > 0)


@pytest.mark.parametrize("rows, n_cols, k_dim, entries", [(1, 512, 2048, 4), (4, 2048, 256, 4),
                                                          (33, 512, 2048, 132), (132, 2048, 256, 132)])
def test_plan_variant_is_what_expert_linear_launches(rows, n_cols, k_dim, entries):
    variants = {name: (grid, threads) for name, grid, threads in ls.expert_variants(rows, n_cols, k_dim, entries, 16)}
    mt = lin.row_tile(rows, k_dim, "expert")
    _, grid, threads, _, _ = lin._setup("expert", "none", False, mt, n_cols, k_dim, True,   # expert_linear's call
                                        lin.expert_slots(entries, 16, mt), busy=lin.expert_wave_tiles(entries, 16, mt))
    assert variants["plan"] == (grid, threads)
    assert variants["loose"][0][0] == -(-entries // mt) + min(16, entries) >= grid[0]
    for name, (grid_v, threads_v) in variants.items():
        if name.startswith("g"):
            assert grid_v[0] == grid[0] and threads_v % 32 == 0 and threads_v <= lin.BLOCK_WARPS * 32


@pytest.mark.parametrize("argv", [[], ["--expert", "--reps", "5"], ["--posterior", "--seeds", "0"],
                                  ["--expert", "--rows", "0"], ["--expert", "--preset", "no-such-preset"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        ls.main(argv)
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" not in err   # refused for the argument, before the device check
    if "--preset" in argv:
        assert "--preset" in err and "no-such-preset" in err


def test_needs_a_gpu(capsys):
    from numba import cuda

    if not cuda.config.ENABLE_CUDASIM:
        pytest.skip("the simulator's refusal")
    with pytest.raises(SystemExit):
        ls.main(["--expert"])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_results_go_to_hdf5_with_provenance(tmp_path):
    """to_dataset + write_run: one case per result, the bit check kept, the run's arguments and
    provenance in the group's attributes (read back)."""
    import argparse
    import json

    import xarray as xr

    from ddtree_numba.bench.common import write_run

    results = [dict(kernel="expert_down", rows=1, seed=0, variant=v, grid_x=4, grid_y=y, threads=256, tiles=4,
                    median_us=t, min_us=t - 0.1, same_bits=True) for v, y, t in (("plan", 33, 8.1), ("loose", 26, 9.7))]
    group = write_run(tmp_path / "shapes.h5", ls.to_dataset(results, argparse.Namespace(expert=True, rows=[1])))
    with xr.open_dataset(tmp_path / "shapes.h5", group=group, engine="h5netcdf") as back:
        assert back.attrs["benchmark"] == "launch_shapes" and json.loads(back.attrs["config"])["rows"] == [1]
        assert "git_sha" in back.attrs and list(back["variant"].values) == ["plan", "loose"]
        assert back["same_bits"].values.all() and back["median_us"].values.tolist() == [8.1, 9.7]
