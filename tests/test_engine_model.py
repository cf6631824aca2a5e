"""TargetModel (ddtree_numba/engine): the FP32 MLA + MoE forward against the float64 reference, the
golden model file, batch invariance and the lossless tree-vs-AR property, allocation-free forwards,
and input checks.

Simulator tests run ``tiny`` (init_weights seed 0) through the golden scenario of
``reference.golden_cases`` (family ``model``): a ragged batch of two prompts (5 and 9 tokens) is
prefilled, verifies one draft tree per request, then replays each tree's deepest path as AR steps
(the first is the golden decode step). Three models share one weight upload and one KV cache
(prefill Tc = 9, tree Tc = 4, AR Tc = 1), so the bitwise checks also cover a change of Tc.
GPU tests (``-m gpu``) run ``small`` with random weights.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.config import ModelConfig
import ddtree_numba.engine.model as model_module
from ddtree_numba.engine.cache import KVCache
from ddtree_numba.engine.model import TargetModel, attention_tile_config, prefill_visibility
from ddtree_numba.engine.weights import DeviceWeights, kernel_layouts
from ddtree_numba.kernels._args import data_address
from ddtree_numba.golden import read_all
from reference import build_tree, pack_visibility
from reference.golden_cases import GOLDEN_FILES, MODEL_PRESET, MODEL_TREE, MODEL_WEIGHTS_SEED, build_cases
from reference.model import causal_visibility
from reference.model import forward as reference_forward
from reference.topk import topk_log_probs
from reference.weights import init_weights

# One xdist worker runs this module (pyproject: --dist loadgroup), so the module-scoped scenario
# (the slowest fixture of the suite under the simulator) is built once, not once per worker.
pytestmark = pytest.mark.xdist_group("engine_model")

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "data" / "golden"
# FP32 engine vs float64 reference: |engine - ref| <= TOL * max|ref| over a request's valid rows
# (logits of std ~1 over 2 layers; the float32 error is ~1e-6, the margin covers GPU FMA contraction).
LOGIT_TOL = 1e-4
HIDDEN_TOL = 1e-4
KV_CAPACITY = 32
STEPS = ("prefill", "tree", "decode")
TREE_ROWS = MODEL_TREE["budget"] + 1  # Tc of the verify step


# --------------------------------------------------------------------------- helpers


def _host(arr: Any) -> np.ndarray:
    return arr.copy_to_host()


def _assert_close(actual: np.ndarray, expected: np.ndarray, tol: float, what: str) -> None:
    """max |actual - expected| <= tol * max |expected| (expected finite)."""
    assert np.all(np.isfinite(expected)), what
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual.astype(np.float64) - expected)))
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} * {scale:.3g}"


def _deepest_path(parents: np.ndarray, depths: np.ndarray) -> list[int]:
    """Node ids from the root to the first deepest node."""
    node = int(np.argmax(depths))
    path = [node]
    while parents[node] >= 0:
        node = int(parents[node])
        path.append(node)
    return path[::-1]


def _parents_from_visibility(vis: np.ndarray) -> np.ndarray:
    """Parent of each node of an ancestor-or-self matrix: the deepest strict ancestor (-1 for the root)."""
    depths = vis.sum(axis=1) - 1
    parents = np.full(vis.shape[0], -1)
    for i in range(vis.shape[0]):
        anc = [j for j in range(i) if vis[i, j]]
        if anc:
            parents[i] = max(anc, key=lambda j: depths[j])
    return parents


def _pad_rows(arr: np.ndarray, tc: int, fill: int) -> np.ndarray:
    """[bs, T] -> int32 [bs, tc], padded with fill."""
    out = np.full((arr.shape[0], tc), fill, dtype=np.int32)
    out[:, :arr.shape[1]] = arr
    return out


@functools.cache
def _tiny() -> tuple[ModelConfig, dict[str, np.ndarray]]:
    config = ModelConfig.from_name(MODEL_PRESET)
    return config, init_weights(config, MODEL_WEIGHTS_SEED)


@functools.cache
def _golden_built() -> dict:
    return build_cases("model")


# --------------------------------------------------------------------------- the golden scenario


def _forbid_transfers(mp: pytest.MonkeyPatch, calls: list[str]) -> None:
    """Make every device allocation / host-copy entry point record its name in calls and fail."""
    array_type = type(cuda.to_device(np.zeros(1)))

    def forbidden(name: str):
        def hook(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"forward called {name}")
        return hook

    for name in ("device_array", "device_array_like", "to_device", "pinned_array", "mapped_array",
                 "managed_array"):
        if hasattr(cuda, name):
            mp.setattr(cuda, name, forbidden(f"cuda.{name}"))
    mp.setattr(array_type, "copy_to_host", forbidden("copy_to_host"))


def _record_host_args(mp: pytest.MonkeyPatch, seen: list[str]) -> None:
    """Record kernel launches given a NumPy array (an implicit host <-> device copy on a GPU)."""
    import ddtree_numba.engine.cache as cache_module
    import ddtree_numba.engine.model as model_module
    import ddtree_numba.kernels.model_ops as ops_module
    import ddtree_numba.kernels.verify_attention as va_module
    from sim import launch as launch_module

    original = launch_module.launch

    def checked(kernel, griddim, blockdim, stream, dynamic, *args, **kwargs):
        if any(isinstance(arg, np.ndarray) and arg.ndim > 0 for arg in args):
            seen.append(getattr(kernel, "__name__", repr(kernel)))
        return original(kernel, griddim, blockdim, stream, dynamic, *args, **kwargs)

    # kernels/linear.py launches its cached plans directly (no sim.launch.launch per call); a NumPy
    # argument there would be copied back with copy_to_host, which the allocation guard forbids.
    for module in (model_module, cache_module, ops_module, va_module):
        mp.setattr(module, "launch", checked)


def _step_inputs(tokens: np.ndarray, positions: np.ndarray, sizes: np.ndarray, vis: np.ndarray, tc: int):
    """Golden step arrays ([bs, T], bool vis [bs, T, T]) padded to Tc: tokens -1, positions 0,
    padding rows see themselves; visibility packed."""
    bs, t = tokens.shape
    full = np.broadcast_to(np.eye(tc, dtype=bool), (bs, tc, tc)).copy()
    full[:, :t, :t] = vis
    return (_pad_rows(tokens, tc, -1), _pad_rows(positions, tc, 0), sizes.astype(np.int32), pack_visibility(full))


@pytest.fixture(scope="module")
def scenario() -> dict[str, Any]:
    """The golden scenario on the engine (bs = 2): prefill, tree verify, then each request's deepest
    tree path replayed as AR steps (T = 1) from the same prefix; step 0 is the golden decode step.
    Step 1 runs with device inputs while allocations and host copies are forbidden.

    Three models share one weight upload and one KV cache (prefill Tc = 9, tree Tc = 4, AR Tc = 1),
    so the bitwise comparisons also cover a change of Tc. Returns host copies.
    """
    return _run_scenario("cuda-core")


@pytest.fixture(scope="module")
def scenario_tc() -> dict[str, Any]:
    """The same scenario with the dense products on the tensor cores (``products="tensor-core"``:
    kernels.linear_tc; its simulator mma is sim.warp's model)."""
    return _run_scenario("tensor-core")


def _run_scenario(products: str) -> dict[str, Any]:
    config, weights = _tiny()
    cases = _golden_built()
    pre, tree = cases["prefill"], cases["tree"]
    prefill = TargetModel(config, weights, batch_size=2, kv_capacity=KV_CAPACITY, max_rows=9, capture_layers=(0, 1),
                          products=products)
    shared = dict(weights=prefill.weights, batch_size=2, kv_capacity=KV_CAPACITY, capture_layers=(0, 1),
                  cache=prefill.cache, products=products)
    verify = TargetModel(config, max_rows=TREE_ROWS, **shared)
    decode = TargetModel(config, max_rows=1, **shared)
    out: dict[str, Any] = {}

    def run(model: TargetModel, ds, name: str) -> None:
        result = model.forward(*_step_inputs(ds.in_tokens.values, ds.in_positions.values, ds.in_sizes.values,
                                             ds.in_visibility.values, model.max_rows))
        out[name] = {"logits": _host(result.logits), "features": _host(result.features)}

    run(prefill, pre, "prefill")
    prefill.advance(pre.in_sizes.values.astype(np.int32))
    out["past_after_prefill"] = prefill.cache.read_past_lens()
    out["cache_after_prefill"] = [(_host(kv.latent), _host(kv.k_rope)) for kv in prefill.cache.layers]
    run(verify, tree, "tree")

    vis = tree.in_visibility.values
    paths = [_deepest_path(_parents_from_visibility(v), v.sum(axis=1) - 1) for v in vis]
    replay = {"logits": np.full((2, TREE_ROWS, config.vocab_size), np.nan, np.float32),
              "features": np.full((2, TREE_ROWS, 2 * config.hidden_size), np.nan, np.float32)}
    past = out["past_after_prefill"]
    out["guard"] = {"calls": [], "host_args": []}
    for depth in range(max(len(p) for p in paths)):
        live = np.array([depth < len(p) for p in paths])
        tokens = np.array([[tree.in_tokens.values[b, p[depth]] if live[b] else 0] for b, p in enumerate(paths)],
                          dtype=np.int32)
        sizes = live.astype(np.int32)
        inputs = (tokens, (past + depth).astype(np.int32)[:, None], sizes, prefill_visibility(sizes, 1))
        if depth == 1:
            inputs = tuple(cuda.to_device(a) for a in inputs)
            lengths = cuda.to_device(sizes)
            with pytest.MonkeyPatch.context() as mp:
                _forbid_transfers(mp, out["guard"]["calls"])
                _record_host_args(mp, out["guard"]["host_args"])
                result = decode.forward(*inputs)
                decode.advance(lengths)
            out["guard"]["result_is_owned"] = (result.logits is decode.buffers.logits
                                               and result.features is decode.buffers.features)
        else:
            result = decode.forward(*inputs)
            decode.advance(sizes)
        logits, features = _host(result.logits), _host(result.features)
        if depth == 0:
            out["decode"] = {"logits": logits, "features": features}
        for b, p in enumerate(paths):
            if live[b]:
                replay["logits"][b, p[depth]] = logits[b, 0]
                replay["features"][b, p[depth]] = features[b, 0]
    out["paths"] = paths
    out["replay"] = replay
    out["past_after_replay"] = prefill.cache.read_past_lens()
    return out


@pytest.mark.parametrize("step", STEPS)
def test_forward_matches_float64_reference(scenario, step) -> None:
    """Logits and captured hidden states (entries 1, 2 = outputs of layers 0, 1) of every valid row
    within LOGIT_TOL / HIDDEN_TOL of reference.model.forward (a live build of the golden cases)."""
    ds = _golden_built()[step]
    got = scenario[step]
    for b, size in enumerate(ds.in_sizes.values):
        _assert_close(got["logits"][b, :size], ds.out_logits.values[b, :size], LOGIT_TOL, f"{step} logits[{b}]")
        hidden = ds.out_hidden.values[b, :size]  # [T, entry, D]
        features = got["features"][b, :size].reshape(size, 2, -1)  # [T, 2, D]
        _assert_close(features, hidden[:, 1:], HIDDEN_TOL, f"{step} features[{b}]")


@pytest.mark.parametrize("step", STEPS)
def test_forward_matches_golden_file(scenario, step) -> None:
    """The committed data/golden/model.h5 (float64 reference) within the same tolerance, and the
    same greedy token wherever the reference's top two logits are further apart than that."""
    ds = read_all(GOLDEN_DIR / GOLDEN_FILES["model"])[step]
    got = scenario[step]
    for b, size in enumerate(ds.in_sizes.values):
        ref = ds.out_logits.values[b, :size]
        _assert_close(got["logits"][b, :size], ref, LOGIT_TOL, f"{step} logits[{b}]")
        top2 = np.sort(ref, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * LOGIT_TOL * np.max(np.abs(ref))
        np.testing.assert_array_equal(np.argmax(got["logits"][b, :size], axis=1)[clear],
                                      np.argmax(ref, axis=1)[clear])


def test_cache_rows_match_reference(scenario) -> None:
    """Prefill wrote each request's rows (normed latent, RoPE'd key) as the reference's cache (the
    tree case's in_cache_*) and nothing past them; past_lens advanced by the prompt lengths."""
    ds = _golden_built()["tree"]
    np.testing.assert_array_equal(scenario["past_after_prefill"], ds.in_past_lens.values)
    for b, past in enumerate(ds.in_past_lens.values):
        for layer, (latent, k_rope) in enumerate(scenario["cache_after_prefill"]):
            _assert_close(latent[b, :past], ds.in_cache_latent.values[b, :past, layer], HIDDEN_TOL,
                          f"latent[{b}, layer {layer}]")
            _assert_close(k_rope[b, :past], ds.in_cache_k_rope.values[b, :past, layer], HIDDEN_TOL,
                          f"k_rope[{b}, layer {layer}]")
            assert not latent[b, past:].any() and not k_rope[b, past:].any()


def test_tree_nodes_equal_ar_steps_bitwise(scenario) -> None:
    """Lossless (spec §1.4): every node on a tree's deepest path has the logits and features, bit
    for bit, of AR decoding that path one token at a time from the same prefix."""
    for b, path in enumerate(scenario["paths"]):
        assert len(path) >= 3  # the root and two drafted levels
        for node in path:
            np.testing.assert_array_equal(scenario["tree"]["logits"][b, node], scenario["replay"]["logits"][b, node])
            np.testing.assert_array_equal(scenario["tree"]["features"][b, node],
                                          scenario["replay"]["features"][b, node])
    np.testing.assert_array_equal(scenario["past_after_replay"],
                                  scenario["past_after_prefill"] + [len(p) for p in scenario["paths"]])


def test_tensor_core_products_match_reference_and_keep_tree_nodes_equal_to_ar_steps(scenario_tc, scenario) -> None:
    """products="tensor-core": every step within LOGIT_TOL / HIDDEN_TOL of the float64 reference,
    every node of the trees' deepest paths bit for bit the AR replay's (lossless: linear_tc is
    batch-invariant), the guarded AR step allocated and copied nothing, and the bits differ from
    the CUDA-core products' somewhere (another kernel ran)."""
    got = scenario_tc
    for step in STEPS:
        ds = _golden_built()[step]
        for b, size in enumerate(ds.in_sizes.values):
            _assert_close(got[step]["logits"][b, :size], ds.out_logits.values[b, :size], LOGIT_TOL,
                          f"{step} logits[{b}]")
            features = got[step]["features"][b, :size].reshape(size, 2, -1)  # [T, 2, D]
            _assert_close(features, ds.out_hidden.values[b, :size][:, 1:], HIDDEN_TOL, f"{step} features[{b}]")
    for b, path in enumerate(got["paths"]):
        assert len(path) >= 3
        for node in path:
            np.testing.assert_array_equal(got["tree"]["logits"][b, node], got["replay"]["logits"][b, node])
            np.testing.assert_array_equal(got["tree"]["features"][b, node], got["replay"]["features"][b, node])
    guard = got["guard"]
    assert guard["calls"] == [] and guard["host_args"] == [] and guard["result_is_owned"]
    assert not np.array_equal(got["tree"]["logits"], scenario["tree"]["logits"])


def test_products_are_numerics_shared_by_a_cache(monkeypatch) -> None:
    """``products`` is checked, remembered by the cache (a model of the other kind is refused on
    it) and handed on by decode.model_with_rows; tensor-core models run no split-K products."""
    from ddtree_numba.engine.decode import model_with_rows

    import ddtree_numba.engine.model as em
    from ddtree_numba.kernels import linear as lin

    config, weights = _tiny()
    kw = dict(batch_size=1, kv_capacity=KV_CAPACITY)
    monkeypatch.setattr(em, "split_k_pays", lambda rows, k: True)     # tiny's K would never split
    monkeypatch.setattr(em, "split_k_segments", lambda k: 1)
    monkeypatch.setattr(lin, "split_k_segments", lambda k: 1)
    cc_model = TargetModel(config, weights, **kw, max_rows=1)
    assert cc_model._wo_split is not None and cc_model._w2_split is not None and cc_model._tc is None
    tc_model = TargetModel(config, cc_model.weights, **kw, max_rows=1, products="tensor-core")
    assert tc_model.products == "tensor-core" and tc_model.cache.products == "tensor-core"
    assert tc_model._wo_split is None and tc_model._w2_split is None and tc_model._tc is not None
    derived = model_with_rows(tc_model, 4, ())
    assert derived.products == "tensor-core" and derived.cache is tc_model.cache
    with pytest.raises(ValueError, match="products must be the cache's models' 'tensor-core'"):
        TargetModel(config, tc_model.weights, **kw, max_rows=4, cache=tc_model.cache)
    with pytest.raises(ValueError, match="products must be one of"):
        TargetModel(config, weights, **kw, max_rows=1, products="tensor")
    with pytest.raises(TypeError, match="products"):
        TargetModel(config, weights, **kw, max_rows=1, products=1)
    odd = dataclasses.replace(config, q_lora_rank=34)   # linear_tc loads 16 bytes: K % 4 == 0
    with pytest.raises(ValueError, match=r"products='tensor-core' needs .* q_lora_rank = 34"):
        TargetModel(odd, weights, **kw, max_rows=1, products="tensor-core")


def test_request_alone_equals_request_in_batch_bitwise(scenario) -> None:
    """Batch invariance: request 1's decode step run alone (bs = 1, its prefix copied from the batch
    cache) gives the bits it got in the bs = 2 step, logits and features."""
    config, _ = _tiny()
    dec = _golden_built()["decode"]
    alone = TargetModel(config, _tiny()[1], batch_size=1, kv_capacity=KV_CAPACITY, max_rows=1,
                        capture_layers=(0, 1))
    for kv, (latent, k_rope) in zip(alone.cache.layers, scenario["cache_after_prefill"]):
        kv.latent.copy_to_device(latent[1:])
        kv.k_rope.copy_to_device(k_rope[1:])
    alone.cache.set_past_lens(scenario["past_after_prefill"][1:])
    sizes = np.ones(1, np.int32)
    result = alone.forward(dec.in_tokens.values[1:], dec.in_positions.values[1:], sizes, prefill_visibility(sizes, 1))
    np.testing.assert_array_equal(_host(result.logits)[0], scenario["decode"]["logits"][1])
    np.testing.assert_array_equal(_host(result.features)[0], scenario["decode"]["features"][1])


def test_tree_verify_in_the_small_tree_launches_gives_the_same_bits(monkeypatch, scenario) -> None:
    """The scenario's tree verify with its attention in the small-tree launches (scores, then softmax
    and P·V: verify_attention.TREE_SPLIT on, its batch bound lifted to the scenario's 2 requests),
    from the same prefix cache, gives the scenario's logits and features bit for bit (the one
    launch's)."""
    from ddtree_numba.kernels import verify_attention as va

    monkeypatch.setattr(va, "TREE_SPLIT", True)
    monkeypatch.setattr(va, "TREE_SPLIT_MAX_BATCH", 2)
    config, weights = _tiny()
    tree = _golden_built()["tree"]
    model = TargetModel(config, weights, batch_size=2, kv_capacity=KV_CAPACITY, max_rows=TREE_ROWS,
                        capture_layers=(0, 1))
    assert model.plan.tree_split
    for kv, (latent, k_rope) in zip(model.cache.layers, scenario["cache_after_prefill"]):
        kv.latent.copy_to_device(latent)
        kv.k_rope.copy_to_device(k_rope)
    model.cache.set_past_lens(scenario["past_after_prefill"])
    launched, launch = [], va.launch
    monkeypatch.setattr(va, "launch", lambda kernel, *a, **k: (launched.append(kernel), launch(kernel, *a, **k)))
    result = model.forward(*_step_inputs(tree.in_tokens.values, tree.in_positions.values, tree.in_sizes.values,
                                         tree.in_visibility.values, TREE_ROWS))
    scores, values, _ = va.get_tree_kernels(model.tile_config, config.n_heads)
    assert launched == [scores, values] * config.n_layers
    np.testing.assert_array_equal(_host(result.logits), scenario["tree"]["logits"])
    np.testing.assert_array_equal(_host(result.features), scenario["tree"]["features"])


def test_forward_allocates_nothing_and_copies_nothing_to_host(scenario) -> None:
    """The scenario's second AR step (device inputs) ran with every device allocation and host copy
    forbidden and no NumPy array passed to a kernel, and returned the model's own buffers."""
    guard = scenario["guard"]
    assert guard["calls"] == [] and guard["host_args"] == [] and guard["result_is_owned"]


def test_split_k_o_proj_8_row_tiles_and_merged_launches_give_the_same_bits(monkeypatch, scenario) -> None:
    """A model whose o_proj and dense down_proj run as per-segment products (linear.linear_split_k,
    what the H200's many-row verify launches take; the down_proj after swiglu_rows), and whose
    many-row linear and head launches take 8-row tiles only (linear.ODD_TILES off: the prefill's
    2 x 9 rows in three tiles of 8 instead of two of 11, the default; tiny's K <= 128 fit the
    staging budget; the MoE's expert products keep 8-row slots either way), with each launch merge
    switched the other way from its default (the query RoPE and the kv write in two launches,
    engine.model.FUSED_ROPE_KV_WRITE; the attention's segment merge launched, verify_attention.MERGE_FREE_SHORT_CACHES off; the shared
    expert in launches of its own, engine.model.FOLD_SHARED_EXPERT off),
    computes its prefill bit for bit as the scenario's prefill model does (same weights, inputs and
    shapes; one forward for every layout: each is a simulator minute). tiny's K are one segment,
    so the split is forced with G = 1 here; the segment combine of G > 1 and the 11-row tile are
    tested against linear() in test_kernel_linear.py."""
    import ddtree_numba.engine.model as em
    from ddtree_numba.kernels import linear as lin
    from ddtree_numba.kernels import verify_attention as va

    config, weights = _tiny()
    pre = _golden_built()["prefill"]
    inputs = _step_inputs(pre.in_tokens.values, pre.in_positions.values, pre.in_sizes.values,
                          pre.in_visibility.values, 9)
    want = (scenario["prefill"]["logits"], scenario["prefill"]["features"])  # the defaults' layouts
    assert lin.ODD_TILES and lin.row_tile(18, 64, "linear") == 11   # the scenario's layout
    plain = TargetModel(config, weights, batch_size=2, kv_capacity=KV_CAPACITY, max_rows=9, capture_layers=(0, 1))
    assert plain._wo_split is None and plain._w2_split is None  # (not run: the scenario ran its twin)
    assert plain._segment_absorbs and plain._absorb_kn is not None   # kernels.absorb reads k-major copies
    assert plain._fold_shared and plain.buffers.s13 is None   # the shared expert inside the expert launches
    monkeypatch.setattr(em, "split_k_pays", lambda rows, k: True)
    monkeypatch.setattr(em, "split_k_segments", lambda k: 1)
    monkeypatch.setattr(lin, "split_k_segments", lambda k: 1)
    assert plain.plan.merge_free                     # the scenario launched no merge
    monkeypatch.setattr(em, "FUSED_ROPE_KV_WRITE", not em.FUSED_ROPE_KV_WRITE)
    monkeypatch.setattr(em, "FOLD_SHARED_EXPERT", False)
    monkeypatch.setattr(va, "MERGE_FREE_SHORT_CACHES", False)
    previous = lin.set_odd_tiles(False)
    try:
        assert lin.row_tile(18, 64, "linear") == 8
        split = TargetModel(config, plain.weights, batch_size=2, kv_capacity=KV_CAPACITY, max_rows=9,
                            capture_layers=(0, 1))
        assert split._wo_split is not None and split._w2_split is not None and not split.plan.merge_free
        assert not split._fold_shared and split.buffers.s13 is not None
        got = split.forward(*inputs)
    finally:
        lin.set_odd_tiles(previous)
    np.testing.assert_array_equal(_host(got.logits), want[0])
    np.testing.assert_array_equal(_host(got.features), want[1])


def test_row_routing_matches_reference_in_bits_of_its_own(monkeypatch, scenario) -> None:
    """engine.model.ROUTE_BY_EXPERT off (the MoE RMSNorm and the routing of a block per row: its
    own lane order, so other bits than the default expert grid's): the prefill within LOGIT_TOL /
    HIDDEN_TOL of the float64 reference, with the RMSNorm inside the routing launch
    (FUSED_MOE_NORM on; test_kernel_model_ops.py checks it against its own launch, the same bits),
    and no expert-grid scratch allocated."""
    import ddtree_numba.engine.model as em

    config, weights = _tiny()
    assert config.n_layers > config.n_dense_layers   # a MoE layer
    ds = _golden_built()["prefill"]
    inputs = _step_inputs(ds.in_tokens.values, ds.in_positions.values, ds.in_sizes.values,
                          ds.in_visibility.values, 9)
    monkeypatch.setattr(em, "ROUTE_BY_EXPERT", False)
    monkeypatch.setattr(em, "FUSED_MOE_NORM", True)
    model = TargetModel(config, weights, batch_size=2, kv_capacity=KV_CAPACITY, max_rows=9, capture_layers=(0, 1))
    assert not model._route_by_expert
    assert model.buffers.route_logits is None and model.buffers.route_counts is None   # no grid scratch
    out = model.forward(*inputs)
    logits, features = _host(out.logits), _host(out.features)
    for b, size in enumerate(ds.in_sizes.values):
        _assert_close(logits[b, :size], ds.out_logits.values[b, :size], LOGIT_TOL, f"logits[{b}]")
        _assert_close(features[b, :size].reshape(size, 2, -1), ds.out_hidden.values[b, :size, 1:], HIDDEN_TOL,
                      f"features[{b}]")
    assert not np.array_equal(logits, scenario["prefill"]["logits"])   # the expert grid's numerics differ


def test_serial_absorbs_take_k_major_copies(monkeypatch, request) -> None:
    """The absorbs' k-major copies (DeviceWeights.k_major, w_kn[h, k, n] = w[h, n, k]): kept by
    every model with engine.model.SEGMENT_ABSORBS on (the default: kernels.absorb reads them), and
    with it off by a many-row model with linear.SERIAL_HEADS on (head_linear's thread-serial kernel;
    its bits are the warp layout's: test_kernel_linear.py, and on the H200), not without it. No
    forward here: one tiny prefill through the serial kernel costs ~35 s of simulator CI."""
    import ddtree_numba.engine.model as em
    from ddtree_numba.kernels import linear as lin

    config, weights = _tiny()
    assert em.SEGMENT_ABSORBS and TargetModel(config, weights, batch_size=1, kv_capacity=8, max_rows=1)._absorb_kn
    monkeypatch.setattr(em, "SEGMENT_ABSORBS", False)
    monkeypatch.setattr(lin, "SERIAL_HEADS", False)
    lin.serial_plan.cache_clear()
    assert TargetModel(config, weights, batch_size=2, kv_capacity=KV_CAPACITY, max_rows=9)._absorb_kn is None
    monkeypatch.setattr(lin, "SERIAL_HEADS", True)
    request.addfinalizer(lin.serial_plan.cache_clear)   # no plan made with the switch on outlives the test
    lin.serial_plan.cache_clear()
    model = TargetModel(config, weights, batch_size=2, kv_capacity=KV_CAPACITY, max_rows=9)
    assert model._absorb_kn is not None
    for layer, lw in enumerate(model.weights.layers):
        for kn, w in zip((kn[layer] for kn in model._absorb_kn), (lw.attn.w_uk_t, lw.attn.w_uv)):
            np.testing.assert_array_equal(kn.copy_to_host(), w.copy_to_host().transpose(0, 2, 1))
    assert model.weights.k_major("w_uv") is model._absorb_kn[1]   # made once, shared
    with pytest.raises(ValueError, match="name"):
        model.weights.k_major("w_o")


def test_no_low_rank_q_path_matches_reference() -> None:
    """q_lora_rank = 0 (q_proj instead of q_a / q_b, no fused q path) matches the reference."""
    base, _ = _tiny()
    config = dataclasses.replace(base, q_lora_rank=0)
    weights = init_weights(config, 3)
    model = TargetModel(config, weights, batch_size=1, kv_capacity=8, max_rows=1)
    sizes = np.ones(1, np.int32)
    logits = _host(model.forward(np.array([[7]], np.int32), np.array([[2]], np.int32), sizes,
                                 prefill_visibility(sizes, 1)).logits)
    ref = reference_forward(weights, config, np.array([7]), np.array([2]))
    _assert_close(logits[0], ref.logits, LOGIT_TOL, "q_proj logits")


def test_absorb_shapes_the_segment_kernels_do_not_take_fall_back_to_head_linear() -> None:
    """A v_head_dim that is not a multiple of 4 (kernels.absorb's 16-byte weight loads) runs the
    absorbs in head_linear instead, and the forward still matches the reference; so does a
    qk_nope_dim over absorb.MAX_K (checked without a forward)."""
    base, _ = _tiny()
    config = dataclasses.replace(base, v_head_dim=18)
    weights = init_weights(config, 5)
    model = TargetModel(config, weights, batch_size=1, kv_capacity=8, max_rows=1)
    assert not model._segment_absorbs
    assert TargetModel(base, init_weights(base, 5), batch_size=1, kv_capacity=8, max_rows=1)._segment_absorbs
    wide = dataclasses.replace(base, qk_nope_dim=1028)   # K over absorb.MAX_K: head_linear too
    assert not TargetModel(wide, init_weights(wide, 5), batch_size=1, kv_capacity=8, max_rows=1)._segment_absorbs
    sizes = np.ones(1, np.int32)
    logits = _host(model.forward(np.array([[7]], np.int32), np.array([[2]], np.int32), sizes,
                                 prefill_visibility(sizes, 1)).logits)
    ref = reference_forward(weights, config, np.array([7]), np.array([2]))
    _assert_close(logits[0], ref.logits, LOGIT_TOL, "v_head_dim 18 logits")


def test_prepare_rows_kernel_guards() -> None:
    """Per-row tokens / positions / cache rows: valid rows map to b * S + past + i, padding rows to
    token 0 and no write, a bad position or an overflowing request to token -1 (a NaN row)."""
    tc, s = 3, 8
    tokens = np.array([[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]], np.int32)
    positions = np.array([[4, 5, 9], [0, 1, 2], [7, -1, 0], [6, 7, 8]], np.int32)
    sizes = np.array([2, 0, 2, 3], np.int32)
    past = np.array([4, 0, 6, 6], np.int32)  # request 3: 6 + 3 > 8 rows
    tok, pos, rows = (np.zeros(12, np.int32) for _ in range(3))
    model_module._prepare_rows_kernel[1, 32](tokens.reshape(-1), positions.reshape(-1), sizes, past, np.int32(tc),
                                             np.int32(s), tok, pos, rows)
    np.testing.assert_array_equal(tok, [5, 6, 0, 0, 0, 0, 11, -1, 0, -1, -1, -1])
    np.testing.assert_array_equal(pos, [4, 5, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(rows, [4, 5, -1, -1, -1, -1, 22, 23, -1, -1, -1, -1])


# --------------------------------------------------------------------------- host-only pieces


def test_kernel_layouts_reproduce_the_reference_projections() -> None:
    """The fused / transposed / stacked layouts compute what the HF weights compute (NumPy)."""
    config, weights = _tiny()
    host = kernel_layouts(config, weights)
    rng = np.random.default_rng(1)
    c, h, nope, v = config.kv_lora_rank, config.n_heads, config.qk_nope_dim, config.v_head_dim
    for i, lw in enumerate(host["layers"]):
        p = f"model.layers.{i}.self_attn."
        x = rng.standard_normal(config.hidden_size)
        np.testing.assert_array_equal(lw["w_a"] @ x, np.concatenate([weights[f"{p}q_a_proj.weight"] @ x,
                                                                     weights[f"{p}kv_a_proj_with_mqa.weight"] @ x]))
        kv_b = weights[f"{p}kv_b_proj.weight"].astype(np.float64).reshape(h, nope + v, c)
        q_nope = rng.standard_normal((h, nope))
        latent = rng.standard_normal((h, c))
        np.testing.assert_allclose(np.einsum("hk,hnk->hn", q_nope, lw["w_uk_t"]),
                                   np.einsum("hd,hdc->hc", q_nope, kv_b[:, :nope]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.einsum("hk,hnk->hn", latent, lw["w_uv"]),
                                   np.einsum("hc,hdc->hd", latent, kv_b[:, nope:]), rtol=1e-6, atol=1e-6)
        assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in lw.values())
    moe = host["layers"][1]
    e = 3
    m = "model.layers.1.mlp."
    np.testing.assert_array_equal(moe["w13"][e], np.concatenate([weights[f"{m}experts.{e}.gate_proj.weight"],
                                                                 weights[f"{m}experts.{e}.up_proj.weight"]]))
    np.testing.assert_array_equal(moe["w2"][e], weights[f"{m}experts.{e}.down_proj.weight"])
    assert moe["w13"].shape == (config.n_routed_experts, 2 * config.moe_intermediate, config.hidden_size)
    assert moe["shared_w13"].shape == (2 * config.moe_intermediate, config.hidden_size)
    assert "bias" in moe and "w13" in host["layers"][0] and "gate" not in host["layers"][0]


def test_device_moe_weights_stack_the_shared_expert_after_the_routed() -> None:
    """With one shared expert, a MoE layer's upload is w13_all [E + 1, 2I, D] / w2_all [E + 1, D, I]
    (the routed experts, then the shared one: what the folded expert launches read) and w13, w2,
    shared_w13, shared_w2 hold the same values as the host layouts; a dense layer has no stack."""
    config, weights = _tiny()
    host = kernel_layouts(config, weights)
    device = DeviceWeights.from_host(config, weights)
    e = config.n_routed_experts
    assert config.n_shared_experts == 1
    for i, lw in enumerate(device.layers):
        f, h = lw.ffn, host["layers"][i]
        if not config.is_moe_layer(i):
            assert not hasattr(f, "w13_all")
            continue
        assert f.w13_all.shape == (e + 1, 2 * config.moe_intermediate, config.hidden_size)
        assert f.w2_all.shape == (e + 1, config.hidden_size, config.moe_intermediate)
        w13_all, w2_all = f.w13_all.copy_to_host(), f.w2_all.copy_to_host()
        np.testing.assert_array_equal(w13_all[:e], h["w13"])
        np.testing.assert_array_equal(w13_all[e], h["shared_w13"])
        np.testing.assert_array_equal(w2_all[:e], h["w2"])
        np.testing.assert_array_equal(w2_all[e], h["shared_w2"])
        for view, want in ((f.w13, h["w13"]), (f.w2, h["w2"]), (f.shared_w13, h["shared_w13"]),
                           (f.shared_w2, h["shared_w2"])):
            np.testing.assert_array_equal(view.copy_to_host(), want)


@pytest.mark.parametrize("shared", [0, 2])
def test_other_shared_expert_counts_keep_the_unfolded_launches(shared) -> None:
    """Without exactly one shared expert nothing is stacked or folded (the fold needs the shared
    expert's width to be the routed experts' I): no w13_all, the CSR [E + 1] over J = M k entries,
    and the shared expert's own buffers (two shared experts) or none (zero). No forward here."""
    config = dataclasses.replace(_tiny()[0], n_shared_experts=shared)
    model = TargetModel(config, init_weights(config, 1), batch_size=2, kv_capacity=8, max_rows=3)
    moe = [lw.ffn for i, lw in enumerate(model.weights.layers) if config.is_moe_layer(i)]
    assert moe and all(f.w13_all is None and f.w2_all is None for f in moe)
    assert not model._fold_shared
    b, j = model.buffers, 2 * 3 * config.n_activated_experts
    assert b.row_offsets.shape == (config.n_routed_experts + 1,) and b.e_out.shape == (j, config.hidden_size)
    assert b.row_index.shape == b.entry_index.shape == (j,)
    assert (b.s13 is None and b.s_out is None) if shared == 0 else \
        b.s13.shape == (6, 2 * shared * config.moe_intermediate) and b.s_out.shape == (6, config.hidden_size)


def test_prefill_visibility_is_packed_causal() -> None:
    sizes = np.array([0, 3, 40])
    packed = prefill_visibility(sizes, 40)
    assert packed.shape == (3, 40, 2) and packed.dtype == np.uint32
    cols = np.arange(40)
    vis = ((packed[..., cols // 32] >> (cols % 32).astype(np.uint32)) & 1).astype(bool)
    for b, size in enumerate(sizes):
        expected = np.eye(40, dtype=bool)
        expected[:size, :size] = causal_visibility(size)
        np.testing.assert_array_equal(vis[b], expected)
    with pytest.raises(ValueError, match="sizes"):
        prefill_visibility(np.array([5]), 4)
    with pytest.raises(TypeError, match="sizes"):
        prefill_visibility(np.array([1.0]), 4)
    with pytest.raises(ValueError, match="tree_capacity"):
        prefill_visibility(np.array([0]), 0)


def test_attention_tile_config_fits_prefill_chunks() -> None:
    tiny = ModelConfig.from_name("tiny")
    cfg = attention_tile_config(tiny, 100)
    assert cfg.max_path == 100 and cfg.threads == 32
    kimi = ModelConfig.from_name("small")  # Kimi K2 attention dims
    big = attention_tile_config(kimi, 4096)
    assert 64 <= big.max_path < 4096 and big.static_shared_bytes <= 48 * 1024
    assert attention_tile_config(kimi, 16).max_path == 64
    # Few nodes: score-first 2-head tiles with 256-key passes (an AR step), 8-head with 4 x 4 score
    # tiles (a batch-1 tree); many: 64-head chunk-layout tiles (layout only). The AR tile's 32-dim
    # key slices and the tree's 64 give a lane the same 4 dims at once (the numerics' k_slice part).
    decode, tree = attention_tile_config(kimi, 1), attention_tile_config(kimi, 33)
    assert (decode.heads, decode.score_keys, tree.heads, tree.score_keys, tree.qk_rows) == (2, 256, 8, 128, 4)
    assert (decode.k_slice, tree.k_slice, decode.threads) == (32, 64, 256)
    assert math.gcd(decode.k_slice // decode.k_groups, 4) == math.gcd(tree.k_slice // tree.k_groups, 4)
    assert attention_tile_config(kimi, 33, batch_size=8).heads == 64
    assert attention_tile_config(tiny, 1).merge_heads == 4


def test_few_nodes_merge_sets_only_the_small_tree_merge(monkeypatch) -> None:
    """engine.model.FEW_NODES_MERGE (bench.forward_ab's automTxH) sets the merge blocks of the
    small-tree launches only, layout: every other field and every other launch size stay."""
    import ddtree_numba.engine.model as em
    kimi = ModelConfig.from_name("small")
    plain = {rows: attention_tile_config(kimi, rows) for rows in (1, 33, 264)}
    assert (plain[33].merge_threads, plain[33].merge_heads) == em.FEW_NODES_MERGE
    monkeypatch.setattr(em, "FEW_NODES_MERGE", (256, 8))
    for rows, base in plain.items():
        cfg = attention_tile_config(kimi, rows)
        if rows == 33:
            assert (cfg.merge_threads, cfg.merge_heads) == (256, 8)
            cfg = dataclasses.replace(cfg, merge_threads=base.merge_threads, merge_heads=base.merge_heads)
        assert cfg == base


def test_few_nodes_min_blocks_sets_only_the_small_tree_launch_bounds(monkeypatch) -> None:
    """engine.model.FEW_NODES_MIN_BLOCKS (bench.forward_ab's auto-occ3) sets the launch bounds'
    block count of the small-tree tile only (0 by default: none): layout, every other field and
    every other launch size stay."""
    import ddtree_numba.engine.model as em
    kimi = ModelConfig.from_name("small")
    plain = {rows: attention_tile_config(kimi, rows) for rows in (1, 33, 264)}
    assert all(cfg.min_blocks == 0 for cfg in plain.values())
    monkeypatch.setattr(em, "FEW_NODES_MIN_BLOCKS", 3)
    for rows, base in plain.items():
        cfg = attention_tile_config(kimi, rows)
        assert cfg == (dataclasses.replace(base, min_blocks=3) if rows == 33 else base)


def test_attention_prefetch_switch_changes_only_the_prefetch(monkeypatch) -> None:
    """engine.model.ATTENTION_PREFETCH_L2 (bench.forward_ab's auto-pf) sets the tiles' L2 prefetch,
    layout only: every other field of the tiling stays."""
    import ddtree_numba.engine.model as em
    kimi = ModelConfig.from_name("small")
    plain = [attention_tile_config(kimi, rows) for rows in (1, 33)]
    assert not any(cfg.prefetch_l2 for cfg in plain)
    monkeypatch.setattr(em, "ATTENTION_PREFETCH_L2", True)
    for rows, base in zip((1, 33), plain):
        cfg = attention_tile_config(kimi, rows)
        assert cfg.prefetch_l2 and dataclasses.replace(cfg, prefetch_l2=False) == base


def test_attention_skip_switch_sets_only_score_first_tiles(monkeypatch) -> None:
    """engine.model.ATTENTION_SKIP_DEAD_KEYS (on; bench.forward_ab's auto-noskip turns it off) sets
    the score-first tiles' dead-key skip, layout only; the chunk-layout tiles (many nodes) keep it
    off (they have no such option)."""
    import ddtree_numba.engine.model as em
    kimi = ModelConfig.from_name("small")
    assert em.ATTENTION_SKIP_DEAD_KEYS
    skip = {rows: attention_tile_config(kimi, rows) for rows in (1, 33, 264)}
    assert skip[1].skip_dead_keys and skip[33].skip_dead_keys and not skip[264].skip_dead_keys
    monkeypatch.setattr(em, "ATTENTION_SKIP_DEAD_KEYS", False)
    for rows, cfg in skip.items():
        plain = attention_tile_config(kimi, rows)
        assert not plain.skip_dead_keys and cfg.skip_dead_keys == (plain.score_keys > 0)
        assert dataclasses.replace(cfg, skip_dead_keys=False) == plain


def test_decode_tile_switch_picks_the_score_first_layout(monkeypatch) -> None:
    """engine.model.DECODE_TILE / FEW_NODES_TILE as (heads, score_keys): the score-first tiles for
    an AR step (and a small tree), the same numerics fields as every other tile."""
    import ddtree_numba.engine.model as em
    kimi = ModelConfig.from_name("small")
    monkeypatch.setattr(em, "DECODE_TILE", (4, 128))
    monkeypatch.setattr(em, "FEW_NODES_TILE", 16)
    decode, tree = attention_tile_config(kimi, 1), attention_tile_config(kimi, 33)
    assert (decode.heads, decode.score_keys) == (4, 128) and (tree.heads, tree.score_keys) == (16, 0)
    monkeypatch.setattr(em, "FEW_NODES_TILE", (2, 64))
    tree = attention_tile_config(kimi, 33)
    assert (tree.heads, tree.score_keys, tree.threads) == (2, 64, 64)
    monkeypatch.setattr(em, "FEW_NODES_TILE", (8, 128, 4))   # 4 heads a score thread
    tree_r4 = attention_tile_config(kimi, 33)
    assert (tree_r4.heads, tree_r4.score_keys, tree_r4.qk_rows, tree_r4.threads) == (8, 128, 4, 128)
    wide = attention_tile_config(kimi, 33, batch_size=8)
    monkeypatch.setattr(em, "DECODE_TILE", (32, 128))   # no such preset: an error, not a fallback
    with pytest.raises(ValueError, match="tile_heads"):
        attention_tile_config(kimi, 1)
    for cfg in (decode, tree, tree_r4):
        assert (cfg.chunk, cfg.k_groups, cfg.qk_keys, cfg.k_slice) == (
            wide.chunk, wide.k_groups, wide.qk_keys, wide.k_slice)
        assert cfg.static_shared_bytes <= em.STATIC_SMEM_LIMIT   # max_path raised within the limit


# The wrappers a forward calls, in model.py's namespace (va.run as "attention"); with a release flag.
_RELEASING = ("embed", "gemv", "absorb", "mla_rope_kv_write", "moe_combine", "attention")
_LAUNCHING = _RELEASING + ("linear", "head_linear", "mla_q_rope", "mla_kv_write", "moe_route", "expert_linear",
                           "rms_norm", "linear_split_k", "swiglu_rows", "launch", "expert_gemv")


def _record_launches(mp: pytest.MonkeyPatch, seen: list) -> None:
    """Record (wrapper, release_next, reads weights before its wait) for every launch of a forward."""
    import ddtree_numba.engine.model as em
    from ddtree_numba.kernels import verify_attention as va
    from ddtree_numba.kernels.absorb import reads_weights_first

    def wrap(name, original):
        def call(*args, **kwargs):
            first = name == "gemv" or (name == "absorb" and reads_weights_first(args[0], args[1]))
            seen.append((name, bool(kwargs.get("release_next", False)), first))
            return original(*args, **kwargs)
        return call

    for name in _LAUNCHING:
        if name == "attention":
            mp.setattr(va, "run", wrap(name, va.run))
        else:
            mp.setattr(em, name, wrap(name, getattr(em, name)))


def _wide_tiny() -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """tiny widened so that every 1-row product takes gemv (K a multiple of 128: hidden, q_lora,
    heads x v, dense and expert widths 128), three layers (one dense): the engine's PDL flags then
    meet every kind of pair (embed, MoE combine and the dense down projection before w_a, w_a before
    w_q, the value absorb before wo, wo before the dense gate | up, that before the down projection,
    the last FFN before the lm_head)."""
    config = dataclasses.replace(ModelConfig.from_name(MODEL_PRESET), hidden_size=128, q_lora_rank=128,
                                 v_head_dim=32, moe_intermediate=128, n_layers=3)
    return config, init_weights(config, 1)


def _check_release_flags(seen: list) -> set:
    """Every launch that takes release_next passes it exactly when the next launch reads weights
    before its wait; returns the names that passed it."""
    for (name, release, _), (next_name, _, first) in zip(seen, seen[1:] + [("end", False, False)]):
        assert release is first or (release is False and name not in _RELEASING), (name, next_name)
    return {name for name, release, _ in seen if release}


def test_forward_flags_every_weights_first_pair_of_a_wide_model(monkeypatch) -> None:
    """With every 1-row product on gemv, each launch before a gemv or a 1-row split absorb passes
    release_next and no other does, a captured layer's copy launch (layer 1) and the unfolded shared
    expert's two products included. (Under the simulator the flags change nothing: the tiny tests
    check the bits; this one checks only the flags, so its launches are checked and configured as
    ever, each kernel's arguments bound to its parameters, but their simulated grids are not run:
    ~50 s of simulator CI for values nothing reads.)"""
    import inspect

    import ddtree_numba.engine.model as em
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    config, weights = _wide_tiny()
    monkeypatch.setattr(em, "FOLD_SHARED_EXPERT", False)
    monkeypatch.setattr(em, "PDL_RELEASE_EARLY", True)   # (off by default: bench.forward_ab's /pdl)
    # the experts in expert_linear: expert_gemv's 128-thread blocks cost the simulator ~30 s here, and
    # neither reads weights before its wait (tests/test_kernel_gemv.py runs expert_gemv in the engine)
    monkeypatch.setattr(em, "EXPERT_ROW_PRODUCTS", False)
    model = TargetModel(config, weights, batch_size=1, kv_capacity=KV_CAPACITY, max_rows=1, capture_layers=(1,))
    seen: list = []
    _record_launches(monkeypatch, seen)
    grids: list = []   # the kernels launched (their arguments bound to their parameters), their grids not run
    call = FakeCUDAKernel.__call__
    monkeypatch.setattr(FakeCUDAKernel, "__call__", lambda self, *args: call(self, *args) if self._device
                        else grids.append(inspect.signature(self.fn).bind(*args)))
    model.forward(np.array([[5]], np.int32), np.array([[0]], np.int32), np.array([1], np.int32),
                  prefill_visibility(np.array([1]), 1))
    assert len(grids) >= len(seen)   # the launches reached their kernels (a wrapper may launch two)
    released = _check_release_flags(seen)
    assert released == {"embed", "gemv", "absorb", "mla_rope_kv_write", "attention", "moe_combine"}
    names = [n for n, _, _ in seen]
    assert names.count("gemv") == 3 * 3 + 2 + 2 * 2 + 1   # w_a, w_q, wo; dense; shared experts; lm_head
    assert ("moe_combine", True, False) in seen and ("gemv", True, True) in seen   # before the lm_head; gemv pairs


@pytest.mark.parametrize("bs, rows", [(1, 1), (1, 3)])
def test_forward_releases_early_only_before_weight_first_kernels(monkeypatch, bs, rows) -> None:
    """PDL (kernels.pdl): a launch passes release_next exactly where the next launch of the forward
    reads weights before its wait (gemv, the split absorb); an AR step at batch 1 has such pairs
    (tiny: the RoPE / cache write before the split q absorb, the two-launch attention before the
    split value absorb, the dense SwiGLU gemv after its linear); a 3-row forward none (no gemv, and
    the split absorb reads weights first at one row only). PDL's bits are the GPU test's
    (test_engine_decode)."""
    import ddtree_numba.engine.model as em

    config, weights = _tiny()
    monkeypatch.setattr(em, "PDL_RELEASE_EARLY", True)   # (off by default: bench.forward_ab's /pdl)
    model = TargetModel(config, weights, batch_size=bs, kv_capacity=KV_CAPACITY, max_rows=rows)
    seen: list = []
    _record_launches(monkeypatch, seen)
    tokens = np.arange(1, rows + 1, dtype=np.int32)[None, :]
    positions = np.arange(rows, dtype=np.int32)[None, :]
    model.forward(tokens, positions, np.array([rows], np.int32), prefill_visibility(np.array([rows]), rows))
    names = [name for name, _, _ in seen]
    assert names[:2] == ["launch", "embed"] and names.count("attention") == config.n_layers
    released = _check_release_flags(seen)
    if rows == 1:
        assert em.ROW_PRODUCTS and {"mla_rope_kv_write", "attention"} <= released
        assert ("gemv", False, True) in seen      # tiny's one gemv: the dense SwiGLU (K 128)
    else:   # no gemv, and the 3-row split absorbs load their weights after the wait
        assert not released and "gemv" not in names and names.count("absorb") == 2 * config.n_layers


def test_release_switch_off_flags_no_launch(monkeypatch) -> None:
    """engine.model.PDL_RELEASE_EARLY off (the default; bench.forward_ab's /pdlx): no launch of an AR step asks
    to release the next one early; the same launches otherwise."""
    import ddtree_numba.engine.model as em

    config, weights = _tiny()
    model = TargetModel(config, weights, batch_size=1, kv_capacity=KV_CAPACITY, max_rows=1)
    args = (np.array([[3]], np.int32), np.array([[0]], np.int32), np.array([1], np.int32),
            prefill_visibility(np.array([1]), 1))
    runs = {}
    for early in (True, False):
        seen: list = []
        with monkeypatch.context() as mp:
            mp.setattr(em, "PDL_RELEASE_EARLY", early)
            _record_launches(mp, seen)
            model.forward(*args)
        runs[early] = seen
    assert [n for n, _, _ in runs[True]] == [n for n, _, _ in runs[False]]
    assert any(r for _, r, _ in runs[True]) and not any(r for _, r, _ in runs[False])


def test_cache_layers_view_the_stacked_arrays() -> None:
    """Every layer's buffers are C-contiguous views of KVCache.stacked(), 16 bytes aligned."""
    config, _ = _tiny()
    cache = KVCache(config, 3, 5)  # odd bs * S: the layers' offsets are multiples of C and R floats
    latents, ropes = cache.stacked()
    n = config.n_layers
    assert latents.shape == (n, 3, 5, config.kv_lora_rank) and ropes.shape == (n, 3, 5, config.qk_rope_dim)
    for i, kv in enumerate(cache.layers):
        for view, stack in ((kv.latent, latents), (kv.k_rope, ropes)):
            assert view.is_c_contiguous() and view.shape == stack.shape[1:] and view.dtype == np.float32
            assert data_address(view) == data_address(stack) + i * view.size * 4 and data_address(view) % 16 == 0
    cache.layers[-1].k_rope.copy_to_device(np.full((3, 5, config.qk_rope_dim), 2.5, np.float32))
    host = ropes.copy_to_host()
    assert np.all(host[-1] == 2.5) and not host[:-1].any()  # written through the view, one layer only


def test_cache_past_lens_and_advance() -> None:
    config, _ = _tiny()
    cache = KVCache(config, 3, 8)
    assert len(cache.buffers()) == 2 * config.n_layers
    assert cache.layers[0].latent.shape == (3, 8, config.kv_lora_rank)
    cache.set_past_lens(np.array([1, 0, 8]))
    cache.advance(np.array([2, 5, 0], dtype=np.int32))
    np.testing.assert_array_equal(cache.read_past_lens(), [3, 5, 8])
    with pytest.raises(ValueError, match="lengths"):
        cache.advance(np.array([-1, 0, 0], dtype=np.int32))
    with pytest.raises(TypeError, match="lengths"):
        cache.advance(np.array([1, 0, 0], dtype=np.int64))
    with pytest.raises(ValueError, match="values"):
        cache.set_past_lens(np.array([0, 0, 9]))
    np.testing.assert_array_equal(cache.read_past_lens(), [3, 5, 8])


# --------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def small_model() -> TargetModel:
    config, weights = _tiny()
    return TargetModel(config, weights, batch_size=2, kv_capacity=16, max_rows=3)


def _good_inputs() -> dict[str, np.ndarray]:
    sizes = np.array([3, 1], dtype=np.int32)
    return {"tokens": np.array([[1, 2, 3], [4, -1, -1]], np.int32),
            "positions": np.array([[0, 1, 2], [0, 0, 0]], np.int32),
            "sizes": sizes, "visibility": prefill_visibility(sizes, 3)}


def _with(**change) -> dict[str, Any]:
    return {**_good_inputs(), **change}


BAD_FORWARD = [
    (TypeError, "tokens", _with(tokens=np.zeros((2, 3), np.int64))),
    (ValueError, "tokens", _with(tokens=np.zeros((2, 4), np.int32))),
    (TypeError, "tokens", _with(tokens=[[1, 2, 3], [4, 5, 6]])),
    (ValueError, "tokens", _with(tokens=np.array([[1, 2, 512], [4, 0, 0]], np.int32))),
    (ValueError, "tokens", _with(tokens=np.array([[1, 2, 3], [-1, 0, 0]], np.int32))),
    (ValueError, "positions", _with(positions=np.array([[0, 1, 16], [0, 0, 0]], np.int32))),
    (ValueError, "positions", _with(positions=np.array([[0, 1, 2], [-3, 0, 0]], np.int32))),
    (TypeError, "positions", _with(positions=np.zeros((2, 3), np.float32))),
    (ValueError, "sizes", _with(sizes=np.array([4, 1], np.int32))),
    (ValueError, "sizes", _with(sizes=np.array([3, 1, 0], np.int32))),
    (TypeError, "visibility", _with(visibility=np.zeros((2, 3, 1), np.int32))),
    (ValueError, "visibility", _with(visibility=np.zeros((2, 3, 1), np.uint32))),  # no diagonal
    (ValueError, "visibility", _with(visibility=np.full((2, 3, 1), 7, np.uint32))),  # sees later rows
    (ValueError, "visibility", _with(visibility=np.zeros((2, 3, 2), np.uint32))),
    (ValueError, "visibility.*past column", _with(visibility=_good_inputs()["visibility"] | np.uint32(1 << 5))),
]


@pytest.mark.parametrize("error, name, kwargs", BAD_FORWARD)
def test_bad_forward_inputs_raise_before_any_work(small_model, error, name, kwargs) -> None:
    staged = small_model.buffers.tokens
    before = _host(staged)
    with pytest.raises(error, match=name):
        small_model.forward(**kwargs)
    np.testing.assert_array_equal(_host(staged), before)  # nothing staged


def test_bad_constructor_arguments() -> None:
    config, weights = _tiny()
    kw = dict(batch_size=1, kv_capacity=8, max_rows=2)
    with pytest.raises(ValueError, match="kv_capacity"):
        TargetModel(config, weights, **{**kw, "kv_capacity": config.max_seq_len + 1})
    with pytest.raises(ValueError, match="capture_layers"):
        TargetModel(config, weights, **kw, capture_layers=(2,))
    with pytest.raises(ValueError, match="capture_layers"):
        TargetModel(config, weights, **kw, capture_layers=(1, 1))
    with pytest.raises(TypeError, match="batch_size"):
        TargetModel(config, weights, **{**kw, "batch_size": 1.0})
    with pytest.raises(ValueError, match="max_rows"):
        TargetModel(config, weights, **{**kw, "max_rows": 0})
    broken = dict(weights)
    del broken["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head"):
        TargetModel(config, broken, **kw)
    with pytest.raises(TypeError, match="weights"):
        TargetModel(config, [1, 2], **kw)
    with pytest.raises(TypeError, match="config"):
        TargetModel("tiny", weights, **kw)
    with pytest.raises(ValueError, match="cache"):
        TargetModel(config, weights, **kw, cache=KVCache(config, 2, 8))
    with pytest.raises(ValueError, match="weights"):
        TargetModel(dataclasses.replace(config, rms_norm_eps=1e-5), DeviceWeights.from_host(config, weights), **kw)
    with pytest.raises(ValueError, match="attention_split must be a multiple of the attention chunk"):
        TargetModel(config, weights, **kw, attention_split=24)   # tiny's chunk is 16
    with pytest.raises(ValueError, match="attention_split"):
        TargetModel(config, weights, **kw, attention_split=0)
    with pytest.raises(TypeError, match="attention_split"):
        TargetModel(config, weights, **kw, attention_split=16.0)


def test_attention_split_is_planned_and_shared_by_derived_models(monkeypatch) -> None:
    """attention_split sizes the plan's segments (3 here, so a merge launch; the default's one
    segment plans merge-free), is checked before any weight upload, cannot change after
    construction, and every model of one cache has it: those decode derives from a caller's model
    (AR, tree, prefill rows) inherit it, and one built on the cache with another split is refused."""
    from ddtree_numba.engine.decode import model_with_rows

    config, weights = _tiny()
    kw = dict(batch_size=1, kv_capacity=40, max_rows=3)
    split = TargetModel(config, weights, **kw, attention_split=16)
    default = TargetModel(config, split.weights, **kw)
    assert (split.attention_split, split.plan.split_size, split.plan.num_splits) == (16, 16, 3)
    assert not split.plan.merge_free and default.plan.merge_free and default.attention_split == 2048
    for rows in (1, 9):
        derived = model_with_rows(split, rows, ())
        assert derived.max_rows == rows and derived.attention_split == 16 and derived.plan.num_splits == 3
    with pytest.raises(AttributeError):
        split.attention_split = 32
    assert split.cache.attention_split == 16 and default.cache.attention_split == 2048
    uploads = []
    monkeypatch.setattr(DeviceWeights, "from_host", lambda *a, **k: uploads.append(1))
    with pytest.raises(ValueError, match="attention_split"):
        TargetModel(config, weights, **kw, attention_split=8)
    with pytest.raises(ValueError, match="attention_split must be the cache's models' 16"):
        TargetModel(config, weights, **kw, cache=split.cache, attention_split=32)
    with pytest.raises(ValueError, match="attention_split must be the cache's models' 16"):
        TargetModel(config, weights, **kw, cache=split.cache)   # the default, 2048
    assert uploads == []


# --------------------------------------------------------------------------- GPU: small, random weights


def _small_reference_logits(config, weights, prompts, tree_tokens, tree_positions, tree_vis):
    """float64 reference: prefill logits per prompt, then the tree's logits over the prompt cache."""
    outs = [reference_forward(weights, config, p, np.arange(len(p))) for p in prompts]
    trees = [reference_forward(weights, config, t, pos, o.new_cache, v)
             for t, pos, o, v in zip(tree_tokens, tree_positions, outs, tree_vis)]
    return [o.logits for o in outs], [t.logits for t in trees]


@functools.cache
def _small() -> tuple[ModelConfig, dict[str, np.ndarray]]:
    config = ModelConfig.from_name("small")
    return config, init_weights(config, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 4])
def test_gpu_small_matches_reference_and_is_lossless(bs) -> None:
    """``small`` (seed 0): ragged prefill + tree verify vs the float64 reference, a request alone vs
    in the batch (bitwise), tree path vs AR replay (bitwise)."""
    config, weights = _small()
    rng = np.random.default_rng(bs)
    lens = [int(n) for n in rng.integers(20, 60, bs)]
    prompts = [rng.integers(0, config.vocab_size, n).astype(np.int32) for n in lens]
    tc_pre, budget = 64, 15
    prefill = TargetModel(config, weights, batch_size=bs, kv_capacity=256, max_rows=tc_pre, capture_layers=(1, 4))
    common = dict(weights=prefill.weights, batch_size=bs, kv_capacity=256, capture_layers=(1, 4),
                  cache=prefill.cache)
    verify = TargetModel(config, max_rows=budget + 1, **common)
    decode = TargetModel(config, max_rows=1, **common)
    sizes = np.array(lens, dtype=np.int32)
    tokens = np.zeros((bs, tc_pre), np.int32)
    positions = np.zeros((bs, tc_pre), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)], positions[b, :len(p)] = p, np.arange(len(p))
    pre_logits = _host(prefill.forward(tokens, positions, sizes, prefill_visibility(sizes, tc_pre)).logits)
    prefill.advance(sizes)

    trees = []
    for b in range(bs):
        lp, ids = topk_log_probs((rng.standard_normal((4, config.vocab_size)) * 3).astype(np.float32), 4)
        trees.append(build_tree(lp, ids, budget, int(np.argmax(pre_logits[b, lens[b] - 1]))))
    t_tokens = np.stack([t.tokens for t in trees]).astype(np.int32)
    t_pos = np.stack([lens[b] + t.depths for b, t in enumerate(trees)]).astype(np.int32)
    t_sizes = np.full(bs, budget + 1, np.int32)
    vis = pack_visibility(np.stack([t.visibility for t in trees]))
    tree_logits = _host(verify.forward(t_tokens, t_pos, t_sizes, vis).logits)

    ref_pre, ref_tree = _small_reference_logits(config, weights, prompts, list(t_tokens), list(t_pos),
                                                [t.visibility for t in trees])
    for b in range(bs):
        _assert_close(pre_logits[b, :lens[b]], ref_pre[b], LOGIT_TOL, f"prefill[{b}]")
        _assert_close(tree_logits[b], ref_tree[b], LOGIT_TOL, f"tree[{b}]")

    # AR replay of request 0's deepest path (the other requests idle: size 0).
    path = _deepest_path(trees[0].parents, trees[0].depths)
    for depth, node in enumerate(path):
        step_sizes = np.zeros(bs, np.int32)
        step_sizes[0] = 1
        step_tokens = np.zeros((bs, 1), np.int32)
        step_tokens[0, 0] = trees[0].tokens[node]
        step_pos = np.zeros((bs, 1), np.int32)
        step_pos[0, 0] = lens[0] + depth
        logits = _host(decode.forward(step_tokens, step_pos, step_sizes, prefill_visibility(step_sizes, 1)).logits)
        np.testing.assert_array_equal(logits[0, 0], tree_logits[0, node])
        decode.advance(step_sizes)

    # Request bs - 1 alone.
    alone = TargetModel(config, prefill.weights, batch_size=1, kv_capacity=256, max_rows=tc_pre)
    one = np.array([lens[-1]], np.int32)
    logits = _host(alone.forward(tokens[-1:], positions[-1:], one, prefill_visibility(one, tc_pre)).logits)
    np.testing.assert_array_equal(logits[0, :lens[-1]], pre_logits[-1, :lens[-1]])


@pytest.mark.gpu
def test_gpu_small_forward_allocates_nothing(monkeypatch) -> None:
    config, weights = _small()
    model = TargetModel(config, weights, batch_size=4, kv_capacity=128, max_rows=16)
    sizes = np.array([16, 3, 0, 9], np.int32)
    inputs = tuple(cuda.to_device(a) for a in (np.ones((4, 16), np.int32),
                                               np.tile(np.arange(16, dtype=np.int32), (4, 1)), sizes,
                                               prefill_visibility(sizes, 16)))
    model.forward(*inputs)  # compiles outside the check
    cuda.synchronize()
    calls: list[str] = []
    host_args: list[str] = []
    _forbid_transfers(monkeypatch, calls)
    _record_host_args(monkeypatch, host_args)
    result = model.forward(*inputs)
    assert calls == [] and host_args == [] and result.logits is model.buffers.logits
