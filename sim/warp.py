"""Warp intrinsics for the numba-cuda simulator (stack §2, "Warp shim").

The simulator (numba-cuda 0.30.x, ``numba/cuda/simulator/kernel.py``) runs each CUDA thread of
a block as a Python thread (``BlockThread``, which knows its ``thread_id`` and its block's
``BlockManager``), one block after another; kernels see a ``FakeCUDAModule`` instance as
``cuda``, which has no warp intrinsics. :func:`install` adds them to that class.

Simulation: warps are consecutive groups of 32 linear thread ids (x fastest, then y, z); the
last warp of a block may be partial. A warp-synchronous call is a meeting of all lanes of the
warp at a ``threading.Barrier`` (one per warp per block, kept per ``BlockManager`` so several
blocks and repeated launches never share state): each lane publishes its value and a tag
(intrinsic, call number) in a mailbox, waits, then reads. Two mailboxes alternate by call
number, so one barrier per call suffices: a lane can only reach call k + 2, and overwrite the
mailbox of call k, after every lane has arrived at call k + 1, i.e. has finished reading call k.

Semantics are PTX ``shfl.sync`` / ``vote.sync`` with width 32 (what numba emits): the lane,
delta and lane-mask operands use their low 5 bits; ``shfl_up/down_sync`` keep the caller's value
when the source lane falls outside 0..31. Loud failures instead of wrong answers or hangs:

- a lane that never arrives: ``WarpDivergenceError`` after ``WARP_TIMEOUT_S`` seconds;
- lanes at different intrinsics or different call counts: ``WarpDivergenceError``;
- a mask other than full-warp participation (0xFFFFFFFF, or all lanes of a partial warp):
  ``NotImplementedError``;
- reading a lane that does not exist in a partial warp (undefined on the GPU): ``ValueError``;
- types numba would reject (a float lane offset, a uint32 or bool shuffle value): ``TypeError``.

Any of these aborts the block's warp barriers, so the other lanes fail at once rather than
after the timeout. ``ballot_sync`` and ``activemask`` return ``np.uint32`` (the CUDA C type; on
the GPU numba types ``ballot_sync`` as int32, so treat it as a bit pattern, never shift it
right). ``any_sync`` / ``all_sync`` return ``bool``.
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["WARP_TIMEOUT_S", "WarpDivergenceError", "install", "mma_sync_m16n8k8_tf32"]

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
LANE_BITS = WARP_SIZE - 1  # PTX keeps b[4:0] of the lane / delta / lane-mask operand
WARP_TIMEOUT_S = 30.0  # seconds a lane waits for the rest of its warp (tests set it small)

_SHFL_TYPES = (int, float, np.int32, np.int64, np.float32, np.float64)  # numba: i4, i8, f4, f8
_INT_TYPES = (int, np.integer)


class WarpDivergenceError(RuntimeError):
    """The lanes of a warp did not all make the same warp-synchronous call."""


class _Warp:
    """Meeting point of the lanes of one warp of one block."""

    def __init__(self, n_lanes: int) -> None:
        self.n_lanes = n_lanes
        self.barrier = threading.Barrier(n_lanes)
        self.calls = [0] * n_lanes  # warp-synchronous calls made so far, per lane
        self.values = ([None] * n_lanes, [None] * n_lanes)  # two mailboxes, by call parity
        self.tags = ([None] * n_lanes, [None] * n_lanes)
        self.mma_result: tuple | None = None  # (mailbox, tag, fragments) of the last mma (sim's mma model)


class _Block:
    """The warps of one simulated block, and the first error a lane raised in a warp call."""

    def __init__(self, n_threads: int) -> None:
        self.warps = [_Warp(min(WARP_SIZE, n_threads - first))
                      for first in range(0, n_threads, WARP_SIZE)]
        self.failure: Exception | None = None


_blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BlockManager -> _Block
_blocks_lock = threading.Lock()


def _is_int(x: Any) -> bool:
    return isinstance(x, _INT_TYPES) and not isinstance(x, bool)


def _current_block(name: str) -> tuple[_Block, int]:
    """The calling thread's block (created on first use) and its linear thread id."""
    thread = threading.current_thread()
    manager = getattr(thread, "_manager", None)
    if manager is None:
        raise RuntimeError(f"cuda.{name} called outside a simulated kernel")
    with _blocks_lock:
        block = _blocks.get(manager)
        if block is None:
            block = _blocks[manager] = _Block(int(np.prod(manager._block_dim)))
    return block, thread.thread_id


def _check_mask(name: str, mask: Any, n_lanes: int) -> None:
    if not _is_int(mask):
        raise TypeError(f"cuda.{name}: mask must be an integer, got {type(mask).__name__}")
    mask = int(mask) & FULL_MASK  # numba truncates the mask to 32 bits
    all_lanes = (1 << n_lanes) - 1
    if mask not in (FULL_MASK, all_lanes):
        raise NotImplementedError(
            f"cuda.{name}: mask {mask:#010x} is not simulated; only full-warp participation "
            f"({FULL_MASK:#010x}, or {all_lanes:#010x} for this warp of {n_lanes} lanes) is")


def _meet(name: str, mask: Any, value: Any) -> tuple[list, int]:
    """Publish ``value``, wait for the whole warp, return (the warp's values, own lane)."""
    block, thread_id = _current_block(name)
    warp, lane = block.warps[thread_id // WARP_SIZE], thread_id % WARP_SIZE
    _check_mask(name, mask, warp.n_lanes)
    call = warp.calls[lane]
    warp.calls[lane] = call + 1
    box = call & 1
    warp.values[box][lane] = value
    warp.tags[box][lane] = (name, call)
    try:
        warp.barrier.wait(WARP_TIMEOUT_S)
    except threading.BrokenBarrierError:
        cause = block.failure
        if cause is not None:  # keep the first failure's type and message
            raise type(cause)(f"cuda.{name} (lane {lane}) abandoned: another lane failed: "
                              f"{cause}") from None
        raise WarpDivergenceError(
            f"cuda.{name} (lane {lane}, warp-synchronous call #{call}): the other lanes did "
            f"not arrive within WARP_TIMEOUT_S={WARP_TIMEOUT_S} s; divergent warp-synchronous "
            "code?") from None
    for other, tag in enumerate(warp.tags[box]):
        if tag != (name, call):
            raise WarpDivergenceError(
                f"cuda.{name}: lane {lane} is at warp-synchronous call #{call} ({name}) but lane "
                f"{other} is at {'no call' if tag is None else f'call #{tag[1]} ({tag[0]})'}")
    return warp.values[box], lane


def _shuffle(name: str, mask: Any, value: Any, operand: Any,
             source: Callable[[int, int], int | None]) -> Any:
    """Shared body of the shuffles; ``source(lane, b)`` is the source lane or None (own value)."""
    if not isinstance(value, _SHFL_TYPES) or isinstance(value, bool):
        raise TypeError(f"cuda.{name}: value must be a 32/64-bit int or float (numba accepts "
                        f"i4, i8, f4, f8), got {type(value).__name__}")
    if not _is_int(operand):
        raise TypeError(f"cuda.{name}: lane operand must be an integer, got "
                        f"{type(operand).__name__} (a float fails to compile on the GPU)")
    values, lane = _meet(name, mask, value)
    src = source(lane, int(operand) & LANE_BITS)
    if src is None:
        return value
    if src >= len(values):
        raise ValueError(f"cuda.{name}: lane {lane} reads lane {src}, which does not exist in "
                         f"this partial warp of {len(values)} lanes (undefined on the GPU)")
    return values[src]


def shfl_sync(mask: Any, value: Any, src_lane: Any) -> Any:
    """``value`` of lane ``src_lane & 31``."""
    return _shuffle("shfl_sync", mask, value, src_lane, lambda lane, b: b)


def shfl_up_sync(mask: Any, value: Any, delta: Any) -> Any:
    """``value`` of lane ``laneid - delta``, or the caller's own below lane 0."""
    return _shuffle("shfl_up_sync", mask, value, delta,
                    lambda lane, b: lane - b if lane >= b else None)


def shfl_down_sync(mask: Any, value: Any, delta: Any) -> Any:
    """``value`` of lane ``laneid + delta``, or the caller's own past lane 31."""
    return _shuffle("shfl_down_sync", mask, value, delta,
                    lambda lane, b: lane + b if lane + b < WARP_SIZE else None)


def shfl_xor_sync(mask: Any, value: Any, lane_mask: Any) -> Any:
    """``value`` of lane ``laneid ^ lane_mask``."""
    return _shuffle("shfl_xor_sync", mask, value, lane_mask, lambda lane, b: lane ^ b)


def _vote(name: str, mask: Any, predicate: Any) -> list:
    if not (_is_int(predicate) or isinstance(predicate, (bool, np.bool_))):
        raise TypeError(f"cuda.{name}: predicate must be an integer or boolean, got "
                        f"{type(predicate).__name__}")
    return _meet(name, mask, bool(predicate))[0]


def ballot_sync(mask: Any, predicate: Any) -> np.uint32:
    """Bit ``i`` set iff lane ``i``'s predicate is true."""
    votes = _vote("ballot_sync", mask, predicate)
    return np.uint32(sum(1 << lane for lane, vote in enumerate(votes) if vote))


def any_sync(mask: Any, predicate: Any) -> bool:
    """Whether any lane's predicate is true."""
    return any(_vote("any_sync", mask, predicate))


def all_sync(mask: Any, predicate: Any) -> bool:
    """Whether every lane's predicate is true."""
    return all(_vote("all_sync", mask, predicate))


def activemask() -> np.uint32:
    """All lanes of the caller's warp: only converged, full-warp code is simulated."""
    block, thread_id = _current_block("activemask")
    return np.uint32((1 << block.warps[thread_id // WARP_SIZE].n_lanes) - 1)


def syncwarp(mask: Any = FULL_MASK) -> None:
    """Barrier for the lanes of the caller's warp."""
    _meet("syncwarp", mask, None)


_TF32_KEEP = np.uint32(0xFFFFE000)   # the 19 bits a tensor core reads of a .tf32 operand


def mma_sync_m16n8k8_tf32(a0: Any, a1: Any, a2: Any, a3: Any, b0: Any, b1: Any,
                          c0: Any, c1: Any, c2: Any, c3: Any) -> tuple:
    """PTX ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` for the simulator: the warp's
    fragments meet (lane g = lane / 4, t = lane % 4: a0 A[g][t], a1 A[g+8][t], a2 A[g][t+4],
    a3 A[g+8][t+4]; b0 B[t][g], b1 B[t+4][g]; c0 C[g][2t], c1 C[g][2t+1], c2 C[g+8][2t],
    c3 C[g+8][2t+1]) and each lane gets its D = A B + C in C's layout. Model of the hardware's
    sum (which PTX leaves unspecified): A and B read as TF32 (low 13 bits ignored), the 8
    products (exact in float64) summed in float64 in k order, C added, rounded to float32.
    Deterministic and a function of each element's own row, column and C (what batch invariance
    needs); not the GPU's bits. Not a ``cuda`` attribute: kernels reach it through
    ``ddtree_numba.kernels.linear_tc.mma_tf32``."""
    try:
        return _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    except Exception as error:
        _abort_block(error)
        raise


def _mma(*mine: Any) -> tuple:
    for v in mine:
        if type(v) is not np.float32:     # the GPU intrinsic takes float32 only
            raise TypeError(f"mma_sync_m16n8k8_tf32: operands must be float32, got {type(v).__name__}")
    values, lane = _meet("mma_sync_m16n8k8_tf32", FULL_MASK, mine)
    if len(values) != WARP_SIZE:
        raise ValueError("mma_sync_m16n8k8_tf32 needs a full warp of 32 lanes")
    # one lane computes the warp's fragments, the others read them (each lane finishes reading
    # before any lane can meet again with this mailbox: the next call's barrier is in between)
    block, thread_id = _current_block("mma_sync_m16n8k8_tf32")
    warp = block.warps[thread_id // WARP_SIZE]
    tag = warp.tags[(warp.calls[lane] - 1) & 1][lane]
    done = warp.mma_result
    if done is None or done[0] is not values or done[1] != tag:
        done = (values, tag, _mma_fragments(values))
        warp.mma_result = done
    return done[2][lane]


def _mma_fragments(values: list) -> list[tuple]:
    """Every lane's D fragment of the warp's ``values`` (32 tuples of a0..a3, b0, b1, c0..c3), as
    NumPy arrays: A and B as TF32, the 8 products summed in float64 in k order, C added, rounded
    to float32 (one vectorised pass: the scalar loops took ~20 ms a call, 32 lanes each)."""
    v = np.array(values, np.float32).reshape(8, 4, 10)            # [g, t, operand]
    ab = (v[:, :, :6].view(np.uint32) & _TF32_KEEP).view(np.float32).astype(np.float64)
    a = np.empty((16, 8))
    a[:8, :4], a[8:, :4], a[:8, 4:], a[8:, 4:] = ab[:, :, 0], ab[:, :, 1], ab[:, :, 2], ab[:, :, 3]
    b = np.empty((8, 8))
    b[:4, :], b[4:, :] = ab[:, :, 4].T, ab[:, :, 5].T
    c = np.empty((16, 8))
    c[:8, 0::2], c[:8, 1::2], c[8:, 0::2], c[8:, 1::2] = v[:, :, 6], v[:, :, 7], v[:, :, 8], v[:, :, 9]
    total = np.zeros((16, 8))
    for k in range(8):                   # k order, as the scalar model (the same float64 sums)
        total += a[:, k:k + 1] * b[k:k + 1, :]
    d = (total + c).astype(np.float32)   # [16, 8]
    return [(d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1])
            for g in range(8) for t in range(4)]


def _abort_block(error: Exception) -> None:
    """Record ``error`` and break the block's warp barriers: no lane waits for a failed one."""
    if getattr(threading.current_thread(), "_manager", None) is None:
        return  # called outside a simulated kernel: no block to abort
    block, _ = _current_block("")
    with _blocks_lock:
        if block.failure is None:
            block.failure = error
    for warp in block.warps:
        warp.barrier.abort()


def _as_method(fn: Callable) -> Callable:
    """Bind ``fn`` as a FakeCUDAModule method that aborts the block's warps when it fails."""
    @functools.wraps(fn)
    def method(_module: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as error:
            _abort_block(error)
            raise
    return method


_INTRINSICS = (shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync,
               ballot_sync, any_sync, all_sync, activemask, syncwarp)


def install() -> None:
    """Add the warp intrinsics to the simulator's fake ``cuda`` module (idempotent).

    ``laneid`` and ``warpsize`` already exist there and are left as they are.

    Raises:
        RuntimeError: the simulator is not active (``NUMBA_ENABLE_CUDASIM`` unset when
            ``numba.cuda`` was imported); a real GPU has these intrinsics.
    """
    from numba import cuda

    if not cuda.config.ENABLE_CUDASIM:
        raise RuntimeError("sim.warp.install(): the numba-cuda simulator is not active "
                           "(set NUMBA_ENABLE_CUDASIM=1 before importing numba.cuda)")
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    for fn in _INTRINSICS:
        setattr(FakeCUDAModule, fn.__name__, _as_method(fn))
