"""bench.profile_forward: the tree it profiles and the ncu table (from the committed H200 profile)."""
from pathlib import Path

import numpy as np

from ddtree_numba.bench import profile_forward as pf

PROFILE = Path(__file__).resolve().parent.parent / "data" / "bench" / "profiles" / "ncu_small_forward_223e229.csv"


def test_chain_visibility_is_a_binary_tree_closure():
    depths, vis = pf._chain_visibility(7)
    np.testing.assert_array_equal(depths, [0, 1, 1, 2, 2, 2, 2])
    assert vis.diagonal().all() and not np.triu(vis, 1).any()
    assert vis[6].nonzero()[0].tolist() == [0, 2, 6]


def test_table_of_the_committed_h200_profile():
    forwards = pf.read_table(PROFILE)
    assert len(forwards) == 2  # one AR step, one 33-row tree
    ar, tree = forwards
    assert sum(r[3] for r in ar) == 99 and sum(r[3] for r in tree) == 99
    # Before the merge was spread over heads, attention + merge of an AR step ran as one block each.
    name, grid, _, calls, total = ar[0]
    assert name.endswith("attention") and grid == "(1, 1, 1)" and calls == 6 and total > 1000
    text = pf.format_table(forwards)
    assert "forward 1: 99 kernels" in text and "verify_attention::merge" in text


def test_main_prints_the_table(capsys):
    assert pf.main(["--table", str(PROFILE)]) == 0
    assert "share" in capsys.readouterr().out
    assert pf.main(["--rows", "0"]) == 2
    assert pf.main(["--ddtree", "8", "--rows", "1"]) == 2      # a tree needs a budget >= 1
    assert pf.main(["--ddtree", "-1"]) == 2
