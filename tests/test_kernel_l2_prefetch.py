"""L2 prefetch (ddtree_numba.kernels.l2_prefetch): the bytes asked for (whole 16-byte pieces, capped
at the array), every request inside the array in both modes (the simulator checks each one's
range and grain), nothing written, and bad input rejected before a launch. On a GPU: both
modes run eagerly and inside a captured graph, the array unchanged."""
import numpy as np
import pytest
from numba import cuda

from ddtree_numba.kernels import l2_prefetch as pf
from sim.install import simulator_active

RNG = np.random.default_rng(20261206)


@pytest.mark.parametrize("bulk", [True, False])
@pytest.mark.parametrize("n, nbytes, want", [
    (1, None, 0),                      # 4 bytes: no whole 16-byte piece
    (4, None, 16),
    (7, None, 16),                     # 28 bytes -> one piece
    (1000, 100, 96),                   # rounded down to the grain
    (1000, 1 << 30, 4000),             # capped at the array
    (pf.BULK_FLOATS * 3 + 12, None, (pf.BULK_FLOATS * 3 + 12) * 4),   # a partial last bulk piece
    (5000, 0, 0),
])
def test_bytes_asked_for_and_nothing_written(bulk, n, nbytes, want) -> None:
    host = RNG.standard_normal(n).astype(np.float32)
    host[::5] = -0.0
    w = cuda.to_device(host)
    assert pf.l2_prefetch(w, nbytes, bulk=bulk, blocks=3) == want
    cuda.synchronize()
    np.testing.assert_array_equal(w.copy_to_host(), host)   # bit for bit (signed zeros too)


@pytest.mark.parametrize("bulk", [True, False])
def test_any_rank_and_few_blocks_cover_every_piece(bulk) -> None:
    """A 3-D C-contiguous array is prefetched as its flat range; a grid smaller than the pieces
    strides over them (every request range-checked under the simulator)."""
    host = RNG.standard_normal((3, 5, 40)).astype(np.float32)
    w = cuda.to_device(host)
    assert pf.l2_prefetch(w, bulk=bulk, blocks=1) == host.nbytes
    np.testing.assert_array_equal(w.copy_to_host(), host)


@pytest.mark.skipif(not simulator_active(), reason="the simulator's range check (a GPU prefetch past an array faults silently or not at all)")
@pytest.mark.parametrize("bulk", [True, False])
def test_a_request_past_the_array_is_caught_by_the_simulator(bulk) -> None:
    """The kernel launched directly with a count past the array: the simulator's request check
    raises (what the wrapper's cap prevents)."""
    w = cuda.to_device(np.zeros(64, np.float32))
    with pytest.raises(Exception, match="outside the array"):
        pf._kernel(bulk)[1, 32](w, np.int64(64 + 4 * pf.BULK_FLOATS + pf.LINE_FLOATS))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(w=np.zeros(8, np.float32)), TypeError, "w must be a CUDA device array"),
    (dict(w="weights"), TypeError, "w must be a CUDA device array"),
    (dict(w=cuda.to_device(np.zeros(8, np.float64))), TypeError, "w must have dtype float32"),
    (dict(w=cuda.to_device(np.zeros((4, 8), np.float32)).T), ValueError, "w must be C-contiguous"),
    (dict(nbytes=-16), ValueError, "nbytes must be >= 0"),
    (dict(nbytes=True), TypeError, "nbytes must be an int"),
    (dict(nbytes=16.0), TypeError, "nbytes must be an int"),
    (dict(blocks=0), ValueError, "blocks must be >= 1"),
    (dict(bulk=1), TypeError, "bulk must be a bool"),
])
def test_bad_input_is_rejected_before_a_launch(monkeypatch, kwargs, error, match) -> None:
    launched = []
    monkeypatch.setattr(pf, "launch", lambda *a, **k: launched.append(a))
    args = dict(w=cuda.to_device(np.zeros(64, np.float32)))
    args.update(kwargs)
    w = args.pop("w")
    with pytest.raises(error, match=match):
        pf.l2_prefetch(w, **args)
    assert not launched


def test_registered_for_the_compile_check() -> None:
    from ddtree_numba.kernels.registry import get
    for name in ("l2_prefetch_bulk", "l2_prefetch_lines"):
        spec = get(name)
        assert spec.block_threads == pf.PREFETCH_THREADS


@pytest.mark.gpu
@pytest.mark.parametrize("bulk", [True, False])
def test_gpu_prefetch_eager_and_in_a_captured_branch(bulk) -> None:
    """On a GPU: eager launches of both modes, and a captured graph whose forked branch prefetches
    and joins back (the engine's pattern): the array unchanged after ten replays."""
    from cuda.core import Device

    from ddtree_numba.engine.graphs import core_stream, is_graph_builder

    host = RNG.standard_normal(3 * pf.BULK_FLOATS + 100).astype(np.float32)
    w = cuda.to_device(host)
    assert pf.l2_prefetch(w, bulk=bulk) == (host.size // 4 * 16)
    cuda.synchronize()
    device = Device()
    device.set_current()
    builder = device.create_graph_builder()
    builder.begin_building("thread_local")
    assert is_graph_builder(builder)
    main, side = builder.split(2)
    pf.l2_prefetch(w, stream=side, bulk=bulk)
    type(main).join(main, side)
    builder.end_building()
    graph = builder.complete()
    builder.close()
    stream = core_stream(0)
    for _ in range(10):
        graph.launch(stream)
    stream.sync()
    graph.close()
    np.testing.assert_array_equal(w.copy_to_host(), host)
