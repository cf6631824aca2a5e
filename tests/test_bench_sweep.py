"""Sweep layer: Dataset structure, units, bounds, peers and provenance, with fake timers (no GPU)."""
import dataclasses
import json
import math

import numpy as np
import pytest
import xarray as xr
from numba import cuda

from ddtree_numba.bench import roofline as rf
from ddtree_numba.bench import sweep
from sim.profiles import H200, RTX_PRO_6000_BLACKWELL, roofline


def _series(base: float, n: int) -> list[float]:
    """n positive, distinct repetition times around ``base`` (shuffled, so order means nothing)."""
    rng = np.random.default_rng(int(base * 1000) % 2**32)
    return list(rng.permutation(base * (1.0 + 0.01 * np.arange(n))))


def fake_backend(profile=H200, torch_missing: bool = False, fail_steps: bool = False) -> sweep.Backend:
    """Times that are simple functions of the case, so tests can recompute every derived value."""

    def topk(rows, dtype, budgets, grid):
        return {b: {"gpu": _series(rows * (2 if dtype == "fp32" else 1) + b, grid.reps),
                    "torch": [] if torch_missing else _series(50.0 * rows, grid.reps)} for b in budgets}

    def numpy_topk(horizon, dtype, budgets, grid):
        return {b: _series(1000.0 * horizon + b, grid.cpu_reps) for b in budgets}

    def tree_build(batch, horizon, budgets, grid):
        return {b: {"graph": _series(0.4 * b + batch, grid.reps), "launch": _series(0.4 * b + 30, grid.reps)}
                for b in budgets}

    def cpu_copy(rows, grid):
        return _series(10.0 * rows, grid.cpu_reps)

    def cpu_requests(horizon, budgets, grid):
        return {b: (_series(3000.0 + horizon, grid.cpu_requests), _series(2.0 * b, grid.cpu_requests))
                for b in budgets}

    def verify(batch, tree, n, grid):
        base = 1e-6 * batch * tree * (n + tree)
        return {"gpu": _series(base, grid.reps), "torch_fp32": _series(3 * base, grid.reps),
                "torch_bf16": [] if torch_missing else _series(base, grid.reps),
                "out_err": 1e-6 * tree, "lse_err": 1e-7}

    def accept_compact(batch, budget, grid):
        out = {"accept_walk": (_series(5.0, grid.reps), 0),
               "walk+compact": (_series(15.0, grid.reps), 4096 * batch)}
        if not (fail_steps and budget > 32):  # the posterior is skipped where logits are too big
            out["posterior_argmax"] = (_series(0.5 * budget * batch, grid.reps), 10**6 * batch * budget)
        return out

    return sweep.Backend(topk, numpy_topk, tree_build, cpu_copy, cpu_requests, verify, accept_compact, profile)


GRID = sweep.Grid(batch=(1, 8), budget=(8, 64, 1024), block=(8, 16), n_cached=(1024, 65536), reps=20,
                  cpu_requests=3, cpu_reps=2)


def _check_units(ds):
    for name, var in ds.data_vars.items():
        assert var.attrs.get("units"), name
        assert var.attrs.get("long_name"), name


def _check_bounds(ds, profile):
    bw, peak = rf.ceilings(profile)
    mem = ds["bytes"] / bw * 1e6
    comp = ds["flops"] / peak * 1e6
    np.testing.assert_allclose(ds["memory_bound_us"], mem)
    np.testing.assert_allclose(ds["compute_bound_us"], comp)
    measured = np.isfinite(ds["median_us"]) & (ds["bound_us"] > 0)
    np.testing.assert_allclose(ds["fraction_of_bound"].where(measured),
                               (np.maximum(mem, comp) / ds["median_us"]).where(measured))


def test_topk_sweep_dims_stats_bounds_and_peers():
    ds = sweep.sweep_topk(GRID, fake_backend())
    assert dict(ds.sizes) == {"batch": 2, "block": 2, "budget": 3, "dtype": 2, "rep": 20}
    assert ds["median_us"].dims == ("batch", "block", "budget", "dtype")
    assert list(ds["k"].values) == [8, 64, 1024]
    np.testing.assert_array_equal(ds["rows"], [[7, 15], [56, 120]])
    times = ds["times_us"]
    np.testing.assert_allclose(ds["median_us"], times.median("rep"))
    np.testing.assert_allclose(ds["min_us"], times.min("rep"))
    np.testing.assert_allclose(ds["max_us"], times.max("rep"))
    case = ds.sel(batch=8, block=16, budget=64, dtype="bf16")
    assert float(case["bytes"]) == 120 * sweep.VOCAB * 2 + 120 * 64 * 8
    # One read at the profile's measured bandwidth: the number PERFORMANCE.md called "one read".
    assert float(case["memory_bound_us"]) == pytest.approx(
        roofline(H200, float(case["bytes"]), 0.0).t_memory_s * 1e6)
    _check_bounds(ds, H200)
    np.testing.assert_allclose(ds["speedup_vs_torch"], ds["torch_median_us"] / ds["median_us"])
    # The host peer is one request's median x batch.
    per_request = np.median(_series(1000.0 * 15 + 64, 2))
    assert float(case["numpy_us"]) == pytest.approx(8 * per_request)
    np.testing.assert_allclose(ds["speedup_vs_numpy"], ds["numpy_us"] / ds["median_us"])
    _check_units(ds)
    grid = json.loads(ds.attrs["grid"])
    assert grid["budget"] == [8, 64, 1024] and ds.attrs["benchmark"] == "sweep_topk"
    assert ds.attrs["profile"] == "h200" and ds.attrs["bandwidth_Bps"] == H200.hbm_bandwidth_measured


def test_topk_sweep_without_torch_leaves_the_peer_nan():
    ds = sweep.sweep_topk(dataclasses.replace(GRID, dtype=("fp32",)), fake_backend(torch_missing=True))
    assert np.isnan(ds["torch_median_us"]).all() and np.isnan(ds["speedup_vs_torch"]).all()
    assert np.isfinite(ds["median_us"]).all()


def test_tree_build_sweep_head_to_head_uses_the_runs_topk():
    backend = fake_backend(profile=RTX_PRO_6000_BLACKWELL)
    topk = sweep.sweep_topk(GRID, backend)
    ds = sweep.sweep_tree_build(GRID, backend, topk)
    assert ds["median_us"].dims == ("batch", "block", "budget")
    assert ds["cpu_copy_us"].dims == ("batch", "block")
    np.testing.assert_allclose(ds["gpu_topk_us"], topk["median_us"].sel(dtype="fp32"))
    np.testing.assert_allclose(ds["gpu_path_us"], ds["gpu_topk_us"] + ds["median_us"])
    np.testing.assert_allclose(ds["cpu_path_us"], ds["cpu_copy_us"] + ds["cpu_topk_us"] + ds["cpu_heap_us"])
    np.testing.assert_allclose(ds["speedup_path"], ds["cpu_path_us"] / ds["gpu_path_us"])
    np.testing.assert_allclose(ds["speedup_build"], ds["cpu_heap_us"] / ds["median_us"])
    case = ds.sel(batch=8, block=8, budget=1024)
    assert float(case["cpu_heap_us"]) == pytest.approx(8 * np.mean(_series(2048.0, 3)))
    assert float(case["bytes"]) == rf.tree_build_cost(8, 7, 1024, 1024)[0]
    assert (ds["flops"] == 0).all()
    _check_bounds(ds, RTX_PRO_6000_BLACKWELL)
    _check_units(ds)


def test_tree_build_sweep_without_topk_has_nan_gpu_path():
    ds = sweep.sweep_tree_build(GRID, fake_backend(), None)
    assert np.isnan(ds["gpu_path_us"]).all() and np.isfinite(ds["speedup_build"]).all()


def test_verify_sweep_skips_cases_predicted_too_slow_and_reports_tflops():
    grid = dataclasses.replace(GRID, budget=(8, 512), max_call_ms=5.0)
    ds = sweep.sweep_verify_attention(grid, fake_backend())
    assert list(ds["tree"].values) == [9, 513]
    for idx in np.ndindex(ds["measured"].shape):
        batch, budget, n = (ds[d].values[i] for d, i in zip(("batch", "budget", "n_cached"), idx))
        slow = sweep.predicted_verify_ms(H200, int(batch), int(budget) + 1, int(n)) > 5.0
        assert ds["measured"].values[idx] == (0 if slow else 1)
        assert np.isnan(ds["median_us"].values[idx]) == slow
    assert 0 < int(ds["measured"].sum()) < ds["measured"].size
    assert float(ds["flops"].sel(batch=8, budget=8, n_cached=1024)) == \
        2.0 * 9 * 64 * (1024 + 9) * 1088 * 8
    np.testing.assert_allclose(ds["tflops"], ds["flops"] / ds["median_us"] / 1e6)
    np.testing.assert_allclose(ds["speedup_vs_torch_fp32"], ds["torch_fp32_median_us"] / ds["median_us"])
    assert ds["compute_bound_us"].sel(batch=1, budget=8, n_cached=65536) > \
        ds["memory_bound_us"].sel(batch=1, budget=8, n_cached=65536)  # compute-bound (limits §3)
    _check_bounds(ds, H200)
    _check_units(ds)


def test_accept_compact_sweep_steps_union_and_latency_bound_steps():
    ds = sweep.sweep_accept_compact(GRID, fake_backend(fail_steps=True))
    assert list(ds["step"].values) == ["accept_walk", "walk+compact", "posterior_argmax"]
    walk = ds.sel(step="accept_walk")
    assert np.isnan(walk["bound_us"]).all() and np.isfinite(walk["median_us"]).all()
    argmax = ds.sel(step="posterior_argmax")
    assert np.isfinite(argmax["median_us"].sel(budget=8)).all()
    assert np.isnan(argmax["median_us"].sel(budget=1024)).all()
    _check_bounds(ds, H200)
    _check_units(ds)


def test_run_sweeps_writes_one_group_per_sweep_with_provenance(tmp_path):
    out = tmp_path / "sweeps.h5"
    lines = []
    done = sweep.run_sweeps(["tree_build", "accept_compact"], {k: GRID for k in sweep.KERNELS}, fake_backend(), out,
                            command=["ddtree-numba", "bench", "sweep", "--kernel", "tree_build"], echo=lines.append)
    assert list(done) == ["topk", "tree_build", "accept_compact"]
    assert list(done["topk"]["dtype"].values) == ["fp32"]  # the tree build's own top-k sweep
    with xr.open_datatree(out, engine="h5netcdf") as tree:
        # the tree build's own fp32 top-k stays inside its Dataset: no second sweep_topk group
        assert sorted(tree.children) == ["sweep_accept_compact", "sweep_tree_build"]
        (name,) = tree["sweep_tree_build"].children
        ds = tree[f"sweep_tree_build/{name}"].to_dataset()
        for key in ("git_sha", "gpu", "driver", "cuda_driver_api", "packages", "nvjitlink", "date", "command", "grid"):
            assert key in ds.attrs, key
        assert ds.attrs["command"] == "ddtree-numba bench sweep --kernel tree_build"
        assert "numpy" in json.loads(ds.attrs["packages"])
        assert ds["median_us"].attrs["units"] == "us" and ds["bytes"].attrs["units"] == "B"
        np.testing.assert_allclose(ds["speedup_path"], done["tree_build"]["speedup_path"])
    assert any(line.startswith(f"wrote {out}:sweep_tree_build/") for line in lines)


def test_grid_validation_names_the_field():
    with pytest.raises(ValueError, match="reps"):
        sweep.Grid(reps=5)
    with pytest.raises(ValueError, match="budget"):
        sweep.Grid(budget=(8, 2048))
    with pytest.raises(ValueError, match="block"):
        sweep.Grid(block=(1,))
    with pytest.raises(ValueError, match="dtype"):
        sweep.Grid(dtype=("fp16",))


def test_command_line_overrides_and_quick_grids():
    args = sweep.build_parser().parse_args(["--kernel", "topk", "--quick", "--batch", "2,4", "--reps", "25"])
    grids = sweep.grids_from_args(args)
    assert grids["topk"].batch == (2, 4) and grids["topk"].reps == 25
    assert grids["topk"].budget == sweep.GRIDS["topk"]["quick"].budget
    assert sweep.grids_from_args(sweep.build_parser().parse_args([]))["tree_build"] == sweep.GRIDS["tree_build"]["default"]
    with pytest.raises(SystemExit):
        sweep.build_parser().parse_args(["--dtype", "fp16"])


@pytest.mark.skipif(not cuda.config.ENABLE_CUDASIM, reason="checks the simulator refusal")
def test_kernel_sweeps_refuse_the_simulator(capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--kernel", "topk", "--quick"])
    assert exc.value.code == 2 and "need a CUDA GPU" in capsys.readouterr().err


def test_default_grids_cover_the_issue_dimensions():
    g = sweep.GRIDS
    assert g["topk"]["default"].batch == (1, 8, 64) and g["topk"]["default"].dtype == ("fp32", "bf16")
    assert min(g["tree_build"]["default"].budget) == 8 and max(g["tree_build"]["default"].budget) == 1024
    assert g["tree_build"]["default"].block == (8, 16)
    assert min(g["verify_attention"]["default"].n_cached) == 1024
    assert max(g["verify_attention"]["default"].n_cached) == 131072
    # Predicted verify time of the default grid (GPU only, x reps + warm-up) stays well under 90 s.
    v = g["verify_attention"]["default"]
    total_ms = sum(ms for b in v.batch for B in v.budget for n in v.n_cached
                   if (ms := sweep.predicted_verify_ms(H200, b, B + 1, n)) <= v.max_call_ms)
    assert total_ms * (v.reps + v.warmup) / 1e3 < 30.0
    assert math.isfinite(total_ms)
