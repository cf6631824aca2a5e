"""The HDF5 run store (bench.common): every stored run opens with xarray; copy_runs merges runs."""
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from ddtree_numba.bench.common import copy_runs, run_groups, write_run

STORES = sorted((Path(__file__).resolve().parents[1] / "data" / "bench").glob("*.h5"))


@pytest.mark.parametrize("store", STORES, ids=lambda p: p.name)
def test_every_stored_run_opens_with_xarray(store):
    """The stores are read with xarray (README, PERFORMANCE): each group opens, has provenance and
    holds at least one variable."""
    groups = run_groups(store)
    assert groups
    for group in groups:
        with xr.open_dataset(store, group=group, engine="h5netcdf") as ds:
            assert ds.data_vars, group
            assert "git_sha" in ds.attrs and "date" in ds.attrs, group


def test_copy_runs_merges_through_xarray(tmp_path):
    src, dst = tmp_path / "device.h5", tmp_path / "store.h5"
    ds = xr.Dataset({"median_us": ("case", np.array([1.5, 2.5]))},
                    coords={"case": ["a", "b"]}, attrs={"benchmark": "demo"})
    first = write_run(src, ds)
    second = write_run(src, ds.assign(median_us=ds.median_us * 2))
    write_run(dst, ds)
    assert copy_runs(src, dst, note="call 1") == [first, second]
    assert copy_runs(src, dst) == []                   # already there: left as it is
    assert run_groups(dst)[-2:] == [first, second]
    with xr.open_dataset(dst, group=second, engine="h5netcdf") as got:
        np.testing.assert_array_equal(got.median_us.values, [3.0, 5.0])
        assert list(got.case.values) == ["a", "b"] and got.attrs["note"] == "call 1"


def test_provenance_names_the_nvjitlink_that_links_the_kernels(monkeypatch) -> None:
    """The nvJitLink library (version and file) is provenance: its ptxas makes the machine code.
    Where it cannot be found the attribute says so instead of stopping a benchmark."""
    import re

    from ddtree_numba.bench import common
    from sim.sass import nvjitlink_version

    value = common.provenance(["x"])["nvjitlink"]
    major, minor = nvjitlink_version()
    try:   # where the library loads, the attribute must name it
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nvJitLink")
        loads = (major, minor) != (0, 0)
    except Exception:   # noqa: BLE001 - no nvJitLink on this machine
        loads = False
    if loads:
        assert re.fullmatch(rf"{major}\.{minor} \(.*libnvJitLink.*\)", value), value
    else:
        assert value == "unknown"
    import cuda.pathfinder

    def missing(name):
        raise RuntimeError(f"no {name}")

    monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", missing)
    assert common.provenance(["x"])["nvjitlink"] == "unknown"
