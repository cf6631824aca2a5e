"""Golden store: named cases as xarray Datasets, one HDF5 group per case (h5netcdf engine).

The store knows nothing about DDTree. A golden file holds a root group with provenance
attributes (schema version, generator, package versions, creation date) and one group per case;
each case is an ``xr.Dataset`` whose variables are stored bit for bit (stack §7):

- variable dtypes: bool, signed / unsigned integers, float16/32/64, unicode strings;
  no ``_FillValue`` is written and none is applied on read, so NaN payloads survive;
- arrays of 1 KiB or more are gzip (level 4) + shuffle compressed;
- attributes: ``str``, ``int``, ``float`` as themselves; ``bool`` as 0/1 (HDF5 has no bool
  attribute, stack §7); ``dict`` / ``list`` / ``tuple`` as JSON strings (sorted keys). Anything
  else (``None``, arrays, bytes, ...) raises ``TypeError`` naming the attribute;
- files are written to a temp file in the target directory, fsynced, then ``os.replace``-d,
  so a crash never leaves a half-written golden file.

Reading a missing, non-HDF5, truncated or wrong-schema file, or a missing case, raises
:class:`GoldenFileError` naming the file (and case) and the fix.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5netcdf
import h5py
import numpy as np
import xarray as xr

from ddtree_numba.atomic import atomic_path

SCHEMA_VERSION = 1
REGEN_HINT = "regenerate with: ddtree-numba golden regen"

# Root-group attributes describing how a file was made; never compared.
PROVENANCE_ATTRS = frozenset(
    {
        "schema_version",
        "generator",
        "created",
        "numpy_version",
        "xarray_version",
        "h5netcdf_version",
        "h5py_version",
    }
)

_COMPRESSION = {"compression": "gzip", "compression_opts": 4, "shuffle": True}
# Smaller arrays are stored contiguous: a chunk index costs more bytes than gzip saves on them.
_COMPRESS_MIN_BYTES = 1024
_NUMERIC_KINDS = "biuf"  # bool, int, uint, float: compressible, compared bit for bit
_SUPPORTED_KINDS = _NUMERIC_KINDS + "U"
_CASE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Errors h5py / h5netcdf / xarray raise on unreadable or damaged HDF5 content.
_READ_ERRORS = (OSError, ValueError, KeyError, RuntimeError)

PathLike = str | os.PathLike


class GoldenFileError(Exception):
    """A golden file is missing, unreadable, of another schema, or lacks a case.

    The message names the file (and case) and ends with the fix (:data:`REGEN_HINT`).
    """

    def __init__(self, path: PathLike, problem: str, case: str | None = None) -> None:
        self.path = Path(path)
        self.case = case
        where = f"{self.path}" if case is None else f"{self.path} (case {case!r})"
        super().__init__(f"{where}: {problem}; {REGEN_HINT}")


# --------------------------------------------------------------------------- attributes


def _json_default(value: Any) -> Any:
    """JSON hook: NumPy scalars become Python scalars; anything else is unsupported."""
    if isinstance(value, (np.bool_, np.integer, np.floating)):
        return value.item()
    raise TypeError(f"type {type(value).__name__} is not JSON serialisable")


def encode_attr(name: str, value: Any) -> str | int | float:
    """The stored (canonical) form of one attribute value.

    Args:
        name: attribute name, used in error messages.
        value: ``str``, ``bool``, ``int``, ``float`` (Python or NumPy scalar), or a
            ``dict`` / ``list`` / ``tuple`` of JSON-serialisable values.

    Returns:
        ``str`` (strings and JSON), ``int`` (ints, bools as 0/1) or ``float``.

    Raises:
        TypeError: unsupported type (e.g. ``None``, arrays, bytes), naming the attribute.
        ValueError: an int outside int64, or NaN / inf inside a JSON value.
    """
    if isinstance(value, (str, np.str_)):
        return str(value)
    if isinstance(value, (bool, np.bool_)):
        return int(bool(value))
    if isinstance(value, (int, np.integer)):
        as_int = int(value)
        if not _INT64_MIN <= as_int <= _INT64_MAX:
            raise ValueError(f"attribute {name!r}: integer {as_int} does not fit in int64")
        return as_int
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, sort_keys=True, allow_nan=False, default=_json_default)
        except TypeError as exc:
            raise TypeError(f"attribute {name!r}: cannot store as JSON: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"attribute {name!r}: cannot store as JSON: {exc}") from None
    raise TypeError(
        f"attribute {name!r}: unsupported type {type(value).__name__} "
        "(use str, int, float, bool, or a dict/list for JSON)"
    )


def encode_attrs(attrs: Mapping[str, Any], where: str = "") -> dict[str, str | int | float]:
    """Encode every attribute of a mapping (see :func:`encode_attr`); ``where`` prefixes names."""
    encoded = {}
    for key, value in attrs.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}attribute name {key!r} must be str")
        encoded[key] = encode_attr(f"{where}{key}", value)
    return encoded


def _decode_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Read-side attributes as plain Python scalars (h5netcdf returns NumPy scalars)."""
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in attrs.items()}


# --------------------------------------------------------------------------- writing


def _validate_case(name: Any, ds: Any) -> None:
    """Raise before any work if a case name or its dataset cannot be stored faithfully."""
    if not isinstance(name, str):
        raise TypeError(f"cases: case name {name!r} must be str")
    if not _CASE_NAME.match(name):
        raise ValueError(f"cases: case name {name!r} must match {_CASE_NAME.pattern}")
    if not isinstance(ds, xr.Dataset):
        raise TypeError(f"cases[{name!r}]: expected xarray.Dataset, got {type(ds).__name__}")
    for var_name, var in ds.variables.items():
        if var.dtype.kind not in _SUPPORTED_KINDS:
            raise TypeError(
                f"cases[{name!r}] variable {var_name!r}: unsupported dtype {var.dtype} "
                "(bool, int, uint, float or str)"
            )


def _prepare_case(name: str, ds: xr.Dataset) -> tuple[xr.Dataset, dict[str, dict]]:
    """The dataset with encoded attributes and no inherited encoding, plus its write encoding."""
    ds = ds.copy(deep=False).drop_encoding()  # new Variables: the caller's attrs stay untouched
    ds.attrs = encode_attrs(ds.attrs, where=f"{name}: ")
    for var_name, var in ds.variables.items():
        var.attrs = encode_attrs(var.attrs, where=f"{name}/{var_name}: ")
    encoding = {}
    for var_name, var in ds.variables.items():
        enc: dict[str, Any] = {"_FillValue": None}  # no masking: NaN bits survive
        # Scalars cannot be chunked (hence compressed) in HDF5; small arrays are not worth it.
        if var.dtype.kind in _NUMERIC_KINDS and var.ndim > 0 and var.nbytes >= _COMPRESS_MIN_BYTES:
            enc.update(_COMPRESSION)
        encoding[var_name] = enc
    return ds, encoding


def provenance_attrs() -> dict[str, str | int]:
    """Root attributes recording how a file was made (not compared by :func:`assert_datasets_equal`)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "generator": "ddtree_numba.golden",
        "numpy_version": np.__version__,
        "xarray_version": xr.__version__,
        "h5netcdf_version": h5netcdf.__version__,
        "h5py_version": h5py.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _write_root(tmp: Path, attrs: dict[str, Any]) -> None:
    """Create the file with its root attributes."""
    xr.Dataset(attrs=attrs).to_netcdf(tmp, engine="h5netcdf", mode="w")


def _write_group(tmp: Path, name: str, ds: xr.Dataset, encoding: dict[str, dict]) -> None:
    """Append one case as group ``/name`` (one group per case, stack §7)."""
    ds.to_netcdf(tmp, engine="h5netcdf", group=name, mode="a", encoding=encoding)


def write_cases(
    path: PathLike, cases: Mapping[str, xr.Dataset], *, attrs: Mapping[str, Any] | None = None
) -> Path:
    """Write all cases of one golden file atomically.

    Args:
        path: the ``.h5`` file to create or replace; its directory must exist.
        cases: case name -> Dataset; names match ``[A-Za-z0-9_][A-Za-z0-9_.-]*``.
        attrs: extra root attributes (e.g. ``generator``); ``schema_version`` is reserved.

    Returns:
        The written path.

    Raises:
        TypeError / ValueError: bad path, case name, dtype or attribute, before anything is
            written; the old file (if any) is untouched and no temp file remains on any error.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"path: directory {path.parent} does not exist")
    if not isinstance(cases, Mapping):
        raise TypeError(f"cases: expected a mapping of name -> Dataset, got {type(cases).__name__}")
    if attrs is not None and not isinstance(attrs, Mapping):
        raise TypeError(f"attrs: expected a mapping, got {type(attrs).__name__}")
    if attrs is not None and "schema_version" in attrs:
        raise ValueError("attrs: 'schema_version' is reserved")
    for name, ds in cases.items():
        _validate_case(name, ds)
    root_attrs = encode_attrs({**provenance_attrs(), **(attrs or {})}, where="file: ")
    prepared = {name: _prepare_case(name, ds) for name, ds in cases.items()}

    with atomic_path(path) as tmp:
        _write_root(tmp, root_attrs)
        for name, (ds, encoding) in prepared.items():
            _write_group(tmp, name, ds, encoding)
    return path


# --------------------------------------------------------------------------- reading


def _inspect(path: PathLike) -> tuple[Path, dict[str, Any], list[str]]:
    """Check that ``path`` is a readable golden file of this schema.

    Returns:
        (path, root attributes, sorted case names).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not path.is_file():
        raise GoldenFileError(path, "file not found")
    if not h5py.is_hdf5(path):
        raise GoldenFileError(path, "not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            root = {k: v for k, v in f.attrs.items() if not k.startswith("_")}
            names = sorted(k for k, v in f.items() if isinstance(v, h5py.Group))
    except _READ_ERRORS as exc:
        raise GoldenFileError(path, f"corrupt or truncated HDF5 file ({exc})") from None
    root = {k: (v.item() if isinstance(v, np.ndarray) and v.size == 1 else v) for k, v in root.items()}
    root = _decode_attrs(root)
    version = root.get("schema_version")
    if version is None:
        raise GoldenFileError(path, "no schema_version attribute (not a golden file)")
    if version != SCHEMA_VERSION:
        raise GoldenFileError(path, f"schema version {version}, this code reads {SCHEMA_VERSION}")
    return path, root, names


def _load_group(path: Path, name: str) -> xr.Dataset:
    """Load one case fully into memory; the file is closed on return."""
    try:
        with xr.open_dataset(
            path,
            engine="h5netcdf",
            group=name,
            mask_and_scale=False,  # no _FillValue masking: values come back bit for bit
            decode_times=False,
            decode_timedelta=False,
        ) as ds:
            ds = ds.load()
    except _READ_ERRORS as exc:
        raise GoldenFileError(path, f"cannot read case ({exc})", case=name) from None
    ds = ds.drop_encoding()
    ds.attrs = _decode_attrs(ds.attrs)
    for var in ds.variables.values():
        var.attrs = _decode_attrs(var.attrs)
    return ds


def file_attrs(path: PathLike) -> dict[str, Any]:
    """Root (provenance and caller) attributes of a golden file."""
    return _inspect(path)[1]


def list_cases(path: PathLike) -> list[str]:
    """Sorted case names of a golden file."""
    return _inspect(path)[2]


def read_case(path: PathLike, name: str) -> xr.Dataset:
    """One case, fully loaded (the file is closed on return).

    Raises:
        GoldenFileError: missing / corrupt / wrong-schema file, or no such case.
    """
    path, _, names = _inspect(path)
    if name not in names:
        raise GoldenFileError(path, f"no such case (cases: {', '.join(names) or 'none'})", case=name)
    return _load_group(path, name)


def read_all(path: PathLike) -> dict[str, xr.Dataset]:
    """Every case of a golden file, by sorted name, fully loaded."""
    path, _, names = _inspect(path)
    return {name: _load_group(path, name) for name in names}


# --------------------------------------------------------------------------- comparing


def _attr_equal(x: Any, y: Any) -> bool:
    """Canonical attribute equality: same kind (str / int / float) and value, NaN equal to NaN."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y


def _attrs_diff(label: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Differences between two attribute mappings, compared in stored form, provenance ignored."""
    ea = {k: v for k, v in encode_attrs(a).items() if k not in PROVENANCE_ATTRS}
    eb = {k: v for k, v in encode_attrs(b).items() if k not in PROVENANCE_ATTRS}
    lines = [f"{label}: attribute {k!r} only in a" for k in sorted(ea.keys() - eb.keys())]
    lines += [f"{label}: attribute {k!r} only in b" for k in sorted(eb.keys() - ea.keys())]
    for k in sorted(ea.keys() & eb.keys()):
        if not _attr_equal(ea[k], eb[k]):
            lines.append(f"{label}: attribute {k!r} differs: a={ea[k]!r} b={eb[k]!r}")
    return lines


def _bits(values: np.ndarray) -> np.ndarray:
    """Floats as same-width unsigned ints, so NaN payloads and signed zeros compare exactly."""
    if values.dtype.kind == "f":
        return values.view(f"u{values.dtype.itemsize}")
    return values


def _differs(x: np.ndarray, y: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """bool mask of differing elements: bit for bit, or floats outside ``atol + rtol * |y|``
    when a tolerance is given (NaN and infinity positions must still match)."""
    if x.dtype.kind == "f" and (rtol or atol):
        return ~np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    return _bits(x) != _bits(y)


def _values_diff(label: str, x: np.ndarray, y: np.ndarray, rtol: float, atol: float, show: int = 5) -> str | None:
    """One line describing where two same-shape, same-dtype arrays differ, or None."""
    differs = _differs(x, y, rtol, atol)
    count = int(np.count_nonzero(differs))
    if count == 0:
        return None
    where = np.argwhere(differs)[:show]
    samples = ", ".join(
        f"{tuple(int(i) for i in idx)}: a={x[tuple(idx)].item()!r} b={y[tuple(idx)].item()!r}" for idx in where
    )
    beyond = f" beyond rtol={rtol:g}, atol={atol:g}" if x.dtype.kind == "f" and (rtol or atol) else ""
    line = f"{label}: values differ{beyond} at {count} of {x.size} positions; first {samples}"
    if x.dtype.kind == "f":
        nan_moved = int(np.count_nonzero(np.isnan(x) != np.isnan(y)))
        finite = np.isfinite(x) & np.isfinite(y)
        max_abs = float(np.max(np.abs(x[finite].astype(np.float64) - y[finite]), initial=0.0))
        line += f"; NaN positions differ at {nan_moved}; max |a-b| over finite = {max_abs:.3g}"
    return line


def _variable_diff(label: str, va: xr.Variable, vb: xr.Variable, rtol: float, atol: float) -> list[str]:
    """Differences in dims, dtype, shape, values and attributes of one variable."""
    if va.dims != vb.dims:
        return [f"{label}: dims differ: a={va.dims} b={vb.dims}"]
    if va.dtype != vb.dtype:
        return [f"{label}: dtype differs: a={va.dtype} b={vb.dtype}"]
    if va.shape != vb.shape:
        return [f"{label}: shape differs: a={va.shape} b={vb.shape}"]
    lines = _attrs_diff(label, va.attrs, vb.attrs)
    values = _values_diff(label, np.asarray(va.values), np.asarray(vb.values), rtol, atol)
    return lines + ([values] if values else [])


def _names_diff(kind: str, a: Any, b: Any) -> list[str]:
    """Names present in only one of two collections."""
    lines = [f"{kind} {k!r} only in a" for k in sorted(set(a) - set(b), key=str)]
    return lines + [f"{kind} {k!r} only in b" for k in sorted(set(b) - set(a), key=str)]


def _check_tolerance(value: Any, name: str) -> float:
    """A finite tolerance >= 0, as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not 0.0 <= value < math.inf:
        raise ValueError(f"{name}: must be finite and >= 0, got {value}")
    return float(value)


def datasets_diff(a: xr.Dataset, b: xr.Dataset, *, rtol: float = 0.0, atol: float = 0.0) -> list[str]:
    """Every difference between two datasets (see :func:`assert_datasets_equal`); empty if equal."""
    if not isinstance(a, xr.Dataset) or not isinstance(b, xr.Dataset):
        raise TypeError(f"a, b: expected two xarray.Dataset, got {type(a).__name__}, {type(b).__name__}")
    rtol, atol = _check_tolerance(rtol, "rtol"), _check_tolerance(atol, "atol")
    lines = _names_diff("dimension", a.sizes, b.sizes)
    lines += [
        f"dimension {d!r} size differs: a={a.sizes[d]} b={b.sizes[d]}"
        for d in sorted(set(a.sizes) & set(b.sizes), key=str)
        if a.sizes[d] != b.sizes[d]
    ]
    lines += _names_diff("coordinate", a.coords, b.coords)
    lines += _names_diff("variable", a.data_vars, b.data_vars)
    for kind, ca, cb in (("coordinate", a.coords, b.coords), ("variable", a.data_vars, b.data_vars)):
        for name in sorted(set(ca) & set(cb), key=str):
            lines += _variable_diff(f"{kind} {name!r}", ca[name].variable, cb[name].variable, rtol, atol)
    return lines + _attrs_diff("dataset", a.attrs, b.attrs)


def assert_datasets_equal(a: xr.Dataset, b: xr.Dataset, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Assert two datasets are identical: dims, dtypes and values bit for bit (NaN positions
    included), coordinates, and attributes in stored form (provenance attributes ignored).

    Args:
        a, b: the datasets (``b`` is the reference for ``rtol``).
        rtol, atol: if either is > 0, floating variables only need ``|a - b| <= atol + rtol * |b|``
            (NaN and infinity positions still exact); integers, bools and strings stay exact.

    Raises:
        AssertionError: listing every difference, one per line.
    """
    lines = datasets_diff(a, b, rtol=rtol, atol=atol)
    if lines:
        raise AssertionError("datasets differ:\n  " + "\n  ".join(lines))
