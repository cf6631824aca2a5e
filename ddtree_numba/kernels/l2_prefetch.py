"""Weights into L2 ahead of the launch that reads them, from a side branch of a captured step.

An AR step at batch 1 alternates products that stream weights from HBM with launches that read
almost nothing from it: the attention over a few hundred cached rows, the MoE's RMSNorm and
routing, the RoPE / cache write, the combine (~50 us of each layer's ~150 on the H100, Nsight
Compute, run expert rows in PERFORMANCE.md). :func:`l2_prefetch` asks the memory system to bring
a weight array's first ``nbytes`` into L2 without a register waiting for them; launched on a
parallel branch of a CUDA graph (``engine.model.L2_PREFETCH``) while those launches run, it
turns the HBM's idle time into L2 hits for the next products. It writes nothing, so every
result keeps its bits; it only moves time.

Two ways of asking (compile-time ``bulk``):

- ``bulk`` (sm_90 and later): one ``cp.async.bulk.prefetch.L2.global`` a thread for each
  BULK_BYTES of the range: the copy engine walks the lines, a few instructions for megabytes;
- lines: one ``prefetch.global.L2`` a thread for each LINE_BYTES line.

Under the simulator there is no cache: both only check that the addressed range lies inside the
array (an out-of-range prefetch would be an addressing bug, harmless on a GPU but a wrong plan).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
from llvmlite import ir
from numba import cuda, float32, int64, types
from numba.core.extending import intrinsic

from sim.install import simulator_active
from sim.launch import launch

from ._args import int_arg, is_c_contiguous, is_device_array
from .registry import register

__all__ = ["BULK_BYTES", "LINE_BYTES", "PREFETCH_THREADS", "PREFETCH_BLOCKS", "l2_prefetch", "prefetch_l2_line"]

LINE_BYTES = 128  # an L2 line: one prefetch.global.L2
BULK_BYTES = 16384  # one cp.async.bulk.prefetch.L2 (a multiple of 16 bytes, as the PTX asks)
ALIGN_BYTES = 16  # the bulk prefetch's address and size granularity
FLOAT_BYTES = 4
LINE_FLOATS = LINE_BYTES // FLOAT_BYTES
BULK_FLOATS = BULK_BYTES // FLOAT_BYTES
PREFETCH_THREADS = 128
# Blocks of a prefetch launch: few, so that the branch takes a sliver of the GPU from the launches
# it runs beside (a block issues its instructions and retires; the lines arrive on their own).
PREFETCH_BLOCKS = 8
SIM_THREADS = 32


if simulator_active():
    @cuda.jit(device=True, inline="always")
    def prefetch_l2_line(array, index):
        """No caches to fill: only checks that the line is inside the array."""
        if index < 0 or index >= array.shape[0]:
            raise IndexError(f"prefetch_l2_line at {index}, outside the array's {array.shape[0]} elements")

    @cuda.jit(device=True, inline="always")
    def _prefetch_l2_bulk(array, index, nbytes):
        """No caches to fill: only checks the range [index, index + nbytes / 4) and its 16-byte grain."""
        if index < 0 or index * FLOAT_BYTES % ALIGN_BYTES != 0 or nbytes % ALIGN_BYTES != 0 \
                or index + nbytes // FLOAT_BYTES > array.shape[0]:
            raise IndexError(f"bulk prefetch of {nbytes} bytes at {index}: outside the array's "
                             f"{array.shape[0]} elements or off the 16-byte grain")
else:
    @intrinsic
    def prefetch_l2_line(typingctx, array, index):
        """``prefetch.L2`` of the cache line holding ``array[index]`` (a C-contiguous 1-D array):
        the line comes to L2 without a register waiting for it."""
        if not (isinstance(array, types.Array) and array.ndim == 1 and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            ptr = builder.gep(ary.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type]), "prefetch.L2 [$0];", "l",
                               side_effect=True)
            builder.call(asm, [ptr])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    @intrinsic
    def _prefetch_l2_bulk(typingctx, array, index, nbytes):
        """``cp.async.bulk.prefetch.L2.global`` of ``nbytes`` (a multiple of 16) from
        ``&array[index]`` (16-byte aligned): the copy engine brings the lines to L2."""
        if not (isinstance(array, types.Array) and array.ndim == 1 and isinstance(index, types.Integer)
                and isinstance(nbytes, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            ptr = builder.gep(ary.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
            size = builder.trunc(context.cast(builder, args[2], signature.args[2], types.int64), ir.IntType(32))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type, ir.IntType(32)]),
                               "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", side_effect=True)
            builder.call(asm, [ptr, size])
            return context.get_dummy_value()

        return types.void(array, index, nbytes), codegen


@functools.cache
def _kernel(bulk: bool) -> Any:
    """The prefetch kernel, compile-time ``bulk`` (one engine request a BULK_BYTES piece) or lines."""

    @cuda.jit
    def l2_prefetch_kernel(flat, count):
        """Lines of ``flat[0:count]`` into L2 (``count`` a multiple of 4: whole 16-byte pieces);
        thread t of the grid takes pieces t, t + threads, ... Writes nothing."""
        t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        threads = cuda.gridDim.x * cuda.blockDim.x
        if bulk:  # compile-time
            for start in range(t * BULK_FLOATS, count, threads * BULK_FLOATS):
                n = min(BULK_FLOATS, count - start)
                _prefetch_l2_bulk(flat, start, n * FLOAT_BYTES)
        else:
            for start in range(t * LINE_FLOATS, count, threads * LINE_FLOATS):
                prefetch_l2_line(flat, start)

    return l2_prefetch_kernel


def l2_prefetch(w: Any, nbytes: int | None = None, *, stream: Any = 0, bulk: bool = True,
                blocks: int = PREFETCH_BLOCKS) -> int:
    """Ask for the first ``nbytes`` of device array ``w`` (all of it: None) to be brought into L2.

    Args:
        w: a C-contiguous float32 device array (any rank): the weights a later launch reads.
        nbytes: bytes from its start, rounded down to whole 16-byte pieces and capped at its size.
        stream: launch stream (0, a numba stream, or a cuda.core Stream / GraphBuilder).
        bulk: one ``cp.async.bulk.prefetch.L2`` a BULK_BYTES piece (sm_90+), else one
            ``prefetch.global.L2`` a line.
        blocks: blocks of PREFETCH_THREADS threads.

    Returns:
        The bytes asked for (0: nothing launched).

    Raises:
        TypeError / ValueError naming the argument, before any launch: ``w`` a host array (no
        L2 to fill for it), not float32, not C-contiguous; ``nbytes`` / ``blocks`` not an int
        >= 0 / >= 1; ``bulk`` not a bool.
    """
    if isinstance(w, np.ndarray) or not is_device_array(w):
        raise TypeError(f"w must be a CUDA device array (the weights a later launch reads), got {type(w).__name__}")
    if np.dtype(w.dtype) != np.float32:
        raise TypeError(f"w must have dtype float32, got {np.dtype(w.dtype).name}")
    if not is_c_contiguous(w):
        raise ValueError("w must be C-contiguous")
    total = int(w.size) * FLOAT_BYTES
    nbytes = total if nbytes is None else int_arg(nbytes, "nbytes", minimum=0)
    blocks = int_arg(blocks, "blocks", minimum=1)
    if not isinstance(bulk, bool):
        raise TypeError(f"bulk must be a bool, got {type(bulk).__name__}")
    count = min(nbytes, total) // ALIGN_BYTES * ALIGN_BYTES // FLOAT_BYTES
    if count == 0:
        return 0
    threads = SIM_THREADS if simulator_active() else PREFETCH_THREADS
    launch(_kernel(bulk), blocks, threads, stream, 0, w.reshape(int(w.size)), np.int64(count))
    return count * FLOAT_BYTES


for _bulk in (True, False):
    register("l2_prefetch" + ("_bulk" if _bulk else "_lines"), _kernel(_bulk), ((float32[::1], int64),),
             "weights into L2 ahead of their launch (" + ("bulk copy-engine requests" if _bulk else "one line a thread")
             + "), writes nothing", block_threads=PREFETCH_THREADS)
