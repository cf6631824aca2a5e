"""The machine code of a registered kernel, without a GPU: SASS and where its PDL wait falls.

:mod:`sim.compile_check` measures a build (registers, spills); this module shows it. A kernel x
signature is built as the compile check builds it (NVVM LTO-IR, then nvJitLink with link-time
optimisation: what numba-cuda 0.30.4 runs at launch when nvJitLink is present) and disassembled
with ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel of the ``gpu`` extra, or a CUDA toolkit's).

Why: which instructions come before ``griddepcontrol.wait`` decides whether programmatic
dependent launch overlaps anything. The PTX of gemv has its first weight loads before the wait
(``tests/test_pdl.py`` checks it), but ptxas may schedule the wait above them: it did in the
build the H100 ran in PERFORMANCE.md's run "pdl early timed" (nvJitLink version unrecorded), and
does not with nvJitLink 13.5 (run "branches"). The machine code depends on the nvJitLink, so
check it with the one the GPU will use::

    ddtree-numba sass gemv_rmsnorm --arch sm_90 --pdl-order
    ddtree-numba sass absorb_split_mt1_l4 > split.sass

Run in a process without the simulator (as the compile check).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

__all__ = ["nvdisasm_path", "nvjitlink_version", "kernel_sass", "pdl_order", "main"]

WAIT_OP = "ACQBULK"  # griddepcontrol.wait on sm_90 and sm_120 (inferred: the only one in a kernel with one wait)
WEIGHT_LOAD_OP = "LDG.E.128.CONSTANT"  # a 16-byte ld.global.nc: gemv's and the split absorb's weight loads


def nvdisasm_path() -> str | None:
    """The ``nvdisasm`` to use: the NVIDIA wheel's or toolkit's (cuda.pathfinder), else PATH's."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("nvdisasm")
    except Exception:  # noqa: BLE001 - an older pathfinder, or none: fall back to PATH
        found = None
    return found or shutil.which("nvdisasm")


def nvjitlink_version() -> tuple[int, int]:
    """(major, minor) of the nvJitLink numba links kernels with; (0, 0) where none loads."""
    try:
        from cuda.bindings import nvjitlink

        return tuple(nvjitlink.version())
    except Exception:  # noqa: BLE001 - no nvJitLink on this machine
        return (0, 0)


def kernel_sass(name: str, arch: str = "sm_90", signature: int = 0) -> str:
    """The SASS listing of registered kernel ``name`` (its ``signature``-th registered signature)
    for ``arch``, as ``nvdisasm -c`` prints it.

    Raises:
        ValueError: no kernel of that name (``ddtree_numba.kernels.registry.get``).
        IndexError: no such signature.
        FileNotFoundError: no nvdisasm (install the ``gpu`` extra).
        sim.compile_check.CompileCheckError: the simulator is on.
    """
    from ddtree_numba.kernels import registry

    from .compile_check import kernel_cubin

    spec = registry.get(name)
    if not 0 <= signature < len(spec.signatures):
        raise IndexError(f"signature {signature}: kernel {name!r} has {len(spec.signatures)} registered signatures")
    tool = nvdisasm_path()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: install the gpu extra (nvidia-cuda-nvdisasm) or a CUDA toolkit")
    cubin = kernel_cubin(spec, spec.signatures[signature], arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def pdl_order(sass: str) -> tuple[int, list[int]]:
    """(index of the first ``ACQBULK``, indices of the ``LDG.E.128.CONSTANT`` loads) among the
    instructions of a SASS listing (nvdisasm lines ``/*0b70*/  @P3 LDG.E.128.CONSTANT R28, ...``).
    On sm_90 ``griddepcontrol.wait`` assembles to ``ACQBULK`` and ``launch_dependents`` to
    ``PREEXIT`` (inferred: each is the only one in a kernel with one wait and one release).

    Raises:
        ValueError: no ``ACQBULK`` in the listing.
    """
    ops = []
    for line in sass.splitlines():
        line = line.strip()
        if line.startswith("/*") and "*/" in line:
            text = line.split("*/", 1)[1].strip().rstrip(";").strip()
            words = [w for w in text.split() if not w.startswith("@")]
            if words and not words[0].startswith(("/*", ".")):   # (not a data section's .byte rows)
                ops.append(words[0])
    if WAIT_OP not in ops:
        raise ValueError(f"no {WAIT_OP} in the SASS")
    return ops.index(WAIT_OP), [i for i, op in enumerate(ops) if op == WEIGHT_LOAD_OP]


def main(argv: Sequence[str] | None = None) -> int:
    """``ddtree-numba sass``: print a kernel's SASS, or with ``--pdl-order`` where its wait falls."""
    doc = __doc__ or "ddtree-numba sass\n\n"
    parser = argparse.ArgumentParser(prog="ddtree-numba sass", description=doc.split("\n")[0],
                                     epilog=doc.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", help="a registered kernel's name (ddtree-numba compile-check lists them)")
    parser.add_argument("--arch", choices=("sm_90", "sm_120"), default="sm_90", help="(default: %(default)s)")
    parser.add_argument("--signature", type=int, default=0, help="which registered signature (default: 0)")
    parser.add_argument("--pdl-order", action="store_true",
                        help=f"print only where the PDL wait ({WAIT_OP}) falls among the 16-byte weight loads "
                             f"({WEIGHT_LOAD_OP}), and the nvJitLink that built it")
    args = parser.parse_args(argv)
    from ddtree_numba.bench.common import nvjitlink_info   # (as benchmarks record it)
    from ddtree_numba.kernels import registry

    from .compile_check import CompileCheckError

    try:
        registry.get(args.kernel)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        sass = kernel_sass(args.kernel, args.arch, args.signature)
    except (FileNotFoundError, IndexError, CompileCheckError) as exc:
        print(f"ddtree-numba sass: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:   # nvdisasm's own message
        print(f"ddtree-numba sass: nvdisasm failed ({exc.returncode}): {exc.stderr}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - numba's or nvJitLink's error, as the compile check reports it
        print(f"ddtree-numba sass: compile failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not args.pdl_order:
        sys.stdout.write(sass)
        return 0
    try:
        wait, loads = pdl_order(sass)
    except ValueError as exc:
        print(f"{args.kernel} {args.arch}: {exc} (no PDL wait in this kernel)")
        return 0
    before = sum(i < wait for i in loads)
    print(f"{args.kernel} {args.arch}: {WAIT_OP} at instruction {wait}; {before} of {len(loads)} {WEIGHT_LOAD_OP} "
          f"before it (nvJitLink {nvjitlink_info()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
