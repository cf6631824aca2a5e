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
