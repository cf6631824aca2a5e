"""Compile every registered kernel for sm_90 / sm_120 without a GPU and check its resources.

The simulator types nothing (stack §2, gotcha 2), so this is where kernels meet the real
compiler. Each registered signature is compiled the way numba-cuda 0.30.4 builds a kernel at
launch when nvJitLink is present (its default ``lto=True``): NVVM emits LTO-IR
(``cuda.compile(..., output="ltoir")``, no GPU needed), and nvJitLink links it to a cubin with
link-time optimisation and ptxas ``-v`` (stack §3). Going through PTX instead
(``compile_ptx``, then nvJitLink without LTO) gave 134 / 224 registers where the H200 launch
used 122 / 216, so the LTO route is the one whose numbers match the GPU. The ptxas log gives
registers, named barriers, stack frame, spills and static shared memory; each result is
checked against the architecture's profile. numba's front end runs once per kernel signature
and NVVM emits each architecture's LTO-IR from it (:func:`compile_kernel_archs`): the front end
is most of a compile, so both architectures cost little more than one (the CI's 2 cores, 162
results: 590 s before, 328 s after, the same resources for every one).

Run in a process *without* the simulator (``NUMBA_ENABLE_CUDASIM`` unset or 0)::

    ddtree-numba compile-check [--arch sm_90] [--kernel NAME] [--json PATH]
    python -m sim.compile_check ...

Not modelled: kernels built with ``lto=False``, extra ``link=`` files (FFI) and cooperative
launches (cudadevrt), which numba links at launch.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import sys
import time
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .launch import takes_programmatic_launch
from .profiles import PROFILES, DeviceProfile

if TYPE_CHECKING:
    from ddtree_numba.kernels.registry import KernelSpec

__all__ = [
    "CompileCheckError",
    "CompileResult",
    "LinkResources",
    "parse_link_log",
    "compile_kernel",
    "compile_kernel_archs",
    "max_threads_per_block",
    "check_result",
    "run",
    "format_report",
    "main",
]

ARCHS: dict[str, DeviceProfile] = {p.arch: p for p in PROFILES.values()}
DEFAULT_ARCHS = ("sm_90", "sm_120")
# Registers are allocated per warp in units of 256 (CUDA occupancy calculator, cc 7.0-12.x),
# from one of the SM's 4 sub-partitions, each holding a quarter of the register file.
REG_ALLOC_UNIT = 256
REG_FILE_PARTITIONS = 4

# ptxas -v, as nvJitLink relays it, for each kernel:
#   ptxas info    : Compiling entry function '<name>' for 'sm_90'
#   ptxas info    : Function properties for <name>
#   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
#   ptxas info    : Used 10 registers, used 1 barriers, 512 bytes smem
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPERTIES = r"Function properties for {name}[ \t]*\n(?P<block>(?:ptxas[^\n]*(?:\n|$)){{2}})"
_REQUIRED_FIELDS = {
    "registers": r"Used (\d+) registers",
    # Named barriers (bar.sync, i.e. syncthreads), at most 16 per block.
    "barriers": r"used (\d+) barriers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
}
# ptxas prints static shared memory only when there is some (checked: a kernel with only a
# dynamic shared array prints none); the figure excludes the 1 KiB the system reserves.
_SMEM = r"(\d+) bytes smem"
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # numba highlights its error messages
_PDL_WAIT = "griddepcontrol.wait"  # ddtree_numba.kernels.pdl's wait, as its inline asm spells it


class CompileCheckError(RuntimeError):
    """Compiling or linking failed, or the linker log lacked a field."""


@dataclass(frozen=True)
class LinkResources:
    """Resources of the one entry function in a link log."""

    entry: str  # mangled kernel name
    registers: int  # per thread
    barriers: int
    stack_bytes: int  # per thread: local arrays and spills
    smem_bytes: int  # static shared memory per block
    spill_store_bytes: int
    spill_load_bytes: int


@dataclass(frozen=True)
class CompileResult:
    """One kernel x signature x architecture. Resource fields are None when ``error`` is set."""

    name: str
    signature: str
    arch: str
    registers: int | None = None
    barriers: int | None = None
    stack_bytes: int | None = None
    smem_bytes: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    ltoir_bytes: int | None = None
    cubin_bytes: int | None = None
    smem_opt_in: bool = False
    block_threads: int | None = None
    error: str | None = None
    # Programmatic dependent launch (ddtree_numba.kernels.pdl): whether the kernel's Python body
    # calls pdl_begin / pdl_wait (sim.launch launches it early), and whether its compiled IR
    # holds the griddepcontrol.wait that makes that safe (None: not compiled).
    programmatic: bool = False
    pdl_wait: bool | None = None


def _field(pattern: str, text: str, field: str, log: str) -> int:
    match = re.search(pattern, text)
    if match is None:
        raise CompileCheckError(f"link log: no {field} ({pattern!r}) in the log:\n{log}")
    return int(match.group(1))


def parse_link_log(log: str, arch: str) -> LinkResources:
    """Resources of the single entry function in an nvJitLink ``-v`` log for ``arch``.

    NUL bytes (nvJitLink terminates its log with one) are ignored.

    Raises:
        CompileCheckError: not exactly one entry function, another arch, or a missing
            section or field; the message includes the log.
    """
    log = log.replace("\x00", "")
    entries = _ENTRY.findall(log)
    if len(entries) != 1:
        raise CompileCheckError(f"link log: expected one entry function, found {len(entries)}:\n{log}")
    entry, log_arch = entries[0]
    if log_arch != arch:
        raise CompileCheckError(f"link log: compiled for {log_arch}, expected {arch}:\n{log}")
    props = re.search(_PROPERTIES.format(name=re.escape(entry)), log)
    if props is None:
        raise CompileCheckError(f"link log: no function properties for {entry}:\n{log}")
    block = props.group("block")
    values = {f: _field(p, block, f, log) for f, p in _REQUIRED_FIELDS.items()}
    smem = re.search(_SMEM, block)
    return LinkResources(entry=entry, smem_bytes=int(smem.group(1)) if smem else 0, **values)


def _cc_and_arch(cc: tuple[int, int] | str) -> tuple[tuple[int, int], str]:
    """``(9, 0)`` or ``"sm_90"`` -> ``((9, 0), "sm_90")``, for the architectures we have profiles of."""
    for arch, profile in ARCHS.items():
        if cc == arch or cc == profile.compute_capability:
            return profile.compute_capability, arch
    raise ValueError(f"cc: {cc!r} is not one of {', '.join(ARCHS)} (or their (major, minor) tuples)")


def _signature_str(sig: tuple) -> str:
    return "(" + ", ".join(str(t) for t in sig) + ")"


def _require_compiler() -> None:
    from numba import cuda

    if cuda.config.ENABLE_CUDASIM:
        raise CompileCheckError(
            "the compile check needs numba-cuda's real compiler, but the CUDA simulator is on "
            "(NUMBA_ENABLE_CUDASIM=1); run it in a process without the simulator, e.g. "
            "NUMBA_ENABLE_CUDASIM=0 ddtree-numba compile-check"
        )


@contextlib.contextmanager
def _device_functions_target(cc: tuple[int, int]) -> Iterator[None]:
    """Compile called ``@cuda.jit`` device functions for ``cc`` instead of the current device.

    numba-cuda 0.30.4 types a called device function with ``get_current_device()``'s compute
    capability (``dispatcher.py``, ``compile_device``), which raises without a GPU. Its
    compiled IR is cached per argument types, so it is typed once (for the first arch) and
    NVVM then generates code for each kernel's own arch; both targets are >= 8.0, so no
    capability-gated typing differs between them.
    """
    from numba.cuda import dispatcher

    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = original


def compile_kernel(spec: KernelSpec, sig: tuple, cc: tuple[int, int] | str) -> CompileResult:
    """Compile ``spec.kernel.py_func`` for ``sig`` to LTO-IR and link it to a cubin for ``cc``.

    The kernel's ``fastmath``, ``opt``, ``launch_bounds`` and ``max_registers`` options are
    applied as numba applies them at launch. ``spec.archs`` is not consulted here (:func:`run`
    skips the architectures a kernel is not launched on); a direct call compiles for ``cc``.

    Args:
        spec: a :class:`ddtree_numba.kernels.registry.KernelSpec`.
        sig: a tuple of numba argument types.
        cc: ``(9, 0)`` / ``"sm_90"`` or ``(12, 0)`` / ``"sm_120"``.

    Raises:
        CompileCheckError: the simulator is on, compilation or linking failed, or the link log
            lacks a field.
        ValueError: ``cc`` is not an architecture with a profile.
    """
    result = compile_kernel_archs(spec, sig, [cc])[0]
    if result.error:
        raise CompileCheckError(result.error)
    return result


def compile_kernel_archs(spec: KernelSpec, sig: tuple, ccs: Sequence[tuple[int, int] | str]) -> list[CompileResult]:
    """:func:`compile_kernel` for each of ``ccs``, typing and lowering the kernel once.

    numba's front end (typing, lowering to LLVM IR) is most of a compile (~26 of 28 s for the
    top-k segment kernel); its IR does not depend on the architecture here (the only
    capability tests in numba-cuda 0.30.4's lowering are at 6.0 and 7.5, below both targets, as
    for the device functions, see ``_device_functions_target``), so NVVM emits each
    architecture's LTO-IR from the one library, as ``cuda.compile(..., output="ltoir")`` does
    for one. A failure becomes a result with ``error`` set (for every arch when lowering fails).

    Raises:
        CompileCheckError: the simulator is on.
        ValueError: a ``cc`` is not an architecture with a profile, or ``ccs`` is empty.
    """
    _require_compiler()
    targets = [_cc_and_arch(cc) for cc in ccs]
    if not targets:
        raise ValueError("ccs must name at least one architecture")
    options = getattr(spec.kernel, "targetoptions", {})

    programmatic = takes_programmatic_launch(spec.kernel)

    def failed(arch: str, message: str) -> CompileResult:
        return CompileResult(spec.name, _signature_str(sig), arch, smem_opt_in=spec.smem_opt_in,
                             block_threads=spec.block_threads, error=message, programmatic=programmatic)

    try:
        library = _lower(spec, sig, targets[0][0])
    except Exception as exc:  # any typing/lowering error is a finding, reported per kernel
        message = f"compile failed: {type(exc).__name__}: {_ANSI_ESCAPE.sub('', str(exc))}"
        return [failed(arch, message) for _, arch in targets]
    # The inline asm survives into the module's LLVM IR as text (NVVM then keeps a side-effect asm).
    waits = _PDL_WAIT in library.get_llvm_str()
    return [dataclasses.replace(_link(spec, sig, library, cc, arch, options, failed), programmatic=programmatic,
                                pdl_wait=waits) for cc, arch in targets]


def _lower(spec: KernelSpec, sig: tuple, cc: tuple[int, int]) -> Any:
    """numba's library of ``spec.kernel.py_func`` for ``sig`` (typing and lowering, what
    ``cuda.compile(output="ltoir")`` runs first), with the kernel's launch options."""
    from numba.cuda.compiler import _compile_pyfunc_with_fixup

    options = getattr(spec.kernel, "targetoptions", {})
    with _device_functions_target(cc):
        library, _ = _compile_pyfunc_with_fixup(
            spec.kernel.py_func,
            tuple(sig),
            device=False,
            abi="numba",
            cc=cc,
            fastmath=options.get("fastmath", False),
            opt=options.get("opt", True),
            launch_bounds=options.get("launch_bounds"),
            lto=True,
        )
    return library


def _linker(ltoir: bytes, arch: str, options: dict) -> Any:
    """An nvJitLink linker of one kernel's LTO-IR for ``arch``, with ptxas -v and the kernel's
    register cap, as numba links at launch."""
    from cuda.core import Linker, LinkerOptions, ObjectCode

    ptxas_options = ["-v"]
    if options.get("max_registers"):
        ptxas_options.append(f"-maxrregcount={options['max_registers']}")
    return Linker(
        ObjectCode.from_ltoir(ltoir),
        options=LinkerOptions(arch=arch, link_time_optimization=True, verbose=True, ptxas_options=ptxas_options),
    )


def kernel_cubin(spec: KernelSpec, sig: tuple, cc: tuple[int, int] | str) -> bytes:
    """The cubin of one kernel x signature x architecture, built as :func:`compile_kernel` builds
    it (for :mod:`sim.sass`: the machine code that the compile check only measures).

    Raises:
        CompileCheckError: the simulator is on.
        ValueError: ``cc`` is not an architecture with a profile.
        Exception: numba's or nvJitLink's error, as raised.
    """
    _require_compiler()
    cc, arch = _cc_and_arch(cc)
    library = _lower(spec, sig, cc)
    return _linker(library.get_ltoir(cc=cc), arch, getattr(spec.kernel, "targetoptions", {})).link("cubin").code


def _link(spec: KernelSpec, sig: tuple, library, cc: tuple[int, int], arch: str, options: dict,
          failed) -> CompileResult:
    """NVVM LTO-IR of ``library`` for ``cc``, linked by nvJitLink with ptxas -v: the result."""
    try:
        ltoir = library.get_ltoir(cc=cc)
    except Exception as exc:  # an NVVM error is a finding of this arch
        return failed(arch, f"compile failed: {type(exc).__name__}: {_ANSI_ESCAPE.sub('', str(exc))}")
    linker = _linker(ltoir, arch, options)
    try:
        cubin = linker.link("cubin")
    except Exception as exc:
        return failed(arch, f"nvJitLink failed for {arch}: {exc}\n{linker.get_error_log()}")
    try:
        resources = dataclasses.asdict(parse_link_log(linker.get_info_log(), arch))
    except CompileCheckError as exc:
        return failed(arch, str(exc))
    del resources["entry"]
    return CompileResult(
        name=spec.name,
        signature=_signature_str(sig),
        arch=arch,
        **resources,
        ltoir_bytes=len(ltoir),
        cubin_bytes=len(cubin.code),
        smem_opt_in=spec.smem_opt_in,
        block_threads=spec.block_threads,
    )


def max_threads_per_block(registers: int, profile: DeviceProfile) -> int:
    """Largest block (a whole number of warps) whose registers fit in one block's register file.

    Registers go to warps in units of 256, and a block's warps are spread over the SM's 4
    sub-partitions, each with a quarter of the register file; so the block may hold 4 x
    floor((regs_per_block / 4) / regs_per_warp) warps. Checked on the H200: 122 registers ->
    512 launches and 544 fails; 216 registers -> 288 fails (a whole-file count would allow it).
    A launch above this fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, which the simulator
    cannot detect. 70 registers -> 896 threads; 255 -> 256.
    """
    per_warp = -(-registers * profile.warp_size // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    if per_warp == 0:
        return profile.max_threads_per_block
    warps = REG_FILE_PARTITIONS * (profile.regs_per_block // REG_FILE_PARTITIONS // per_warp)
    return min(profile.max_threads_per_block, warps * profile.warp_size)


def check_result(result: CompileResult) -> list[str]:
    """Problems with ``result`` against its architecture's profile (empty list = passes).

    Checked: compiled at all; registers per thread <= the profile's limit; registers allow
    the kernel's registered ``block_threads`` (if given) in one block; no spills; static
    shared memory <= the default 48 KiB per block (the opt-in limit when the kernel is marked
    ``smem_opt_in``); a kernel that takes programmatic launches has the wait in its code.
    Dynamic shared memory is checked at launch (:mod:`sim.launch`).
    """
    if result.error is not None:
        first_line = (result.error.splitlines() or [""])[0]
        return [f"failed to compile: {first_line}"]
    profile = ARCHS[result.arch]
    problems = []
    if result.programmatic and result.pdl_wait is False:
        problems.append("calls pdl_begin / pdl_wait (programmatic launches) but its code has no griddepcontrol.wait")
    if result.registers > profile.max_regs_per_thread:
        problems.append(f"{result.registers} registers > {profile.max_regs_per_thread} per thread")
    allowed = max_threads_per_block(result.registers, profile)
    if result.block_threads is not None and result.block_threads > allowed:
        problems.append(
            f"{result.registers} registers allow {allowed} threads per block, launched with {result.block_threads}"
        )
    if result.spill_store_bytes or result.spill_load_bytes:
        problems.append(f"spills {result.spill_store_bytes} B stores / {result.spill_load_bytes} B loads")
    limit = profile.smem_per_block_optin if result.smem_opt_in else profile.smem_per_block_default
    if result.smem_bytes > limit:
        kind = "opt-in" if result.smem_opt_in else "default"
        problems.append(f"static smem {result.smem_bytes} B > {kind} limit {limit} B")
    return problems


def _compile_one(task: tuple[str, int, tuple[str, ...]]) -> list[CompileResult]:
    """Compile registered kernel ``name``'s signature ``index`` for each of ``archs`` (one front
    end); errors become results."""
    from ddtree_numba.kernels import registry

    name, index, archs = task
    spec = registry.get(name)
    return compile_kernel_archs(spec, spec.signatures[index], archs)


def run(
    archs: Sequence[str] = DEFAULT_ARCHS,
    names: Iterable[str] | None = None,
    *,
    progress: bool = True,
    jobs: int = 1,
) -> list[CompileResult]:
    """Compile every registered kernel (or those in ``names``) for each signature and arch.

    A failed compilation becomes a result with ``error`` set, so one bad kernel does not hide
    the others. Prints one progress line per kernel x signature x arch to stderr. ``jobs`` > 1
    compiles in that many forked worker processes (compilation is single-threaded and CPU-bound;
    the results keep the registry's order).

    Raises:
        CompileCheckError: the simulator is on.
        ValueError: an unknown arch or kernel name, or ``jobs`` < 1.
    """
    from ddtree_numba.kernels import registry

    _require_compiler()
    archs = [_cc_and_arch(arch)[1] for arch in archs]  # (9, 0) -> "sm_90": what specs' archs name
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    specs = registry.all_kernels() if names is None else [registry.get(n) for n in names]
    tasks = []  # (kernel, signature index, the archs it is launched on): one front end each
    for spec in specs:
        launched = tuple(a for a in archs if spec.archs is None or a in spec.archs)  # arch-specific tilings
        if launched:
            tasks += [(spec.name, i, launched) for i in range(len(spec.signatures))]
    start = time.perf_counter()

    def report(results: list[CompileResult]) -> list[CompileResult]:
        for result in results:
            if progress:
                status = "FAILED" if result.error else f"{result.registers} regs"
                print(f"compile-check: {result.name} {result.signature} {result.arch}: {status} "
                      f"({time.perf_counter() - start:.1f} s elapsed)", file=sys.stderr, flush=True)
        return results

    if jobs == 1 or len(tasks) < 2:
        return [r for task in tasks for r in report(_compile_one(task))]
    # fork: the workers inherit the imported, registered kernels (no CUDA context is involved)
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        return [r for results in pool.map(_compile_one, tasks) for r in report(results)]


_COLUMNS = ("kernel", "signature", "arch", "regs", "max tpb", "smem", "stack", "spills", "check")


_ARRAY_TYPE = re.compile(r"array\((\w+), (\d)d, (\w)\)")


def _short_signature(signature: str) -> str:
    """``(array(int32, 2d, C), int32)`` -> ``(int32[2d,C], int32)``, to keep the table narrow."""
    return _ARRAY_TYPE.sub(r"\1[\2d,\3]", signature)


def _row(result: CompileResult) -> tuple[str, ...]:
    problems = check_result(result)
    verdict = "ok" if not problems else "FAIL: " + "; ".join(problems)
    if result.error is not None:
        return (result.name, _short_signature(result.signature), result.arch, "-", "-", "-", "-", "-", verdict)
    return (
        result.name,
        _short_signature(result.signature),
        result.arch,
        str(result.registers),
        str(max_threads_per_block(result.registers, ARCHS[result.arch])),
        f"{result.smem_bytes}{' (opt-in)' if result.smem_opt_in else ''}",
        str(result.stack_bytes),
        f"{result.spill_store_bytes}/{result.spill_load_bytes}",
        verdict,
    )


def format_report(results: Sequence[CompileResult]) -> str:
    """A fixed-width table (kernel, signature, arch, regs, max threads per block the registers
    allow, smem, stack, spills, check) and a summary line."""
    rows = [_COLUMNS] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    failed = sum(1 for r in results if check_result(r))
    lines.append(f"{len(results)} compiled, {failed} failed")
    return "\n".join(lines)


def _write_json_atomic(path: str, results: Sequence[CompileResult]) -> None:
    """Write the results (with their check problems) as JSON, atomically (temp file, rename)."""
    payload = [
        dataclasses.asdict(r)
        | {
            "max_threads_per_block": None if r.error else max_threads_per_block(r.registers, ARCHS[r.arch]),
            "problems": check_result(r),
        }
        for r in results
    ]
    from ddtree_numba.atomic import atomic_path  # lazily: importing ddtree_numba wires the simulator

    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2))


_DESCRIPTION = """\
Compile every registered Numba CUDA kernel (ddtree_numba.kernels) with its registered
signatures for sm_90 (H200) and sm_120 (RTX PRO 6000 Blackwell), without a GPU, the way
numba builds a kernel at launch: NVVM to LTO-IR, then nvJitLink with LTO and ptxas -v to a
cubin. For each kernel x signature x arch it reports registers (and the largest block they
allow: "max tpb"), static shared memory, stack and spills, and checks them against the
arch's device profile: registers per thread <= 255, registers that allow the block size
the kernel was registered with (block_threads), no spill stores or loads, static shared
memory <= 48 KiB per block (the opt-in limit, 227 KiB / 99 KiB, for kernels registered
with smem_opt_in=True), and griddepcontrol.wait in the code of every kernel that calls
pdl_begin / pdl_wait (programmatic dependent launch). Exits 1 if any kernel fails to compile or fails a check, 2 on a
usage error or when the CUDA simulator is on (run it without NUMBA_ENABLE_CUDASIM)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree-numba compile-check",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--arch", action="append", choices=sorted(ARCHS), help="architecture (repeatable; default: sm_90 and sm_120)"
    )
    parser.add_argument("--kernel", action="append", metavar="NAME", help="only this registered kernel (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON (atomically)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="compile in N worker processes (default: the number of CPUs)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status (0 ok, 1 failures, 2 usage / simulator)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json: directory of {args.json!r} does not exist")
    archs = tuple(dict.fromkeys(args.arch)) if args.arch else DEFAULT_ARCHS
    try:
        results = run(archs, args.kernel, jobs=args.jobs)
    except (CompileCheckError, ValueError) as exc:
        print(f"compile-check: {exc}", file=sys.stderr)
        return 2
    print(format_report(results))
    if args.json:
        _write_json_atomic(args.json, results)
    return 1 if any(check_result(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
