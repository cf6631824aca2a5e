"""Golden store (ddtree_numba.golden) and the committed golden files (reference.golden_cases)."""
from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import xarray as xr

import reference
from ddtree_numba import golden
from ddtree_numba.golden import (
    SCHEMA_VERSION,
    GoldenFileError,
    assert_datasets_equal,
    file_attrs,
    list_cases,
    read_all,
    read_case,
    write_cases,
)
from reference.golden_cases import (
    CHECK_ATOL,
    CHECK_RTOL,
    GOLDEN_FILES,
    batch_from_vars,
    build_cases,
    check,
    regenerate,
    tree_from_vars,
)

REPO = Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO / "data" / "golden"


def _all_dtypes_case(seed: int, rows: int) -> xr.Dataset:
    """A dataset with every dtype the golden files use, plus special float values and edge sizes."""
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal((rows, 3)).astype(np.float32)  # [row, col]
    f64 = rng.standard_normal(rows) * 1e300  # [row]
    if rows:
        f32[0, 0] = np.nan
        f32[-1, -1] = -0.0
        f64[0] = -np.inf
        # A NaN with a non-default payload: only a bit-exact store keeps it.
        f64[-1] = np.array([0x7FF8_0000_DEAD_BEEF], np.uint64).view(np.float64)[0]
    return xr.Dataset(
        {
            "in_f32": (("row", "col"), f32),
            "in_f64": (("row",), f64),
            "out_i32": (("row",), rng.integers(-(2**31), 2**31 - 1, rows, dtype=np.int32)),
            "out_i64": (("row", "col"), rng.integers(-(2**62), 2**62, (rows, 3), dtype=np.int64)),
            "out_u32": (("row", "word"), rng.integers(0, 2**32, (rows, 2), dtype=np.uint32)),
            "out_u16": (("row",), rng.integers(0, 2**16, rows, dtype=np.uint16)),
            "out_bool": (("row", "col"), rng.random((rows, 3)) < 0.5),
            "empty": (("none", "col"), np.zeros((0, 3), np.float32)),
            "length": ((), np.int32(rows)),
        },
        coords={"col": np.array(["x", "yy", "zzz"])},
        attrs={"config": {"rows": rows, "k": np.int64(3), "dims": [1, 2]}, "seed": seed, "flag": True},
    )


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("seed,rows", [(0, 1), (1, 7), (2, 64), (3, 0)])
def test_round_trip_every_dtype_bit_exact(tmp_path: Path, seed: int, rows: int) -> None:
    case = _all_dtypes_case(seed, rows)
    path = write_cases(tmp_path / "store.h5", {"case_a": case})
    back = read_case(path, "case_a")
    assert_datasets_equal(case, back)
    for name, var in case.variables.items():
        assert back[name].dtype == var.dtype, name
        assert back[name].dims == var.dims, name
    if rows:
        nan_bits = back["in_f64"].values[-1:].view(np.uint64)[0]
        assert nan_bits == 0x7FF8_0000_DEAD_BEEF
        assert np.signbit(back["in_f32"].values[-1, -1])


def test_attrs_stored_as_json_and_ints(tmp_path: Path) -> None:
    config = {"budget": 12, "k": np.int32(4), "temps": [0.7, 1.3], "name": "equiprobable"}
    case = xr.Dataset({"x": (("i",), np.arange(3))}, attrs={"config": config, "greedy": False, "seed": np.uint8(9)})
    back = read_case(write_cases(tmp_path / "a.h5", {"c": case}), "c")
    assert isinstance(back.attrs["config"], str)
    assert json.loads(back.attrs["config"]) == {"budget": 12, "k": 4, "temps": [0.7, 1.3], "name": "equiprobable"}
    assert back.attrs["greedy"] == 0 and type(back.attrs["greedy"]) is int
    assert back.attrs["seed"] == 9 and type(back.attrs["seed"]) is int
    assert case.attrs["config"] is config  # the caller's dataset is not modified


def test_many_cases_listing_and_provenance(tmp_path: Path) -> None:
    cases = {f"case_{i}": _all_dtypes_case(i, i + 1) for i in (3, 0, 2)}
    path = write_cases(tmp_path / "many.h5", cases, attrs={"generator": "test"})
    assert list_cases(path) == ["case_0", "case_2", "case_3"]
    loaded = read_all(path)
    assert list(loaded) == ["case_0", "case_2", "case_3"]
    for name, ds in cases.items():
        assert_datasets_equal(ds, loaded[name])
    attrs = file_attrs(path)
    assert attrs["schema_version"] == SCHEMA_VERSION and attrs["generator"] == "test"
    assert attrs["numpy_version"] == np.__version__ and attrs["h5py_version"] == h5py.__version__
    assert {"xarray_version", "h5netcdf_version"} <= attrs.keys()
    created = datetime.datetime.fromisoformat(attrs["created"])
    assert created.utcoffset() == datetime.timedelta(0)


# --------------------------------------------------------------------------- atomicity


def _leftovers(directory: Path, keep: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != keep)


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "atomic.h5"
    old = {"old": _all_dtypes_case(5, 4)}
    write_cases(path, old)
    real_write_group = golden._write_group
    calls = []

    def failing_write_group(*args, **kwargs) -> None:
        calls.append(args[1])
        if len(calls) == 2:  # after one group is on disk: a crash mid-file
            raise OSError("disk full (simulated)")
        real_write_group(*args, **kwargs)

    monkeypatch.setattr(golden, "_write_group", failing_write_group)
    new = {"new_a": _all_dtypes_case(6, 3), "new_b": _all_dtypes_case(7, 3)}
    with pytest.raises(OSError, match="simulated"):
        write_cases(path, new)
    assert calls == ["new_a", "new_b"]
    assert _leftovers(tmp_path, "atomic.h5") == []
    back = read_all(path)
    assert list(back) == ["old"]
    assert_datasets_equal(old["old"], back["old"])


def test_invalid_input_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "never.h5"
    bad = _all_dtypes_case(0, 2).assign_attrs(note=None)
    with pytest.raises(TypeError, match="note"):
        write_cases(path, {"good": _all_dtypes_case(1, 2), "bad": bad})
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- input errors


@pytest.mark.parametrize(
    "value,error",
    [(None, TypeError), (np.arange(3), TypeError), (b"raw", TypeError), ({"x": None, "y": object()}, TypeError),
     ({"x": float("nan")}, ValueError), (2**70, ValueError)],
)
def test_bad_attribute_names_the_attribute(tmp_path: Path, value: object, error: type) -> None:
    case = xr.Dataset({"x": (("i",), np.arange(2))}, attrs={"bad_attr": value})
    with pytest.raises(error, match="bad_attr"):
        write_cases(tmp_path / "x.h5", {"c": case})
    var_case = xr.Dataset({"x": (("i",), np.arange(2), {"bad_attr": value})})
    with pytest.raises(error, match="bad_attr"):
        write_cases(tmp_path / "x.h5", {"c": var_case})
    assert list(tmp_path.iterdir()) == []


def test_bad_cases_rejected(tmp_path: Path) -> None:
    ok = xr.Dataset({"x": (("i",), np.arange(2))})
    with pytest.raises(ValueError, match="case name"):
        write_cases(tmp_path / "x.h5", {"a/b": ok})
    with pytest.raises(TypeError, match="cases"):
        write_cases(tmp_path / "x.h5", {"c": np.arange(2)})
    with pytest.raises(TypeError, match="'z'.*complex"):
        write_cases(tmp_path / "x.h5", {"c": ok.assign(z=(("i",), np.ones(2, np.complex64)))})
    with pytest.raises(ValueError, match="reserved"):
        write_cases(tmp_path / "x.h5", {"c": ok}, attrs={"schema_version": 2})
    with pytest.raises(ValueError, match="path"):
        write_cases(tmp_path / "missing_dir" / "x.h5", {"c": ok})
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- read errors


def _assert_golden_error(excinfo: pytest.ExceptionInfo, path: Path) -> None:
    message = str(excinfo.value)
    assert str(path) in message and "regenerate with: ddtree-numba golden regen" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.h5"
    for reader in (list_cases, read_all, lambda p: read_case(p, "c")):
        with pytest.raises(GoldenFileError) as excinfo:
            reader(path)
        _assert_golden_error(excinfo, path)
        assert "not found" in str(excinfo.value)


def test_non_hdf5_file(tmp_path: Path) -> None:
    path = tmp_path / "text.h5"
    path.write_text("this is not HDF5\n" * 10)
    with pytest.raises(GoldenFileError, match="not an HDF5 file") as excinfo:
        read_all(path)
    _assert_golden_error(excinfo, path)


@pytest.mark.parametrize("fraction", [0.3, 0.7, 0.95])
def test_truncated_file(tmp_path: Path, fraction: float) -> None:
    path = write_cases(tmp_path / "cut.h5", {f"c{i}": _all_dtypes_case(i, 50) for i in range(3)})
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(GoldenFileError, match="corrupt|truncated") as excinfo:
        read_all(path)
    _assert_golden_error(excinfo, path)


def test_corrupt_payload(tmp_path: Path) -> None:
    case = xr.Dataset({"x": (("i",), np.random.default_rng(0).standard_normal(4096))})
    path = write_cases(tmp_path / "flip.h5", {"c": case})
    data = bytearray(path.read_bytes())
    # Overwrite the gzip stream of the (single, large) chunk: the file still opens, the read fails.
    middle = len(data) // 2
    data[middle : middle + 256] = bytes(256)
    path.write_bytes(bytes(data))
    with pytest.raises(GoldenFileError) as excinfo:
        read_case(path, "c")
    _assert_golden_error(excinfo, path)


def test_missing_case_names_file_case_and_choices(tmp_path: Path) -> None:
    path = write_cases(tmp_path / "few.h5", {"alpha": _all_dtypes_case(0, 1), "beta": _all_dtypes_case(1, 1)})
    with pytest.raises(GoldenFileError) as excinfo:
        read_case(path, "gamma")
    _assert_golden_error(excinfo, path)
    assert "'gamma'" in str(excinfo.value) and "alpha, beta" in str(excinfo.value)


def test_schema_mismatch_and_foreign_hdf5(tmp_path: Path) -> None:
    path = write_cases(tmp_path / "old.h5", {"c": _all_dtypes_case(0, 2)})
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(GoldenFileError, match="schema version") as excinfo:
        read_case(path, "c")
    _assert_golden_error(excinfo, path)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(GoldenFileError, match="schema_version") as excinfo:
        list_cases(foreign)
    _assert_golden_error(excinfo, foreign)


# --------------------------------------------------------------------------- comparison


def test_assert_equal_reports_each_difference() -> None:
    a = _all_dtypes_case(11, 5)
    assert_datasets_equal(a, a.copy(deep=True))
    # One flipped low bit in one float: caught, with the position.
    b = a.copy(deep=True)
    b["in_f32"].values[2, 1] = np.nextafter(b["in_f32"].values[2, 1], np.float32(np.inf))
    with pytest.raises(AssertionError, match=r"'in_f32': values differ at 1 of 15 positions; first \(2, 1\)"):
        assert_datasets_equal(a, b)
    # A moved NaN, a dtype change, a missing variable, an attribute change: all listed at once.
    c = a.copy(deep=True)
    c["in_f64"].values[0] = np.nan
    c["out_i32"] = c["out_i32"].astype(np.int64)
    c = c.drop_vars("out_bool").assign_attrs(seed=12)
    with pytest.raises(AssertionError) as excinfo:
        assert_datasets_equal(a, c)
    message = str(excinfo.value)
    assert "NaN positions differ at 1" in message
    assert "'out_i32': dtype differs" in message
    assert "'out_bool' only in a" in message
    assert "'seed' differs: a=11 b=12" in message
    # Signed zero and float-vs-int attributes are differences too.
    d = a.copy(deep=True)
    d["in_f32"].values[-1, -1] = 0.0
    with pytest.raises(AssertionError, match="in_f32"):
        assert_datasets_equal(a, d)
    with pytest.raises(AssertionError, match="'seed'"):
        assert_datasets_equal(a, a.assign_attrs(seed=11.0))


def test_assert_equal_ignores_provenance_and_encoding_form() -> None:
    a = _all_dtypes_case(3, 2)
    b = a.assign_attrs(created="2020-01-01T00:00:00+00:00", generator="other", config=json.dumps(
        {"rows": 2, "k": 3, "dims": [1, 2]}, sort_keys=True), flag=1)
    assert_datasets_equal(a, b)


def test_large_arrays_compressed_small_ones_contiguous(tmp_path: Path) -> None:
    case = xr.Dataset({"big": (("i",), np.arange(4096, dtype=np.int32)), "small": (("j",), np.arange(8))})
    path = write_cases(tmp_path / "c.h5", {"c": case})
    with h5py.File(path, "r") as f:
        assert f["c/big"].compression == "gzip" and f["c/big"].shuffle
        assert f["c/small"].compression is None
    assert path.stat().st_mode & 0o777 == 0o644


# --------------------------------------------------------------------------- golden cases


@functools.cache
def _committed(family: str) -> dict[str, xr.Dataset]:
    """The committed cases of one family, read once per test session."""
    return read_all(GOLDEN_DIR / GOLDEN_FILES[family])


def _by_function(family: str, function) -> dict[str, xr.Dataset]:
    name = f"{function.__module__}.{function.__qualname__}"
    cases = {k: ds for k, ds in _committed(family).items() if ds.attrs["function"] == name}
    assert cases, f"no {family} case for {name}"
    return cases


def _args(ds: xr.Dataset, *names: str) -> list:
    """Reference-call arguments from input variables: 0-d variables as NumPy scalars."""
    return [ds[n].values[()] if ds[n].ndim == 0 else ds[n].values for n in names]


def _exact(actual: np.ndarray, ds: xr.Dataset, var: str) -> None:
    expected = ds[var].values
    assert actual.dtype == expected.dtype, var
    np.testing.assert_array_equal(actual, expected, err_msg=var)


def test_committed_files_match_regeneration() -> None:
    assert sorted(p.name for p in GOLDEN_DIR.glob("*.h5")) == sorted(GOLDEN_FILES.values())
    assert check(GOLDEN_DIR) == []


def test_cases_are_pure_well_formed_and_cover_the_reference() -> None:
    functions = set()
    for family in GOLDEN_FILES:
        first, second = build_cases(family), build_cases(family)
        assert list(first) == list(second)
        for name, ds in first.items():
            assert_datasets_equal(ds, second[name])
            assert set(ds.attrs) == {"config", "seed", "case", "function"}, name
            assert isinstance(json.loads(ds.attrs["config"]), dict)
            assert all(v.startswith(("in_", "out_")) for v in ds.data_vars), name
            assert any(v.startswith("out_") for v in ds.data_vars), name
            functions.add(ds.attrs["function"])
    expected = {
        f"{f.__module__}.{f.__qualname__}"
        for f in (reference.topk_log_probs, reference.float32_to_bf16, reference.build_tree,
                  reference.build_tree_batch, reference.verify_attention, reference.verify_attention_batch,
                  reference.accept, reference.accept_batch, reference.sample_posterior, reference.gumbel_noise,
                  reference.philox4x32, reference.compact, reference.compact_batch, reference.forward)
    }
    assert functions == expected


def test_regenerate_and_check_detect_changes(tmp_path: Path) -> None:
    paths = regenerate(tmp_path, names=["sampling", "compact"], progress=False)
    assert paths == [tmp_path / "sampling.h5", tmp_path / "compact.h5"]
    assert check(tmp_path, names=["sampling", "compact"]) == []
    with pytest.raises(GoldenFileError, match="topk.h5"):
        check(tmp_path, names=["topk"])
    with pytest.raises(ValueError, match="names"):
        regenerate(tmp_path, names=["nope"])
    with pytest.raises(TypeError, match="names"):
        check(tmp_path, names="tree")

    sampling = read_all(tmp_path / "sampling.h5")
    noise = sampling["gumbel"]["out_noise"].values  # [row, vocab] float64
    noise[2, 5] = np.nextafter(noise[2, 5], 0.0)
    write_cases(tmp_path / "sampling.h5", sampling)
    assert check(tmp_path, names=["sampling"]) == []  # a last-bit float64 difference is within the tolerance

    cases = read_all(tmp_path / "compact.h5")
    cases["single"]["out_cache"].values[8, 2] *= np.float32(1.001)
    cases["overlapping"]["in_accepted"].values[2] = 4
    del cases["noop_root"]
    cases["extra"] = cases["noop_all"]
    write_cases(tmp_path / "compact.h5", cases)
    problems = check(tmp_path, names=["compact"])
    assert len(problems) == 4, problems
    assert any(p.startswith("compact.h5:single: variable 'out_cache': values differ beyond") for p in problems)
    assert any(p.startswith("compact.h5:overlapping: variable 'in_accepted': values differ at 1 of 5")
               for p in problems)
    assert "compact.h5:noop_root: missing from the file" in problems
    assert "compact.h5:extra: in the file but no longer built" in problems


# Each committed case re-checked against the reference function directly: load the inputs, call,
# compare. Kernel tests follow the same pattern with the kernel in place of the reference.


def test_topk_cases_against_reference() -> None:
    for name, ds in _by_function("topk", reference.topk_log_probs).items():
        values, ids = reference.topk_log_probs(ds["in_logits"].values, int(ds["in_k"]))
        _exact(ids, ds, "out_ids")
        np.testing.assert_allclose(values, ds["out_values"].values, rtol=1e-6, err_msg=name)
        assert ids.shape == (ds.sizes["position"], min(int(ds["in_k"]), ds.sizes["vocab"]))
    ties = _committed("topk")["bf16_ties"]
    _exact(reference.bf16_to_float32(ties["in_logits_bf16"].values), ties, "in_logits")
    values, ids = ties["out_values"].values, ties["out_ids"].values
    tied = values[:, 1:] == values[:, :-1]  # [L, k - 1]
    assert tied.sum() >= 10  # the case really is tie-heavy
    assert np.all(ids[:, 1:][tied] > ids[:, :-1][tied])  # equal values: lower id first

    rounding = _committed("topk")["bf16_round"]
    bits = reference.float32_to_bf16(rounding["in_x"].values)
    _exact(bits, rounding, "out_bits")
    # 1.0 exact; 1 + 2^-8 ties to even (down); 1 + 3 * 2^-8 ties to even (up); just above a tie; inf; -inf.
    assert bits[2:8].tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x7F80, 0xFF80]
    assert np.isnan(rounding["out_widened"].values[8]) and bits[9] == 0x7F80  # NaN stays NaN; 3.4e38 -> inf


def _assert_tree_invariants(parents: np.ndarray, depths: np.ndarray, vis: np.ndarray) -> None:
    assert parents[0] == -1 and depths[0] == 0
    for i in range(1, parents.size):
        assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1
        np.testing.assert_array_equal(vis[i, :i], vis[parents[i], :i])
    assert np.all(np.diag(vis)) and not np.any(np.triu(vis, 1))


def test_tree_cases_against_reference() -> None:
    fields = ("tokens", "parents", "depths", "ranks", "scores", "visibility", "child_ptr", "child_index")
    for name, ds in _by_function("tree", reference.build_tree).items():
        tree = reference.build_tree(ds["in_top_log_probs"].values, ds["in_top_ids"].values,
                                    int(ds["in_budget"]), int(ds["in_root_token"]))
        for field in fields:
            _exact(getattr(tree, field), ds, f"out_{field}")
        _exact(reference.pack_visibility(tree.visibility), ds, "out_visibility_packed")
        unpacked = reference.unpack_visibility(ds["out_visibility_packed"].values, tree.n_nodes)
        np.testing.assert_array_equal(unpacked, tree.visibility)
        assert tree.n_nodes <= 1 + int(ds["in_budget"]), name
        _assert_tree_invariants(tree.parents, tree.depths, tree.visibility)

    cases = _committed("tree")
    equi = cases["equiprobable"]  # spec §1.2 heap tie order
    assert equi["out_depths"].values.tolist() == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert equi["out_parents"].values.tolist() == [-1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert equi["out_ranks"].values.tolist() == [0, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert cases["v2_exhaustion"].sizes["node"] == 1 + 14
    assert cases["budget_eq_l"]["out_parents"].values.tolist() == [-1, 0, 0, 1]  # not a chain
    assert cases["token0"].sizes["node"] == 5 and np.count_nonzero(cases["token0"]["out_tokens"].values == 0) >= 2
    assert cases["budget0"].sizes["node"] == 1
    assert cases["random_multiword"].sizes["word"] == 3

    batch_ds = cases["batch_ragged"]
    batch = reference.build_tree_batch(batch_ds["in_top_log_probs"].values, batch_ds["in_top_ids"].values,
                                       batch_ds["in_budgets"].values, batch_ds["in_root_tokens"].values,
                                       int(batch_ds["in_capacity"]))
    for field in ("sizes",) + fields:
        _exact(getattr(batch, field), batch_ds, f"out_{field}")
    _exact(reference.pack_visibility(batch.visibility), batch_ds, "out_visibility_packed")
    assert batch.sizes.tolist() == [13, 1, 31] and batch.capacity == 40
    for b, n in enumerate(batch.sizes):
        np.testing.assert_array_equal(batch.visibility[b, n:], np.eye(40, dtype=bool)[n:])  # padding: self only
        assert np.all(batch.parents[b, n:] == -1) and np.all(batch.tokens[b, n:] == -1)


def test_attention_cases_against_reference() -> None:
    args = ("in_q_latent", "in_q_rope", "in_kv_latent", "in_k_rope", "in_visibility", "in_scale")
    for name, ds in _by_function("attention", reference.verify_attention).items():
        out, lse = reference.verify_attention(*_args(ds, *args))
        np.testing.assert_allclose(out, ds["out_out"].values, rtol=CHECK_RTOL, atol=CHECK_ATOL, err_msg=name)
        np.testing.assert_allclose(lse, ds["out_lse"].values, rtol=CHECK_RTOL, atol=CHECK_ATOL, err_msg=name)
        assert out.dtype == np.float64 and ds.sizes["key"] >= ds.sizes["node"]
    kimi = _committed("attention")["kimi_dims"]
    assert (kimi.sizes["latent"], kimi.sizes["rope"], kimi.sizes["key"] - kimi.sizes["node"]) == (512, 64, 40)
    assert _committed("attention")["n0"].sizes["key"] == _committed("attention")["n0"].sizes["node"]

    ds = _committed("attention")["batch_ragged"]
    names = ("in_q_latent", "in_q_rope", "in_kv_latent", "in_k_rope", "in_past_lens", "in_tree_sizes",
             "in_visibility", "in_scale")
    out, lse = reference.verify_attention_batch(*_args(ds, *names))
    np.testing.assert_allclose(out, ds["out_out"].values, rtol=CHECK_RTOL, atol=CHECK_ATOL)
    np.testing.assert_allclose(lse, ds["out_lse"].values, rtol=CHECK_RTOL, atol=CHECK_ATOL)
    for b, t in enumerate(ds["in_tree_sizes"].values):
        assert not np.any(out[b, t:]) and not np.any(lse[b, t:])  # padding rows and the idle slot are zero


def test_accept_cases_against_reference() -> None:
    for name, ds in _by_function("accept", reference.accept).items():
        tree = tree_from_vars(ds, "in_tree_")
        post = ds["in_posterior_tokens"].values
        result = reference.accept(post, tree)
        _exact(result.accepted, ds, "out_accepted")
        assert result.length == int(ds["out_length"]) and result.bonus == int(ds["out_bonus"]), name
        assert result.bonus == post[result.accepted[-1]]
        assert np.all(tree.depths[result.accepted] == np.arange(result.length))  # one node per depth
    cases = _committed("accept")
    full = cases["full_depth"]
    assert int(full["out_length"]) == 1 + int(full["in_tree_depths"].max())
    assert int(cases["root_only"]["out_length"]) == 1
    assert max(int(cases[n]["out_length"]) for n in ("random_a", "random_b", "random_c")) >= 3

    ds = cases["batch"]
    accepted, lengths, bonus = reference.accept_batch(ds["in_posterior_tokens"].values, batch_from_vars(ds, "in_tree_"))
    _exact(accepted, ds, "out_accepted")
    _exact(lengths, ds, "out_lengths")
    _exact(bonus, ds, "out_bonus")
    assert lengths[1] == 1  # the budget-0 request accepts only its root


def test_sampling_cases_against_reference() -> None:
    for name, ds in _by_function("sampling", reference.sample_posterior).items():
        tokens = reference.sample_posterior(ds["in_logits"].values, float(ds["in_temperature"]),
                                            int(ds["in_seed"]), ds["in_positions"].values)
        _exact(tokens, ds, "out_tokens")
    greedy = _committed("sampling")["greedy"]
    logits = greedy["in_logits"].values
    assert np.any(np.sum(logits == logits.max(axis=1, keepdims=True), axis=1) > 1)  # tied maxima present
    _exact(np.argmax(logits, axis=1), greedy, "out_tokens")  # first maximum = lowest id
    sampled = _committed("sampling")["t0_7"]
    assert not np.array_equal(sampled["out_tokens"].values, np.argmax(sampled["in_logits"].values, axis=1))

    gumbel = _committed("sampling")["gumbel"]
    noise = reference.gumbel_noise(int(gumbel["in_seed"]), gumbel["in_positions"].values, int(gumbel["in_vocab_size"]))
    np.testing.assert_allclose(noise, gumbel["out_noise"].values, rtol=CHECK_RTOL, atol=CHECK_ATOL)
    np.testing.assert_array_equal(noise[1], noise[2])  # equal positions draw equal noise

    philox = _committed("sampling")["philox"]
    bits = reference.philox4x32(philox["in_counter"].values, philox["in_key"].values)
    _exact(bits, philox, "out_bits")
    random123_kat = [  # Random123 kat_vectors, philox4x32_10
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ]
    assert bits[:3].tolist() == random123_kat


def test_compact_cases_against_reference() -> None:
    for name, ds in _by_function("compact", reference.compact).items():
        cache, past, acc = ds["in_cache"].values, int(ds["in_past_len"]), ds["in_accepted"].values
        out = reference.compact(cache, past, acc)
        _exact(out, ds, "out_cache")
        np.testing.assert_array_equal(out[past:past + acc.size], cache[past + acc])
        np.testing.assert_array_equal(out[past + acc.size:], cache[past + acc.size:])
    cases = _committed("compact")
    for name in ("noop_all", "noop_root"):
        _exact(cases[name]["in_cache"].values, cases[name], "out_cache")
    for name, ds in _by_function("compact", reference.compact_batch).items():
        out = reference.compact_batch(*_args(ds, "in_cache", "in_past_lens", "in_accepted", "in_lengths"))
        _exact(out, ds, "out_cache")
    assert cases["batch_bf16"]["out_cache"].dtype == np.uint16
