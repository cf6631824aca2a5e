"""Byte / FLOP models of the sweeps and their roofline bounds (against sim.profiles)."""
import math

import numpy as np
import pytest

from ddtree_numba.bench import roofline as rf
from sim.profiles import H200, RTX_PRO_6000_BLACKWELL, roofline


def test_verify_flops_match_the_limits_document():
    # limits §3: N = 32768, T = 33, H = 64 is 150.7 GFLOP, a 2.25 ms FP32 floor, compute-bound.
    nbytes, flops = rf.verify_attention_cost(1, 33, 32768)
    assert flops / 1e9 == pytest.approx(150.7, abs=0.1)
    r = roofline(H200, nbytes, flops)
    assert r.bound == "compute" and r.t_floor_s * 1e3 == pytest.approx(2.25, abs=0.01)
    b8, f8 = rf.verify_attention_cost(8, 33, 32768)
    assert (b8, f8) == (8 * nbytes, 8 * flops)


@pytest.mark.parametrize("rows,k,dtype", [(1, 1, "fp32"), (960, 32, "bf16"), (1024, 1024, "fp32"), (7, 200000, "bf16")])
def test_topk_bytes_are_one_read_plus_the_outputs(rows, k, dtype):
    vocab = 163840
    nbytes, flops = rf.topk_cost(rows, vocab, k, dtype)
    assert nbytes == rows * vocab * {"fp32": 4, "bf16": 2}[dtype] + rows * min(k, vocab) * 8
    assert flops == 3 * rows * vocab
    with pytest.raises(ValueError, match="dtype"):
        rf.topk_cost(rows, vocab, k, "fp16")


def test_tree_build_bytes_grow_with_the_visibility_words():
    b32 = rf.tree_build_cost(1, 15, 32, 32)[0]
    b33 = rf.tree_build_cost(1, 15, 32, 33)[0]  # one more node: one more row of every output
    assert b33 > b32
    assert rf.tree_build_cost(64, 15, 512, 512)[0] == 64 * rf.tree_build_cost(1, 15, 512, 512)[0]
    n = 513
    assert rf.tree_build_cost(1, 15, 512, 512)[0] == 15 * 512 * 8 + 6 * 4 * n + 8 * n + 4 * (n + 1) \
        + 4 * n * math.ceil(n / 32) + 4


@pytest.mark.parametrize("profile", [H200, RTX_PRO_6000_BLACKWELL])
def test_bound_arrays_agree_with_the_profile_roofline(profile):
    rng = np.random.default_rng(0)
    nbytes = rng.uniform(1e3, 1e10, 20)
    flops = np.where(rng.random(20) < 0.5, 0.0, rng.uniform(1e6, 1e13, 20))
    median = rng.uniform(1.0, 1e5, 20)
    b = rf.bound_arrays(profile, nbytes, flops, median)
    for i in range(20):
        r = roofline(profile, nbytes[i], flops[i])
        assert b["bound_us"][i] == pytest.approx(r.t_floor_s * 1e6)
        assert b["fraction_of_bound"][i] == pytest.approx(r.t_floor_s * 1e6 / median[i])


def test_bound_arrays_nan_where_nothing_moves_or_nothing_was_measured():
    b = rf.bound_arrays(H200, np.array([0.0, 1e9]), np.array([0.0, 0.0]), np.array([5.0, np.nan]))
    assert np.isnan(b["bound_us"][0]) and np.isnan(b["fraction_of_bound"]).all()
    assert b["bound_us"][1] > 0


# --- a whole forward (issue 4's targets) ---------------------------------------------------------

from ddtree_numba.bench.decode_step import step_bytes  # noqa: E402
from ddtree_numba.config import ModelConfig  # noqa: E402


@pytest.mark.parametrize("preset", ["tiny", "small", "kimi-k2"])
def test_forward_bytes_at_one_row_are_the_decode_benchs_less_norms_and_embedding(preset):
    # bench.decode_step counts an AR step's reads independently: the same weights and KV rows, plus
    # the norms' weights and the embedding row, which the forward's floor leaves out.
    c = ModelConfig.from_name(preset)
    cost = rf.forward_cost(c, 1, 100)
    sb = step_bytes(c, 1, 101)
    assert sum(v[0] for v in cost.values()) == pytest.approx(sb["total"] - sb["norms"] - sb["embedding"], rel=1e-12)
    assert cost["attention"][0] == sb["kv"]


@pytest.mark.parametrize("rows", [1, 2, 5, 33, 257])
def test_forward_flops_are_two_per_multiply_add_of_every_row(rows):
    c = ModelConfig.from_name("small")
    cost = rf.forward_cost(c, rows, 160)
    one = rf.forward_cost(c, 1, 160)
    for name in rf.FORWARD_PARTS:
        if name != "attention":   # the products: linear in rows, from the same weights
            assert cost[name][1] == rows * one[name][1]
    # a row's products use every weight it reads once at one row (k routed experts of E), the
    # routing's bias aside (read, not multiplied)
    d, e, k, i = c.hidden_size, c.n_routed_experts, c.n_activated_experts, c.moe_intermediate
    n_moe = c.n_layers - c.n_dense_layers
    per_row = sum(v[1] for n, v in one.items() if n != "attention")
    weight_floats = sum(v[0] for n, v in one.items() if n != "attention") / 4 - n_moe * e
    assert per_row == 2 * weight_floats
    assert cost["routed_experts"] == (4.0 * n_moe * min(e, rows * k) * 3 * d * i, 2.0 * n_moe * rows * k * 3 * d * i)


@pytest.mark.parametrize("rows,past", [(1, 0), (1, 4096), (33, 160), (9, 7)])
def test_forward_attention_counts_the_keys_each_node_stages(rows, past):
    # A chain of new rows: node i (1-based) sees the cached rows and i new ones (its ancestors and
    # itself), the default; every node seeing all rows is the sweeps' dense count.
    c = ModelConfig.from_name("small")
    per_key = 2 * c.n_heads * (c.kv_cache_dim + c.kv_lora_rank) * c.n_layers
    chain = rf.forward_cost(c, rows, past)["attention"][1]
    assert chain == per_key * sum(past + i for i in range(1, rows + 1))
    dense = rf.forward_cost(c, rows, past, tree_keys=rows)["attention"][1]
    assert dense == c.n_layers * rf.verify_attention_cost(1, rows, past, heads=c.n_heads)[1]
    star = rf.forward_cost(c, rows, past, tree_keys=1 + (rows - 1) / rows)["attention"][1]  # root + leaves
    assert star == pytest.approx(per_key * (past + 1 + (rows - 1) * (past + 2)), rel=1e-12)


def test_forward_floor_is_the_sum_of_the_component_bounds_and_the_parity_reads_it():
    c = ModelConfig.from_name("small")
    one, tree = rf.forward_cost(c, 1, 192), rf.forward_cost(c, 33, 192)
    f1, f33 = rf.forward_floor_us(H200, one), rf.forward_floor_us(H200, tree)
    expect = sum(roofline(H200, b, f).t_floor_s for b, f in one.values()) * 1e6
    assert f1 == pytest.approx(expect, rel=1e-12)
    assert f33 > f1 > 1e6 * sum(v[0] for v in one.values()) / 4.3e12 * 0.999   # never under the bytes alone
    # a round of exactly twice the AR step sits exactly at the parity, whatever the AR step
    threshold = rf.parity(f1, f33)
    for ar in (f1, 2 * f1, 5 * f1):
        assert (f33 / (2 * ar)) / (f1 / ar) == pytest.approx(threshold, rel=1e-12)
    table = rf.target_table(c, H200, 192, 32, ar_us=2 * f1, round_us=4 * f1)
    assert f"2 x its floor: {2 * f1:.1f} us" in table
    assert f">= {threshold:.3f} x (AR floor / AR step)" in table
    assert f"ratio AR step / round: 0.500 (target >= 0.5); the round at {threshold:.3f} x" in table


@pytest.mark.parametrize("kwargs,match", [({"rows": 0}, "rows"), ({"rows": True}, "rows"), ({"past": -1}, "past"),
                                          ({"experts": 17}, "experts"), ({"experts": -1}, "experts"),
                                          ({"tree_keys": 0.5}, "tree_keys"), ({"tree_keys": 2}, "tree_keys")])
def test_forward_cost_rejects_bad_arguments(kwargs, match):
    args = {"rows": 1, "past": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        rf.forward_cost(ModelConfig.from_name("small"), args.pop("rows"), args.pop("past"), **args)


def test_roofline_cli_prints_the_targets_and_rejects_bad_arguments(capsys):
    assert rf.main(["--preset", "tiny", "--ar-us", "100", "--round-us", "180"]) == 0
    out = capsys.readouterr().out
    assert "2 x its floor" in out and "ratio AR step / round: 0.556" in out and "verify floor / round = " in out
    for argv, match in ((["--ar-us", "0"], "--ar-us"), (["--round-us", "nan"], "--round-us"),
                        (["--preset", "nope"], "--preset"), (["--profile", "nope"], "--profile"),
                        (["--past", "-1"], "--past"), (["--budget", "0"], "--budget"), (["--budget", "1025"], "--budget")):
        with pytest.raises(SystemExit) as exc:
            rf.main(argv)
        assert exc.value.code == 2 and match in capsys.readouterr().err
