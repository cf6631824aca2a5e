"""``ddtree-numba plot``: figures (PNG) from the sweep files written by ``ddtree-numba bench sweep``.

For each sweep benchmark the latest group found in the given files is used (groups are named
``<UTC timestamp>_<sha>``, so the name orders them). Figures, when their sweep is present:

- ``topk_vs_budget.png``: top-k median time vs budget (k) per batch, with the roofline bound;
- ``topk_vs_rows.png``: top-k time vs rows (batch x L) per dtype, with the one-read bound;
- ``tree_build_vs_budget.png``: tree-build time vs budget per batch, with the bound;
- ``tree_build_speedup.png``: CPU path / GPU path (and heap / build) vs budget per batch;
- ``verify_attention_tflops.png``: verify-attention TFLOP/s vs N per (batch, T), with the FP32 peak;
- ``accept_compact_vs_budget.png``: accept / compaction / posterior step times vs budget, with bounds;
- ``budget_tradeoff.png``: tokens/s and target forwards vs budget per oracle accuracy, AR lines.

Each PNG is written atomically (temp file, then rename).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ddtree_numba.atomic import atomic_path

DEFAULT_FILES = (Path(__file__).resolve().parent.parent / "data" / "bench",)
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "figures"
DPI = 120


def latest_runs(paths: Iterable[str | Path]) -> dict[str, Any]:
    """{benchmark: Dataset} of the latest group of each ``sweep_*`` benchmark over ``paths``
    (files, or directories whose ``*.h5`` files are read)."""
    import xarray as xr

    found: dict[str, tuple[str, Path]] = {}
    for path in _expand(paths):
        with xr.open_datatree(path, engine="h5netcdf") as tree:
            for name, node in tree.children.items():
                if not name.startswith("sweep_") or not node.children:
                    continue
                run = max(node.children)
                if name not in found or run > found[name][0]:
                    found[name] = (run, path)
    out = {}
    for name, (run, path) in found.items():
        with xr.open_dataset(path, group=f"{name}/{run}", engine="h5netcdf") as ds:
            out[name] = ds.load()
    return out


def _expand(paths: Iterable[str | Path]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.h5"))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"files: {p} does not exist")
    return files


def _figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (6.4, 4.4)) -> tuple[Any, np.ndarray]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * cols, size[1] * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).reshape(rows, cols)
    return fig, axes


def save_png(fig: Any, path: Path) -> Path:
    """Write ``fig`` as PNG to ``path`` atomically."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return path


def _provenance(ds: Any) -> str:
    return f"{ds.attrs.get('gpu', '?')}, {str(ds.attrs.get('git_sha', '?'))[:12]}, {ds.attrs.get('date', '?')}"


def _single() -> tuple[Any, Any]:
    """A one-axes figure: (figure, axes)."""
    fig, axes = _figure()
    return fig, axes[0, 0]


def _finish(ax: Any, xlabel: str, ylabel: str, title: str, *, ylog: bool = True, legend_size: int = 7,
            ncol: int = 1) -> None:
    """The axes every figure shares: log2 x (log y unless ``ylog`` is false), labels, grid, title, legend."""
    ax.set_xscale("log", base=2)
    if ylog:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size, ncol=ncol)


def _largest(ds: Any, dim: str) -> Any:
    return ds[dim].values.max() if dim in ds.dims else None


def _time_vs_budget(ds: Any, title: str, select: dict) -> Any:
    fig, ax = _single()
    sub = ds.sel(select) if select else ds
    for i, batch in enumerate(sub["batch"].values):
        row = sub.sel(batch=batch)
        line, = ax.plot(row["budget"], row["median_us"], "o-", label=f"bs {batch}")
        ax.plot(row["budget"], row["bound_us"], "--", color=line.get_color(), alpha=0.7,
                label="roofline bound" if i == 0 else None)
    _finish(ax, "budget B", "time (us)",
            f"{title} ({', '.join(f'{k} {v}' for k, v in select.items())})\n{_provenance(ds)}", legend_size=8)
    return fig


def fig_topk_vs_budget(ds: Any) -> Any:
    dtype = "bf16" if "bf16" in ds["dtype"].values else ds["dtype"].values[0]
    return _time_vs_budget(ds, "fused top-k", {"block": _largest(ds, "block"), "dtype": dtype})


def fig_topk_vs_rows(ds: Any) -> Any:
    fig, ax = _single()
    budget = 32 if 32 in ds["budget"].values else ds["budget"].values[0]
    for dtype in ds["dtype"].values:
        sub = ds.sel(budget=budget, dtype=dtype).stack(case=("batch", "block"))
        order = np.argsort(sub["rows"].values)
        rows = sub["rows"].values[order]
        line, = ax.plot(rows, sub["median_us"].values[order], "o-", label=f"{dtype}")
        ax.plot(rows, sub["memory_bound_us"].values[order], "--", color=line.get_color(), alpha=0.7,
                label=f"one read, {dtype}")
    _finish(ax, "rows (batch x L)", "time (us)",
            f"fused top-k, k = {min(int(budget), int(ds.attrs.get('vocab', budget)))}\n{_provenance(ds)}",
            legend_size=8)
    return fig


def fig_tree_build_vs_budget(ds: Any) -> Any:
    return _time_vs_budget(ds, "GPU tree build", {"block": _largest(ds, "block")})


def fig_tree_build_speedup(ds: Any) -> Any:
    fig, ax = _single()
    sub = ds.sel(block=_largest(ds, "block"))
    for batch in sub["batch"].values:
        row = sub.sel(batch=batch)
        line, = ax.plot(row["budget"], row["speedup_path"], "o-", label=f"bs {batch}: copy + top-k + heap")
        ax.plot(row["budget"], row["speedup_build"], "s--", color=line.get_color(), alpha=0.6,
                label=f"bs {batch}: heap build only")
    ax.axhline(1.0, color="k", lw=0.8)
    _finish(ax, "budget B", "speedup of the GPU over the CPU path (x)",
            f"GPU top-k + tree build vs the official CPU path (block {int(sub['block'])})\n{_provenance(ds)}")
    return fig


def fig_verify_tflops(ds: Any) -> Any:
    fig, ax = _single()
    for batch in ds["batch"].values:
        for budget in ds["budget"].values:
            row = ds.sel(batch=batch, budget=budget)
            if not np.isfinite(row["tflops"].values).any():
                continue
            ax.plot(row["n_cached"], row["tflops"], "o-", label=f"bs {batch}, T {int(row['tree'])}")
    peak = float(ds.attrs.get("fp32_peak_flops", np.nan)) / 1e12
    ax.axhline(peak, color="k", ls="--", label=f"FP32 peak {peak:.0f} TFLOP/s")
    _finish(ax, "cached length N", "effective TFLOP/s", f"tree-verify MLA attention, FP32, H 64\n{_provenance(ds)}",
            ylog=False, ncol=2)
    return fig


def fig_accept_compact(ds: Any) -> Any:
    fig, ax = _single()
    sub = ds.sel(batch=_largest(ds, "batch"))
    for step in sub["step"].values:
        row = sub.sel(step=step)
        if not np.isfinite(row["median_us"].values).any():
            continue
        line, = ax.plot(row["budget"], row["median_us"], "o-", label=str(step))
        if np.isfinite(row["bound_us"].values).any():
            ax.plot(row["budget"], row["bound_us"], "--", color=line.get_color(), alpha=0.6)
    _finish(ax, "budget B", "time (us)",
            f"posterior, accept walk, KV compaction (bs {int(sub['batch'])}; dashed: bounds)\n{_provenance(ds)}")
    return fig


def fig_budget_tradeoff(ds: Any) -> Any:
    batches = ds["batch"].values
    fig, axes = _figure(len(batches), 2)
    for r, batch in enumerate(batches):
        sub = ds.sel(batch=batch)
        for c, (var, ar_var, label) in enumerate((("tokens_per_s", "ar_tokens_per_s", "tokens / s"),
                                                  ("forward_passes", "ar_forward_passes", "target forward passes"))):
            ax = axes[r, c]
            for accuracy in sub["accuracy"].values:
                line = sub[var].sel(accuracy=accuracy).dropna("budget")  # an outer join leaves NaN cases
                if line.size:
                    ax.plot(line["budget"], line, "o-", label=f"DDTree, accuracy {accuracy:g}")
            ax.axhline(float(sub[ar_var]), color="k", ls="--", label="AR")
            _finish(ax, "budget B", label, f"bs {batch}: {label}", ylog=False)
    fig.suptitle(f"budget trade-off, preset {ds.attrs.get('preset', '?')} ({_provenance(ds)})", fontsize=9)
    return fig


FIGURES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "topk_vs_budget.png": ("sweep_topk", fig_topk_vs_budget),
    "topk_vs_rows.png": ("sweep_topk", fig_topk_vs_rows),
    "tree_build_vs_budget.png": ("sweep_tree_build", fig_tree_build_vs_budget),
    "tree_build_speedup.png": ("sweep_tree_build", fig_tree_build_speedup),
    "verify_attention_tflops.png": ("sweep_verify_attention", fig_verify_tflops),
    "accept_compact_vs_budget.png": ("sweep_accept_compact", fig_accept_compact),
    "budget_tradeoff.png": ("sweep_e2e", fig_budget_tradeoff),
}


def make_figures(paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write every figure whose sweep is in ``paths``; return the PNG paths written."""
    runs = latest_runs(paths)
    out_dir = Path(out_dir)
    written = []
    for name, (benchmark, draw) in FIGURES.items():
        if benchmark in runs:
            written.append(save_png(draw(runs[benchmark]), out_dir / name))
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", type=Path, default=list(DEFAULT_FILES),
                        help="sweep HDF5 files or directories of them (default: data/bench)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: docs/figures)")


def main(args: argparse.Namespace) -> int:
    try:
        written = make_figures(args.files, args.out)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    if not written:
        print("no sweep groups (sweep_*) found in the given files", file=sys.stderr)
        return 1
    return 0
