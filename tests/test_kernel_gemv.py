"""One-row products (ddtree_numba.kernels.gemv): the same bits as linear's 1-row tile, and through it
as any row of a many-row launch (linear's batch invariance), for every prologue, residual and
layout, on random, tie-heavy and signed-zero inputs; the plan's rule; bad input rejected before a
launch. Under the simulator linear itself is checked against a NumPy emulation of the order
(tests/test_kernel_linear.py), so agreeing with it bit for bit checks gemv's order too."""
import numpy as np
import pytest
from numba import cuda

from ddtree_numba.kernels import gemv as gv
from ddtree_numba.kernels import linear as lin
from tests.linear_checks import dev as _dev, product_inputs, prologue_kwargs as _kwargs

RNG = np.random.default_rng(20261205)
LAYOUT_NAMES = tuple(gv.LAYOUTS)


def _inputs(n, k, prologue, residual, kind, rng):
    """x [1, Kx], w [N, K], norm [K], residual [1, N] (tests.linear_checks.product_inputs)."""
    return product_inputs(1, n, k, prologue, residual, kind, rng)


def _both(x, w, prologue, norm, res, layout=None):
    """(linear's output, gemv's) for the same inputs."""
    outs = []
    for fn in (lin.linear, gv.gemv):
        out = cuda.to_device(np.full((1, w.shape[0]), np.nan, np.float32))
        extra = {"layout": layout} if fn is gv.gemv and layout is not None else {}
        fn(_dev(x), _dev(w), out, **_kwargs(prologue, norm, res), **extra)
        outs.append(out.copy_to_host())
    return outs


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("prologue,residual", [("none", False), ("none", True), ("rmsnorm", False),
                                               ("rmsnorm", True), ("swiglu", True), ("swiglu", False)])
@pytest.mark.parametrize("n,k,kind", [(7, 128, "random"), (13, 384, "ties"), (6, 2304, "random"),
                                      (5, 4224, "zeros")])
def test_gemv_matches_linear_bit_for_bit(layout, prologue, residual, n, k, kind):
    """N not a multiple of the columns (the last group re-reads the last row, stores nothing past
    N); K of one, two and four segments (linear.k_split: 1, 2, 4), a last round shorter than U."""
    x, w, norm, res = _inputs(n, k, prologue, residual, kind, RNG)
    ref, got = _both(x, w, prologue, norm, res, gv.LAYOUTS[layout])
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))


def test_gemv_row_equals_a_row_of_a_many_row_linear():
    """Through linear's invariance: gemv on row 3 of a 9-row input gives that row of linear's 9-row
    launch (RMSNorm prologue, residual), bit for bit."""
    n, k = 9, 640
    x = RNG.standard_normal((9, k)).astype(np.float32)
    w = RNG.standard_normal((n, k)).astype(np.float32)
    norm = (1.0 + 0.1 * RNG.standard_normal(k)).astype(np.float32)
    res = RNG.standard_normal((9, n)).astype(np.float32)
    many = cuda.to_device(np.full((9, n), np.nan, np.float32))
    lin.linear(_dev(x), _dev(w), many, norm_weight=_dev(norm), eps=1e-6, residual=_dev(res))
    one = cuda.to_device(np.full((1, n), np.nan, np.float32))
    gv.gemv(_dev(x[3:4]), _dev(w), one, norm_weight=_dev(norm), eps=1e-6, residual=_dev(res[3:4]))
    assert np.array_equal(many.copy_to_host()[3].view(np.uint32), one.copy_to_host()[0].view(np.uint32))


def test_plan_gemv_rule():
    """A layout up to MAX_WEIGHT_BYTES with whole steps; SwiGLU takes its own; none past the
    bytes (small's dense gate | up, 92 MB, and the lm_head stay with linear) or for K % 128."""
    assert gv.plan_gemv("rmsnorm", 1344, 2048) == gv.LAYOUTS["narrow"]      # small's w_a
    assert gv.plan_gemv("rmsnorm", 12288, 768) == gv.LAYOUTS["narrow"]     # w_q
    assert gv.plan_gemv("none", 2048, 8192) == gv.LAYOUTS["narrow"]        # wo
    assert gv.plan_gemv("swiglu", 2048, 5632) == gv.LAYOUTS["swiglu"]      # dense w2
    assert gv.plan_gemv("rmsnorm", 11264, 2048) is None                    # dense w13
    assert gv.plan_gemv("rmsnorm", 32768, 2048) is None                    # lm_head
    assert gv.plan_gemv("none", 16, 100) is None                           # K not whole steps
    for layout in gv.LAYOUTS.values():
        assert lin.k_split(8192) <= layout.warps and layout.columns * layout.unroll <= 16
    w = _dev(np.ones((8, 256), np.float32))
    assert gv.takes(_dev(np.ones((1, 256), np.float32)), w)
    assert gv.takes(_dev(np.ones((1, 512), np.float32)), w, swiglu=True)
    assert not gv.takes(_dev(np.ones((2, 256), np.float32)), w)                       # two rows
    assert not gv.takes(_dev(np.ones((1, 100), np.float32)), _dev(np.ones((8, 100), np.float32)))


def test_gemv_rejects_bad_input_before_launch():
    w = _dev(RNG.standard_normal((8, 256)).astype(np.float32))
    out = cuda.to_device(np.full((1, 8), np.nan, np.float32))
    with pytest.raises(ValueError, match="x"):       # two rows
        gv.gemv(_dev(np.ones((2, 256), np.float32)), w, cuda.to_device(np.zeros((2, 8), np.float32)))
    with pytest.raises(ValueError, match="x"):       # K not a multiple of 128
        gv.gemv(_dev(np.ones((1, 100), np.float32)), _dev(np.ones((8, 100), np.float32)), out)
    with pytest.raises(TypeError, match="layout"):
        gv.gemv(_dev(np.ones((1, 256), np.float32)), w, out, layout=(2, 4, 4, 4))
    with pytest.raises(ValueError, match="layout"):  # 4 segments, 2 warps a block
        gv.gemv(_dev(np.ones((1, 8192), np.float32)), _dev(np.ones((4, 8192), np.float32)),
                cuda.to_device(np.zeros((1, 4), np.float32)), layout=gv.GemvLayout(2, 4, 2, 4))
    norm = cuda.to_device(np.ones(260, np.float32))[4:]    # off 16 bytes (simulator: no addresses)
    if not cuda.config.ENABLE_CUDASIM:
        with pytest.raises(ValueError, match="norm_weight"):
            gv.gemv(_dev(np.ones((1, 256), np.float32)), w, out, norm_weight=norm)
    with pytest.raises(TypeError):                   # float64 input (check_linear_args)
        gv.gemv(_dev(np.ones((1, 256))), w, out)
    assert np.isnan(out.copy_to_host()).all()        # nothing written


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k,prologue,residual", [
    ("w_a", 1344, 2048, "rmsnorm", False), ("w_q", 12288, 768, "rmsnorm", False),
    ("wo", 2048, 8192, "none", True), ("w2", 2048, 5632, "swiglu", True)])
def test_gpu_gemv_matches_linear_at_small_shapes(name, n, k, prologue, residual):
    """small's 1-row products on the GPU: gemv's plan against linear, bit for bit, random and tie-heavy."""
    for kind in ("random", "ties"):
        x, w, norm, res = _inputs(n, k, prologue, residual, kind, RNG)
        ref, got = _both(x, w, prologue, norm, res)
        assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)), (name, kind)


@pytest.mark.gpu
def test_gpu_gemv_chain_with_early_release_under_pdl():
    """Eight dependent 1-row products (each reads the previous one's output; RMSNorm prologue;
    8192 x 2048 alternating with small's wo shape 2048 x 8192: one K segment and four), each
    releasing the next early (release_next) while the next loads its weights before its wait:
    under programmatic launches,
    eagerly and replayed from a captured graph with a new input before each replay, the last
    output is the bits of the same chain launched ordinarily. A product that read its input
    before the previous one finished would see the last replay's values."""
    from cuda.core import Device

    from ddtree_numba.engine.graphs import StepGraph
    from sim.launch import programmatic_launch_count, programmatic_launches

    rng = np.random.default_rng(7)
    shapes = [(8192, 2048), (2048, 8192)] * 4
    weights = [_dev((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)) for s in shapes]
    norms = [_dev((1.0 + 0.1 * rng.standard_normal(s[1])).astype(np.float32)) for s in shapes]
    bufs = [cuda.device_array((1, s[0]), np.float32) for s in shapes]
    x0 = cuda.device_array((1, 2048), np.float32)
    stream = Device().create_stream()

    def chain(s):
        x = x0
        for i, (w, norm, out) in enumerate(zip(weights, norms, bufs)):
            gv.gemv(x, w, out, norm_weight=norm, eps=1e-6, stream=s, release_next=i + 1 < len(weights))
            x = out

    def run_plain(x_host):
        x0.copy_to_device(x_host)
        cuda.synchronize()
        chain(0)
        cuda.synchronize()
        return bufs[-1].copy_to_host()

    inputs = [rng.standard_normal((1, 2048)).astype(np.float32) for _ in range(4)]
    want = [run_plain(x) for x in inputs]
    count = programmatic_launch_count()
    with programmatic_launches():
        x0.copy_to_device(inputs[0])
        cuda.synchronize()   # the copy done before the launches on the non-blocking stream
        chain(stream)
        stream.sync()
        assert programmatic_launch_count() == count + len(weights)
        assert np.array_equal(bufs[-1].copy_to_host().view(np.uint32), want[0].view(np.uint32))
        graph = StepGraph(chain, stream)
        graph.warm_up()
        graph.capture()
        for x, ref in zip(inputs * 5, want * 5):
            x0.copy_to_device(x)
            cuda.synchronize()   # the copy done before the replay (the stream does not wait for it)
            graph.replay()
            stream.sync()
            assert np.array_equal(bufs[-1].copy_to_host().view(np.uint32), ref.view(np.uint32))
        graph.close()


def _ar_step_logits(config, weights):
    """The logits of one AR step (1 row over 5 cached rows) of a fresh batch-1 model, at the
    engine's current switches."""
    import ddtree_numba.engine.model as em
    from ddtree_numba.bench.profile_forward import forward_inputs

    model = em.TargetModel(config, weights, batch_size=1, kv_capacity=8, max_rows=1)
    model.advance(cuda.to_device(np.array([5], np.int32)))
    return model.forward(*forward_inputs(1, 5)).logits.copy_to_host()


def test_engine_ar_step_runs_gemv_with_linears_bits(monkeypatch):
    """tiny's AR forward (1 row over 5 cached rows) launches gemv for the products it has a layout
    for (tiny's dense down projection, K 128), and its logits are the bits of the same forward with
    ROW_PRODUCTS off (every product in linear's tile)."""
    import ddtree_numba.engine.model as em
    from ddtree_numba.config import ModelConfig
    from reference.weights import init_weights

    config = ModelConfig.from_name("tiny")
    weights = init_weights(config, 0)
    calls = []
    real = em.gemv
    monkeypatch.setattr(em, "gemv", lambda *a, **k: (calls.append(a[1].shape), real(*a, **k))[1])
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(em, "ROW_PRODUCTS", on)
        logits[on] = _ar_step_logits(config, weights)
        if on:
            assert calls and all(k % 128 == 0 for _, k in calls), calls
            count = len(calls)
    assert len(calls) == count   # none with the switch off
    assert np.array_equal(logits[True].view(np.uint32), logits[False].view(np.uint32))


# --- expert_gemv: expert_linear's bits, a block row per CSR entry --------------------------------

def _routing(kind, experts, entries, rows, rng):
    """(row_offsets int32 [E + 1], row_index int32 [J]): "random" counts, "one" every entry on the
    last expert, "short" fewer routed entries than J (the rest unwritten), "bad" one source row
    outside x (a NaN row)."""
    routed = entries - 2 if kind == "short" else entries
    if kind == "one":
        counts = np.zeros(experts, np.int64)
        counts[-1] = routed
    else:
        counts = rng.multinomial(routed, np.full(experts, 1.0 / experts))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    index = rng.integers(0, rows, entries).astype(np.int32)
    if kind == "bad":
        index[entries // 2] = rows
    return offsets, index


def _expert_both(x, w, offsets, index, swiglu, layout=None):
    """(expert_linear's output, expert_gemv's) for the same inputs, both from NaN-free fills."""
    outs = []
    for fn in (lin.expert_linear, gv.expert_gemv):
        out = cuda.to_device(np.full((len(index), w.shape[1]), 7.0, np.float32))
        extra = {"layout": layout} if fn is gv.expert_gemv and layout is not None else {}
        # (device routing: expert_linear checks host values, and the "bad" row is device data)
        fn(_dev(x), _dev(w), out, _dev(offsets), _dev(index), swiglu=swiglu, **extra)
        outs.append(out.copy_to_host())
    return outs


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("experts,n,k,rows,entries,kind,values", [
    (5, 12, 256, 1, 5, "random", "random"),     # an AR step's shape: k + 1 entries of one row
    (3, 7, 384, 2, 4, "one", "ties"),           # N not a multiple of the columns, 2 K segments
    (6, 9, 640, 3, 6, "short", "zeros"),        # entries past row_offsets[E] stay unwritten
    (4, 8, 128, 2, 5, "bad", "random")])        # a source row outside x: a NaN row
def test_expert_gemv_matches_expert_linear_bit_for_bit(swiglu, experts, n, k, rows, entries, kind, values):
    rng = np.random.default_rng(hash((swiglu, experts, n, k, kind)) % 2**32)
    kx = 2 * k if swiglu else k
    x = np.concatenate([_inputs(n, k, "swiglu" if swiglu else "none", False, values, rng)[0]
                        for _ in range(rows)])[:, :kx]
    w = np.stack([_inputs(n, k, "none", False, values, rng)[1] for _ in range(experts)])
    offsets, index = _routing(kind, experts, entries, rows, rng)
    ref, got = _expert_both(x, w, offsets, index, swiglu)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    if kind == "short":
        assert np.all(got[offsets[-1]:] == 7.0)
    if kind == "bad":
        assert np.isnan(got[entries // 2]).all() and np.isfinite(np.delete(got, entries // 2, 0)).all()


def test_expert_gemv_every_layout_and_an_entry_equals_a_dense_gemv():
    """Both layouts give expert_linear's bits; an entry's row is gemv's row of x @ w[e].T (linear's
    invariance: the same bits whichever kernel and launch run the row)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    w = rng.standard_normal((3, 10, 512)).astype(np.float32)
    offsets = np.array([0, 1, 1, 3], np.int32)
    index = np.array([1, 0, 1], np.int32)
    for layout in gv.LAYOUTS.values():
        ref, got = _expert_both(x, w, offsets, index, False, layout)
        assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    one = cuda.to_device(np.zeros((1, 10), np.float32))
    gv.gemv(_dev(x[1:2]), _dev(w[2]), one)
    assert np.array_equal(got[2].view(np.uint32), one.copy_to_host()[0].view(np.uint32))


def test_expert_takes_rule_and_bad_input_before_launch():
    x = _dev(np.ones((1, 256), np.float32))
    w = _dev(np.ones((4, 8, 256), np.float32))
    offsets = _dev(np.array([0, 1, 2, 3, 3], np.int32))
    index = _dev(np.zeros(3, np.int32))
    out = cuda.to_device(np.full((3, 8), np.nan, np.float32))
    assert gv.expert_takes(x, w, out)
    assert not gv.expert_takes(x, w, cuda.device_array((gv.MAX_EXPERT_ENTRIES + 1, 8), np.float32))
    assert not gv.expert_takes(_dev(np.ones((1, 100), np.float32)), _dev(np.ones((4, 8, 100), np.float32)), out)
    with pytest.raises(ValueError, match="out"):     # too many entries for a block row each
        big = gv.MAX_EXPERT_ENTRIES + 1
        gv.expert_gemv(x, w, cuda.device_array((big, 8), np.float32), offsets, _dev(np.zeros(big, np.int32)))
    with pytest.raises(ValueError, match="w"):       # K not a multiple of 128
        gv.expert_gemv(_dev(np.ones((1, 100), np.float32)), _dev(np.ones((4, 8, 100), np.float32)), out,
                       offsets, index)
    with pytest.raises(ValueError, match="x"):       # swiglu needs 2K columns
        gv.expert_gemv(x, w, out, offsets, index, swiglu=True)
    with pytest.raises(ValueError, match="row_offsets"):
        gv.expert_gemv(x, w, out, _dev(np.array([0, 1, 2, 3], np.int32)), index)
    with pytest.raises(ValueError, match="row_offsets"):   # host values are checked
        gv.expert_gemv(x, w, out, np.array([0, 2, 1, 3, 3], np.int32), index)
    with pytest.raises(TypeError, match="row_index"):
        gv.expert_gemv(x, w, out, offsets, _dev(np.zeros(3, np.int64)))
    with pytest.raises(TypeError, match="layout"):
        gv.expert_gemv(x, w, out, offsets, index, layout=(2, 4, 4, 4))
    with pytest.raises(ValueError, match="layout"):  # 4 segments, 2 warps a block
        gv.expert_gemv(_dev(np.ones((1, 8192), np.float32)), _dev(np.ones((2, 4, 8192), np.float32)),
                       cuda.device_array((2, 4), np.float32), _dev(np.array([0, 1, 2], np.int32)),
                       _dev(np.zeros(2, np.int32)), layout=gv.GemvLayout(2, 4, 2, 4))
    assert np.isnan(out.copy_to_host()).all()        # nothing written


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_gpu_expert_gemv_matches_expert_linear_at_small_shapes(kind):
    """small's AR-step MoE on the GPU: 17 experts (the shared one folded in), 5 entries of one row,
    the gate | up (2048 -> 512) and the SwiGLU down projection (256 -> 2048), bit for bit; an entry
    whose source row is outside x gives expert_linear's NaN bits (the GPU's canonical NaN)."""
    rng = np.random.default_rng(5)
    offsets = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5], np.int32)   # 4 routed + shared
    x = _inputs(512, 2048, "none", False, kind, rng)[0]
    w13 = np.stack([_inputs(512, 2048, "none", False, kind, rng)[1] for _ in range(17)])
    ref, got = _expert_both(x, w13, offsets, np.zeros(5, np.int32), False)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    w2 = np.stack([_inputs(2048, 256, "none", False, kind, rng)[1] for _ in range(17)])
    ref2, got2 = _expert_both(ref, w2, offsets, np.arange(5, dtype=np.int32), True)
    assert np.array_equal(ref2.view(np.uint32), got2.view(np.uint32))
    bad = np.array([0, 1, 0, 0, 0], np.int32)   # entry 1's source row outside x: a NaN row
    ref3, got3 = _expert_both(x, w13, offsets, bad, False)
    assert np.isnan(got3[1]).all() and np.array_equal(ref3.view(np.uint32), got3.view(np.uint32))   # the NaN bits too


def test_engine_ar_step_runs_expert_gemv_with_expert_linears_bits(monkeypatch):
    """tiny with hidden and expert widths 128 (the experts' K whole steps) as an AR step: the MoE
    layer's two expert launches go through expert_gemv and the logits are the bits of the same
    forward with EXPERT_ROW_PRODUCTS off (expert_linear). The dense products stay in linear's tile
    here (gemv_takes patched off: the simulator runs gemv's 128-thread blocks slowly); a 3-row
    forward keeps expert_linear."""
    import dataclasses

    import ddtree_numba.engine.model as em
    from ddtree_numba.config import ModelConfig
    from reference.weights import init_weights

    config = dataclasses.replace(ModelConfig.from_name("tiny"), hidden_size=128, moe_intermediate=128)
    weights = init_weights(config, 0)
    monkeypatch.setattr(em, "gemv_takes", lambda *a, **k: False)
    calls = {"expert_gemv": 0, "expert_linear": 0}
    for name in calls:
        monkeypatch.setattr(em, name, lambda *a, _n=name, _r=getattr(em, name), **k:
                            (calls.__setitem__(_n, calls[_n] + 1), _r(*a, **k))[1])
    moe_layers = config.n_layers - config.n_dense_layers
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(em, "EXPERT_ROW_PRODUCTS", on)
        logits[on] = _ar_step_logits(config, weights)
        assert calls == {"expert_gemv": 2 * moe_layers, "expert_linear": 0 if on else 2 * moe_layers}, (on, calls)
    assert np.array_equal(logits[True].view(np.uint32), logits[False].view(np.uint32))
    monkeypatch.setattr(em, "EXPERT_ROW_PRODUCTS", True)   # more rows: expert_linear (the rule's first test)
    three = em.TargetModel(config, weights, batch_size=1, kv_capacity=8, max_rows=3)
    assert not three._expert_gemv_runs(None, None, None, None, None, None)
