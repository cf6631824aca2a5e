"""Cache hints with no effect on any value: ``prefetch.L2`` of a cache line.

A prefetch brings the 128-byte line that holds an element into L2 without a register waiting for
it, so a later launch's loads of that line wait on L2 instead of HBM. It writes nothing, so a
kernel with a prefetch computes the same bits as without it. Under the simulator there are no
caches: the functions only check that the element lies inside the array (a prefetch past it
would be a wrong address on a GPU).
"""
from __future__ import annotations

from llvmlite import ir
from numba import cuda, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from sim.install import simulator_active

__all__ = ["prefetch_l2", "prefetch_l2_2d", "SIM_LOG"]

# Under the simulator, a list to which each prefetch_l2_2d appends (columns of the array, row,
# column) while it is not None: how tests see which lines a kernel asked for (a prefetch changes
# no value, so its range is invisible otherwise). Unused on a GPU.
SIM_LOG: list | None = None


def _prefetch_asm(builder, ptr) -> None:
    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type]), "prefetch.L2 [$0];", "l", side_effect=True)
    builder.call(asm, [ptr])


if simulator_active():
    @cuda.jit(device=True, inline="always")
    def prefetch_l2(array, index):
        """No caches to fill: only checks that the element is inside the array."""
        if index < 0 or index >= array.shape[0]:
            raise IndexError(f"prefetch_l2 at {index}, past the array's {array.shape[0]} elements")

    @cuda.jit(device=True, inline="always")
    def prefetch_l2_2d(array, row, col):
        """No caches to fill: checks that the element is inside the array, and logs it (SIM_LOG)."""
        if row < 0 or row >= array.shape[0] or col < 0 or col >= array.shape[1]:
            raise IndexError(f"prefetch_l2_2d at ({row}, {col}), outside the array's {array.shape}")
        log = SIM_LOG
        if log is not None:
            log.append((array.shape[1], int(row), int(col)))
else:
    @intrinsic
    def prefetch_l2(typingctx, array, index):
        """``prefetch.L2`` of the cache line holding ``array[index]`` (a C-contiguous 1-D array):
        the line comes to L2 without a register waiting for it."""
        if not (isinstance(array, types.Array) and array.ndim == 1 and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, value=args[0])
            ptr = builder.gep(ary.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
            _prefetch_asm(builder, ptr)
            return context.get_dummy_value()

        return types.void(array, index), codegen

    @intrinsic
    def prefetch_l2_2d(typingctx, array, row, col):
        """``prefetch.L2`` of the cache line holding ``array[row, col]`` (a 2-D array of any
        strides; the caller keeps the index inside it)."""
        if not (isinstance(array, types.Array) and array.ndim == 2 and isinstance(row, types.Integer)
                and isinstance(col, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, value=args[0])
            inds = [context.cast(builder, args[1], signature.args[1], types.intp),
                    context.cast(builder, args[2], signature.args[2], types.intp)]
            ptr = cgutils.get_item_pointer2(context, builder, data=ary.data,
                                            shape=cgutils.unpack_tuple(builder, ary.shape, 2),
                                            strides=cgutils.unpack_tuple(builder, ary.strides, 2),
                                            layout=aryty.layout, inds=inds, wraparound=False)
            _prefetch_asm(builder, ptr)
            return context.get_dummy_value()

        return types.void(array, row, col), codegen
