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
    name, grid, _, calls, total, read = ar[0]
    assert name.endswith("attention") and grid == "(1, 1, 1)" and calls == 6 and total > 1000 and read is None
    text = pf.format_table(forwards)
    assert "forward 1: 99 kernels" in text and "verify_attention::merge" in text


def test_main_prints_the_table(capsys):
    assert pf.main(["--table", str(PROFILE)]) == 0
    assert "share" in capsys.readouterr().out
    assert pf.main(["--rows", "0"]) == 2
    assert pf.main(["--ddtree", "8", "--rows", "1"]) == 2      # a tree needs a budget >= 1
    assert pf.main(["--ddtree", "-1"]) == 2


METRICS = PROFILE.parent / "ncu_small_forward_metrics_9618a94.csv"   # durations and DRAM bytes, among others


def test_table_reads_dram_bytes_where_the_profile_has_them():
    """The MB read a kernel (sum over its calls) and their rate: from ``dram__bytes_read.sum`` in
    bytes (``--print-units base``); None where a profile has only durations."""
    ar, tree = pf.read_table(METRICS)
    assert sum(r[3] for r in ar) == 99 and sum(r[3] for r in tree) == 107
    assert all(r[5] is not None and r[5] >= 0 for r in ar + tree)
    # The AR step streams the weights once: ~1.46 GB (bench.roofline's 1463 MB) within 5 %
    assert 0.95 * 1463 <= sum(r[5] for r in ar) <= 1.05 * 1463
    assert all(r[5] is None for r in pf.read_table(PROFILE)[0])
    text = pf.format_table([ar])
    assert "MB read" in text and "GB/s" in text and "MB read from DRAM" in text.splitlines()[0]
    assert "MB read" not in pf.format_table(pf.read_table(PROFILE))


def test_table_converts_units(tmp_path):
    """Durations and bytes in other units than the base ones convert (ncu's short names: us, ns;
    Kbyte, Mbyte); the launches of a forward are ordered by ncu's launch ID, whatever the CSV's row
    order."""
    head = '"ID","Kernel Name","Grid Size","Block Size","Metric Name","Metric Unit","Metric Value"\n'
    rows = [
        ("1", "engine::_prepare_rows_kernel", "gpu__time_duration.sum", "us", "2"),
        ("2", "mod::k", "dram__bytes_read.sum", "Kbyte", "3,000"),
        ("2", "mod::k", "gpu__time_duration.sum", "ns", "4,000"),
        ("0", "engine::_prepare_rows_kernel", "gpu__time_duration.sum", "msecond", "0.001"),
        ("0", "engine::_prepare_rows_kernel", "dram__bytes_read.sum", "byte", "1,000,000"),
        ("1", "engine::_prepare_rows_kernel", "dram__bytes_read.sum", "Mbyte", "1"),
    ]
    path = tmp_path / "p.csv"
    path.write_text("==PROF== noise\n" + head + "".join(
        f'"{i}","{k}[v1]","(1, 1, 1)","(32, 1, 1)","{m}","{u}","{v}"\n' for i, k, m, u, v in rows))
    first, second = pf.read_table(path)
    assert first == [("engine::_prepare_rows_kernel", "(1, 1, 1)", "(32, 1, 1)", 1, 1.0, 1.0)]
    assert second == [("mod::k", "(1, 1, 1)", "(32, 1, 1)", 1, 4.0, 3.0),
                      ("engine::_prepare_rows_kernel", "(1, 1, 1)", "(32, 1, 1)", 1, 2.0, 1.0)]
    assert "750" in pf.format_table([second])   # 3 MB in 4 us


def _csv(tmp_path, unit="ns", header='"ID","Kernel Name","Grid Size","Block Size","Metric Name","Metric Unit","Metric Value"'):
    path = tmp_path / "q.csv"
    path.write_text(header + "\n" + '"0","engine::_prepare_rows_kernel[v1]","(1, 1, 1)","(32, 1, 1)",'
                    f'"gpu__time_duration.sum","{unit}","0"\n')
    return path


def test_table_refuses_unknown_units_and_other_csvs(tmp_path):
    """A unit the table does not know, or a CSV without ncu's columns: ValueError naming the path,
    never a silent misreading; a zero duration prints (share 0)."""
    import pytest

    with pytest.raises(ValueError, match="^path: .*furlong"):
        pf.read_table(_csv(tmp_path, unit="furlong"))
    with pytest.raises(ValueError, match="^path: .*not an ncu"):
        pf.read_table(_csv(tmp_path, header='"Kernel Name","Metric Name","Metric Unit","Metric Value"'))
    assert "0.0%" in pf.format_table(pf.read_table(_csv(tmp_path)))


def test_forward_total_only_where_every_kernel_has_its_bytes():
    ar, _ = pf.read_table(METRICS)
    mixed = [ar[0], (*ar[1][:5], None)]
    text = pf.format_table([mixed])
    assert "MB read from DRAM" not in text.splitlines()[0] and "GB/s" in text
