"""``ddtree-numba``: the command line.

Subcommands import their modules lazily, so ``--help`` is instant and ``compile-check`` can
refuse to run under the simulator before numba.cuda is imported by anything else.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_GOLDEN_DIR = Path(__file__).resolve().parent.parent / "data" / "golden"

# Families of data/golden/*.h5 (reference.golden_cases.GOLDEN_FILES; listed here so --help needs no
# import of the reference and its dependencies).
GOLDEN_FAMILIES = ["topk", "tree", "attention", "accept", "sampling", "compact", "model"]

# ``ddtree-numba bench NAME ...`` -> ddtree_numba.bench.<module>.main(...)
BENCHMARKS = {
    "topk": ("topk", "fused log-softmax top-k over the vocabulary (GPU)"),
    "tree-build": ("tree_build", "best-first tree build (GPU, CUDA-graph replay)"),
    "verify-attention": ("verify_attention", "tree-verify MLA attention, FP32 (GPU)"),
    "accept-compact": ("accept_compact", "posterior argmax / sampling, accept walk, KV compaction (GPU)"),
    "launch-shapes": ("launch_shapes", "expert-linear grids and posterior block sizes, bits checked (GPU)"),
    "cpu-tree": ("cpu_tree", "the CPU path: NumPy top-k + Python heapq build (host)"),
    "sweep": ("sweep", "sweeps over batch/budget/block/N/dtype with bounds and peers; e2e (GPU)"),
}

GENERATE_HELP = "generate with the engine: AR and DDTree side by side (ddtree-numba generate --help)"

DESCRIPTION = """\
DDTree speculative decoding with the whole round on the GPU, in Numba CUDA.

Without a GPU, set NUMBA_ENABLE_CUDASIM=1 to run the kernels on numba-cuda's CPU simulator
(the test suite does this by itself)."""


def _cmd_golden(args: argparse.Namespace) -> int:
    from ddtree_numba.golden import GoldenFileError
    from reference import golden_cases

    try:
        return _golden_action(args, golden_cases)
    except GoldenFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _golden_action(args: argparse.Namespace, golden_cases) -> int:
    if args.golden_cmd == "regen":
        paths = golden_cases.regenerate(args.out, names=args.only or None, progress=not args.quiet)
        for path in paths:
            print(f"wrote {path} ({path.stat().st_size / 1024:.1f} KiB)")
        return 0
    mismatches = golden_cases.check(args.dir, names=args.only or None)
    for line in mismatches:
        print(line)
    if mismatches:
        print(f"{len(mismatches)} difference(s) between the golden files and the reference; "
              "if the reference changed on purpose: ddtree-numba golden regen", file=sys.stderr)
        return 1
    print(f"golden files in {args.dir} match the reference")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from ddtree_numba import plot

    return plot.main(args)


def _run_generate(argv: list[str]) -> int:
    """``ddtree-numba generate``: options and work belong to ddtree_numba.engine.generate."""
    import importlib

    try:
        module = importlib.import_module("ddtree_numba.engine.generate")
    except ImportError as err:
        print(f"error: `generate` needs ddtree_numba.engine.generate, which cannot be imported: {err}",
              file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="ddtree-numba generate", description=GENERATE_HELP)
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(argv)) or 0)


def _cmd_profiles(args: argparse.Namespace) -> int:
    from sim.profiles import format_profiles_table

    print(format_profiles_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-numba", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    golden = sub.add_parser(
        "golden", help="regenerate or check the golden HDF5 files (data/golden/*.h5)",
        description="Golden cases: inputs and expected outputs of every reference function, "
                    "built with fixed seeds and stored as xarray Datasets in HDF5 (one group per case). "
                    "Kernel tests compare against them.")
    gsub = golden.add_subparsers(dest="golden_cmd", required=True, metavar="ACTION")
    regen = gsub.add_parser("regen", help="rebuild the golden files from reference/ (atomic writes)")
    regen.add_argument("--out", type=Path, default=DEFAULT_GOLDEN_DIR,
                       help="output directory (default: %(default)s)")
    regen.add_argument("--only", action="append", choices=GOLDEN_FAMILIES,
                       help="regenerate only this file family; repeatable")
    regen.add_argument("--quiet", action="store_true", help="no progress bar")
    check = gsub.add_parser("check", help="rebuild every case and compare it with the stored files")
    check.add_argument("--dir", type=Path, default=DEFAULT_GOLDEN_DIR,
                       help="directory of the golden files (default: %(default)s)")
    check.add_argument("--only", action="append", choices=GOLDEN_FAMILIES,
                       help="check only this file family; repeatable")
    golden.set_defaults(func=_cmd_golden)

    sub.add_parser(  # listed for --help; main() hands its options to sim.compile_check
        "compile-check", add_help=False,
        help="compile every kernel for sm_90 and sm_120 without a GPU; report registers, "
             "shared memory and spills (options: ddtree-numba compile-check --help)")

    sub.add_parser(  # listed for --help; main() hands its options to sim.sass
        "sass", add_help=False,
        help="a kernel's SASS without a GPU (nvdisasm), or where its PDL wait falls among its weight loads "
             "(options: ddtree-numba sass --help)")

    bench = sub.add_parser(
        "bench", help="time a kernel at Kimi K2 shapes (ddtree-numba bench NAME --help)",
        description="Benchmarks (not tests): CUDA-event timing after warm-up, many repetitions, "
                    "median / min / max, inputs rotated; --out appends an xarray Dataset with "
                    "provenance to an HDF5 file. Benchmarks:\n" + "\n".join(
                        f"  {name:18s} {text}" for name, (_, text) in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.set_defaults(func=lambda args: 0)

    sub.add_parser("generate", add_help=False, help=GENERATE_HELP)  # main() hands it to the engine

    plot = sub.add_parser(
        "plot", help="figures (PNG) from sweep files (ddtree-numba bench sweep --out ...)",
        description="Turn the latest sweep_* group of each benchmark in the given HDF5 files into PNG "
                    "figures: kernel time vs budget with the roofline bound, GPU/CPU speedup, top-k time "
                    "vs rows, verify-attention TFLOP/s vs N, the budget trade-off.")
    from ddtree_numba.plot import add_arguments as plot_arguments

    plot_arguments(plot)
    plot.set_defaults(func=_cmd_plot)

    prof = sub.add_parser("profiles", help="print the device profiles (H200, RTX PRO 6000 Blackwell)")
    prof.set_defaults(func=_cmd_profiles)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHMARKS:
        # Each benchmark owns its options (ddtree-numba bench NAME --help).
        import importlib

        module = importlib.import_module(f"ddtree_numba.bench.{BENCHMARKS[argv[1]][0]}")
        return int(module.main(argv[2:]) or 0)
    if argv[:1] == ["generate"]:
        return _run_generate(argv[1:])
    if argv[:1] == ["compile-check"]:
        # Its options belong to sim.compile_check's own parser (argparse.REMAINDER cannot pass
        # "--arch ..." through a subparser).
        from sim import compile_check

        return int(compile_check.main(argv[1:]) or 0)
    if argv[:1] == ["sass"]:
        from sim import sass

        return int(sass.main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
