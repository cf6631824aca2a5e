"""What every benchmark shares: provenance, the HDF5 run store and CUDA-graph replay timing.

A sweep is an xarray Dataset written as one group ``/<benchmark>/<UTC timestamp>_<git sha>`` of an
HDF5 file (engine h5netcdf), so one file accumulates the runs of every benchmark and a reader picks
one (numba-stack.md §7).
Each run carries its provenance as attributes: git sha, GPU, compute capability, driver and CUDA
versions, package versions, the nvJitLink that links the kernels (version and file), date, host and
the exact command.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ddtree_numba.atomic import atomic_path

PACKAGES = ("numba", "numba-cuda", "numpy", "cuda-core", "cuda-bindings", "nvidia-nvjitlink", "xarray", "h5netcdf",
            "h5py", "llvmlite", "torch")


def git_sha() -> str:
    """The checkout's commit (``DDTREE_GIT_SHA`` wins: the GPU machine gets a copy without .git)."""
    if os.environ.get("DDTREE_GIT_SHA"):
        return os.environ["DDTREE_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _gpu() -> dict[str, str]:
    """GPU name, compute capability, driver and CUDA versions of the current device."""
    from sim.detect import gpu_available, simulator_requested

    if simulator_requested() or not gpu_available():
        what = "numba-cuda simulator" if simulator_requested() else "none"
        return {"gpu": what, "compute_capability": "", "driver": "", "cuda_driver_api": ""}
    from numba import cuda

    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    info = {"gpu": name, "compute_capability": "%d.%d" % dev.compute_capability}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=20)
        info["driver"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        info["driver"] = "unknown"
    try:
        version = cuda.cudadrv.driver.driver.get_version()
        info["cuda_driver_api"] = "%d.%d" % tuple(version)
    except Exception:  # noqa: BLE001 - provenance must never stop a benchmark
        info["cuda_driver_api"] = "unknown"
    return info


def nvjitlink_info() -> str:
    """The nvJitLink library numba links kernels with at launch (LTO): its version and file. Its
    ptxas decides the machine code, e.g. whether gemv's first weight loads stay before the PDL wait
    (PERFORMANCE.md, run branches), and it is not a Python package's version."""
    from sim.sass import nvjitlink_version

    major, minor = nvjitlink_version()
    if (major, minor) == (0, 0):   # no nvJitLink loads
        return "unknown"
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        path = load_nvidia_dynamic_lib("nvJitLink").abs_path
    except Exception:  # noqa: BLE001 - provenance must never stop a benchmark
        return "unknown"
    return f"{major}.{minor} ({path or 'path unknown'})"


def provenance(command: list[str] | None = None) -> dict[str, str]:
    """Attributes that say where, when and with what a number was measured (strings only)."""
    return {
        "git_sha": git_sha(),
        **_gpu(),
        "packages": json.dumps(_versions(), sort_keys=True),
        "nvjitlink": nvjitlink_info(),
        "python": platform.python_version(),
        "host": platform.node(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(command if command is not None else [Path(sys.argv[0]).name] + sys.argv[1:]),
    }


def write_run(path: str | Path, ds, *, command: list[str] | None = None) -> str:
    """Append ``ds`` (an xarray Dataset) with provenance as a new group; return the group name.

    The group is ``<ds.attrs["benchmark"]>/<UTC timestamp, microseconds>_<short git sha>[-dirty]``.

    The file is copied to a temp file, the group appended there, then renamed over the original
    (:func:`ddtree_numba.atomic.atomic_path`): a crash never leaves a half-written file.
    """
    path = Path(path)
    attrs = provenance(command)
    ds = ds.assign_attrs({**ds.attrs, **attrs})
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%f")
    sha, _, dirty = attrs["git_sha"].partition("-")
    group = f"{ds.attrs.get('benchmark', 'runs')}/{stamp}_{sha[:12]}{'-' + dirty if dirty else ''}"
    with atomic_path(path, copy_existing=True) as tmp:
        ds.to_netcdf(tmp, group=group, mode="a" if tmp.exists() else "w", engine="h5netcdf")
    return group


def run_groups(path: str | Path) -> list[str]:
    """The ``<benchmark>/<run>`` groups of an HDF5 run store, in file order."""
    import h5py

    with h5py.File(path, "r") as h5:
        return [f"{bench}/{run}" for bench in h5 for run in h5[bench]]


def copy_runs(src: str | Path, dst: str | Path, groups: list[str] | None = None, *,
              note: str | None = None) -> list[str]:
    """Copy runs (default: all of ``src``'s) into the store ``dst`` through xarray, as a device
    run's file is merged into ``data/bench``; an existing group is left as it is. ``note`` becomes
    each copied run's ``note`` attribute. Returns the groups copied.

    Through xarray, not ``h5py.Group.copy``: an h5py copy keeps the netCDF dimension scales'
    object references, which point into the source file, so xarray cannot open the copy (19 runs
    of ``data/bench/h200.h5`` were rebuilt from their dimension ids on 2026-12-04 for that).
    """
    import xarray as xr

    groups = run_groups(src) if groups is None else list(groups)
    have = set(run_groups(dst)) if Path(dst).exists() else set()
    todo = [g for g in groups if g not in have]
    if not todo:
        return []
    with atomic_path(dst, copy_existing=True) as tmp:
        for group in todo:
            with xr.open_dataset(src, group=group, engine="h5netcdf") as ds:
                ds = ds.load()
            if note is not None:
                ds.attrs["note"] = note
            ds.to_netcdf(tmp, group=group, mode="a" if tmp.exists() else "w", engine="h5netcdf")
    return todo


def add_pdl_release_argument(parser: Any, applies_to: str) -> None:
    """``--pdl-release``: kernels.pdl.set_release_mode's policy for programmatic launches (the
    kernels compile it in, so a process runs one); ``applies_to`` says which runs it concerns."""
    from ddtree_numba.kernels.pdl import RELEASE_MODES

    parser.add_argument("--pdl-release", choices=RELEASE_MODES, default="early",
                        help=f"{applies_to}: when a kernel's blocks let the next grid launch (kernels.pdl."
                             "set_release_mode): early (default: right after the wait where the launch asks, "
                             "before a 1-row gemv or split absorb, which the engine does only with "
                             "engine.model.PDL_RELEASE_EARLY on, off by default, as in forward_ab's /pdl; at the "
                             "exits elsewhere), exit (every kernel at its blocks' exits) or start (every kernel right "
                             "after its wait); one per process, since the kernels compile it in")


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers ("1,33")."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def summarize(times_us) -> dict[str, float]:
    """Median / min / max of a list of times in microseconds."""
    arr = np.asarray(times_us, dtype=np.float64)
    return {"median_us": float(np.median(arr)), "min_us": float(arr.min()), "max_us": float(arr.max())}


def graph_replay_times(enqueue: Callable[[int, Any], None], launches: int, reps: int) -> list[float]:
    """Microseconds per ``enqueue(i, stream)`` from ``reps`` replays of one CUDA graph holding
    ``launches`` of them (i = 0 .. launches - 1), captured on a ``cuda.core`` GraphBuilder: the
    GPU's time as a captured decode step sees it, without the host's per-call work. CUDA events
    around each replay on a fresh stream after a warm-up replay; the caller has compiled and
    loaded every kernel first (an eager call), since a capture must not."""
    from cuda.core import Device, EventOptions

    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    builder = dev.create_graph_builder()
    builder.begin_building()
    try:
        for i in range(launches):
            enqueue(i, builder)
    finally:  # end the capture even when a launch failed, so later work is not captured
        builder.end_building()
    graph = builder.complete()
    graph.upload(stream)
    graph.launch(stream)  # warm-up replay
    stream.sync()
    timing = EventOptions(timing_enabled=True)
    times = []
    for _ in range(reps):
        e0 = stream.record(options=timing)
        graph.launch(stream)
        e1 = stream.record(options=timing)
        e1.sync()
        times.append((e1 - e0) * 1e3 / launches)
    graph.close()
    return times
