"""Programmatic dependent launch (PDL, sm_90 on): a kernel's start overlaps its predecessor's end.

A decode step at batch 1 is ~90 short kernels back to back (PERFORMANCE "decode step"). In a
plain stream, kernel n + 1 is launched only after kernel n has completed and its writes are
flushed: every boundary costs the launch latency plus the tail in which kernel n's last blocks
run on a few SMs. With PDL the next kernel is launched early and its blocks take free SMs while
the previous one drains; each of its threads then waits in hardware until the previous grid has
completed and its memory is visible (PTX ISA, ``griddepcontrol``; CUDA programming guide,
"Programmatic Dependent Launch and Synchronization").

Device side (call from kernels; inlined, no registers):

- :func:`pdl_wait`: ``griddepcontrol.wait``, the thread blocks until every prerequisite grid has
  completed and its writes are visible. Returns at once in a kernel launched without PDL.
- :func:`pdl_release`: ``griddepcontrol.launch_dependents``, this block allows the dependent grid
  to launch (it launches once every block has released or exited).
- :func:`pdl_begin`: the wait, then the release if :data:`RELEASE_AT_START`: the rule for every
  kernel of the engine, as its first statement. Reads of memory that no kernel of the step
  writes (the weights) may go before a :func:`pdl_wait`; nothing else may, and no write may.
- :func:`pdl_begin_early` ``(release_next)``: the wait, then the release if the launch argument
  ``release_next`` is nonzero and :data:`RELEASE_EARLY` is on (or :data:`RELEASE_AT_START`): the
  first statement of a kernel that may precede one which reads its first weights before its own
  wait (:data:`WEIGHTS_BEFORE_WAIT`). The engine passes ``release_next`` = 1 only where the next
  kernel of the stream is such a kernel, so that its blocks take the SMs this grid leaves free
  and stream those weights while this grid runs; before any other kernel the release stays at the
  blocks' exits (releasing at the start before kernels with nothing to do timed slower).

Weights before the wait: the kernels named in :data:`WEIGHTS_BEFORE_WAIT` (``gemv``, the split
absorb at one row) load their first round of weights, then call :func:`pdl_begin_early`: so in
the PTX; in gemv's sm_90 SASS ptxas scheduled the wait (``ACQBULK``) above those loads
(PERFORMANCE run pdl early timed; the split absorb's SASS unchecked), so gemv gains nothing there
as built (tests/test_pdl.py's SASS test, a strict xfail). The weights are
written by no kernel of a step (only by the host, before any step), so the early reads see their
final values (a caller that writes a weight array in a kernel must not launch these right after it
inside ``programmatic_launches``). ``tests/test_pdl.py`` checks that nothing before that call names
another array (source) and that exactly the first round's weight loads (``ld.global.nc``) precede
the wait (sm_90 PTX).

Host side (:mod:`sim.launch`): a kernel whose Python body calls :func:`pdl_begin`,
:func:`pdl_begin_early` or :func:`pdl_wait` (found by name, :func:`sim.launch.takes_programmatic_launch`) is launched with
``programmatic_stream_serialization`` inside :func:`sim.launch.programmatic_launches`; every
other kernel and every launch outside that context is an ordinary launch, for which the wait is a
no-op. Because each such kernel waits before it touches memory, ordering stays transitive: kernel
n + 2's wait returns after kernel n + 1 completed, which was after kernel n completed.

Both instructions need sm_90 (PTX ISA 7.8), as do the project's two targets (sm_90, sm_120) and
the top-k's ``max.bf16x2``. Under the simulator, where every launch runs to completion before the
next, they are no-ops.
"""
from __future__ import annotations

from typing import Any

from numba import cuda

__all__ = ["pdl_wait", "pdl_release", "pdl_begin", "pdl_begin_early", "ENTRY_POINTS", "RELEASE_AT_START",
           "RELEASE_EARLY", "WEIGHTS_BEFORE_WAIT", "RELEASE_MODES", "set_release_mode"]

# Whether pdl_begin releases the next grid at once (True) or leaves the release to each block's
# exit (False: the next grid launches as this one's blocks drain). Read when the first kernel
# compiles (a compile-time constant, so set it before any launch; bench.forward_ab's
# --pdl-release). Run "pdl timed" (56a032e, H200, graph replays): releasing at the start made
# small's forward slower, 1057.2 -> 1124.6 us at one row and 2283.1 -> 2364.8 us at 33 rows, so
# the release is left to the exits; run "fold" (4d403ab) timed that: 1055.1 against 1060.2 us
# at one row, 2250.2 against 2261.1 at 33 (means of two passes): -0.5 %.
RELEASE_AT_START = False

# Whether pdl_begin_early(release_next) releases the next grid right after the wait when its
# launch passed release_next = 1 (True), or always leaves it to the blocks' exits as pdl_begin does
# (False; bench.forward_ab's --pdl-release exit). Read when the first kernel compiles. The engine
# passes 1 only before a kernel that reads weights before its wait, and only with its own switch
# engine.model.PDL_RELEASE_EARLY on (off by default). Run "pdl early timed" (128f022, H200): the
# early release made small's 1-row forward 9.8 us slower than no PDL, where the release at the exits
# saved 8.1 us; in gemv's sm_90 SASS ptxas put the wait (ACQBULK) above the first weight loads, so
# its early blocks had no loads to issue before their wait (the split absorb's SASS unchecked).
RELEASE_EARLY = True

# The release policies (set_release_mode): "early" (the defaults: pdl_begin_early releases right
# after the wait where its launch passes release_next, every other kernel at its blocks' exits),
# "exit" (every kernel at its blocks' exits) and "start" (every kernel right after its wait:
# RELEASE_AT_START).
RELEASE_MODES = ("early", "exit", "start")


def set_release_mode(mode: str) -> None:
    """Set RELEASE_AT_START / RELEASE_EARLY for one of RELEASE_MODES. The kernels compile the
    flags in, so call it before the first kernel compiles (bench.forward_ab's and
    bench.decode_step's --pdl-release); a process runs one mode.

    Raises:
        ValueError: ``mode`` is not one of RELEASE_MODES.
    """
    global RELEASE_AT_START, RELEASE_EARLY
    if mode not in RELEASE_MODES:
        raise ValueError(f"mode must be one of {RELEASE_MODES}, got {mode!r}")
    RELEASE_AT_START = mode == "start"
    RELEASE_EARLY = mode == "early"


# Kernels (module file: kernel function) that read weights before their wait (the split absorb
# at one row only); every other engine kernel begins with pdl_begin / pdl_begin_early
# (tests/test_pdl.py checks both rules).
WEIGHTS_BEFORE_WAIT = ("gemv.py:kernel", "absorb.py:split_kernel")

# The device functions whose call makes a kernel take programmatic launches (sim.launch's
# takes_programmatic_launch reads this tuple; a kernel must call one of them before any access
# to memory another kernel writes).
ENTRY_POINTS = ("pdl_begin", "pdl_begin_early", "pdl_wait")


def _make_instructions() -> tuple[Any, Any]:
    """``(wait, release)`` device callables: the two ``griddepcontrol`` instructions on a GPU,
    no-ops under the simulator."""
    if cuda.config.ENABLE_CUDASIM:
        def griddepcontrol_wait() -> None:
            """The simulator runs each launch to completion: nothing to wait for."""

        def griddepcontrol_launch_dependents() -> None:
            """The simulator launches nothing early."""

        return griddepcontrol_wait, griddepcontrol_launch_dependents

    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    def _instruction(text: str) -> Any:
        @intrinsic
        def instruction(typingctx):
            def codegen(context, builder, signature, args):
                # side effects + a memory clobber: LLVM moves no memory access across it (the
                # project's own asm loads carry no memory attributes, so they count as accesses);
                # tests/test_pdl.py checks the order in the PTX of a kernel of each module
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return types.void(), codegen

        return instruction

    return _instruction("griddepcontrol.wait;"), _instruction("griddepcontrol.launch_dependents;")


_griddepcontrol_wait, _griddepcontrol_launch_dependents = _make_instructions()


@cuda.jit(device=True, inline="always")
def pdl_wait():
    """Block this thread until the previous grids have completed and their writes are visible."""
    _griddepcontrol_wait()


@cuda.jit(device=True, inline="always")
def pdl_release():
    """Let the next grid launch once every block of this one has released (or exited)."""
    _griddepcontrol_launch_dependents()


@cuda.jit(device=True, inline="always")
def pdl_begin():
    """A kernel's first statement: wait for the previous grid; with :data:`RELEASE_AT_START`, then
    let the next one launch (its blocks take SMs this grid leaves free and wait there). Without it
    the next grid launches as this grid's blocks exit, still before its completion and flush."""
    _griddepcontrol_wait()
    if RELEASE_AT_START:   # a compile-time constant: the branch folds away
        _griddepcontrol_launch_dependents()


@cuda.jit(device=True, inline="always")
def pdl_begin_early(release_next):
    """pdl_begin with a per-launch release: wait for the previous grid; then, if ``release_next``
    (a launch argument, the same in every thread: nonzero where the next kernel of the stream
    reads weights before its wait) and :data:`RELEASE_EARLY`, let the next grid launch at once, so
    its blocks load their first weights on the SMs this grid leaves free while this grid runs.
    With :data:`RELEASE_AT_START` it always releases, as :func:`pdl_begin`."""
    _griddepcontrol_wait()
    if RELEASE_AT_START or (RELEASE_EARLY and release_next != 0):   # (the constants fold)
        _griddepcontrol_launch_dependents()
