"""bench.profile_forward: the tree it profiles and the ncu table (from the committed H200 profile)."""
from pathlib import Path

import numpy as np
import pytest

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


def _prefix_results():
    costs = [(0, "engine::_prepare_rows_kernel", 3.0), (1, "gemv::kernel", 6.0), (2, "mod::k", 2.0),
             (3, "gemv::kernel", 7.0)]
    out, total = [], 0.0
    for i, name, cost in costs:
        total += cost
        out.append(dict(rows=1, index=i, kernel=name, grid="(4, 1, 1)", block="(128, 1, 1)", prefix_us=total,
                        cost_us=cost))
    return out


def test_prefix_table_lists_launches_then_kernels_by_total():
    text = pf.format_prefix(_prefix_results())
    lines = text.splitlines()
    assert lines[0].startswith("forward of 1 rows: 4 launches, 18.0 us")
    kernel_lines = lines[lines.index(next(ln for ln in lines if ln.lstrip().startswith("total us"))) + 1:]
    assert kernel_lines[0].split()[:3] == ["13.0", "2", "6.50"] and "gemv::kernel" in kernel_lines[0]
    assert [ln.split()[0] for ln in kernel_lines] == ["13.0", "3.0", "2.0"]


def test_prefix_dataset_round_trips_with_provenance(tmp_path):
    import xarray as xr

    from ddtree_numba.bench.common import write_run

    group = write_run(tmp_path / "p.h5", pf.prefix_dataset(_prefix_results(), 30))
    with xr.open_dataset(tmp_path / "p.h5", group=group, engine="h5netcdf") as back:
        assert back.attrs["benchmark"] == "graph_prefix" and "git_sha" in back.attrs and back.attrs["reps"] == 30
        assert back["cost_us"].values.tolist() == [3.0, 6.0, 2.0, 7.0]
        assert list(back["kernel"].values)[1] == "gemv::kernel"


def test_kernel_label_is_ncus_factory_and_kernel():
    def get_kernel():
        def kernel():
            pass
        return kernel

    class Compiled:   # what numba's _Kernel holds
        py_func = get_kernel()

    assert pf.kernel_label(Compiled()) == "test_kernel_label_is_ncus_factory_and_kernel::get_kernel::kernel"


@pytest.mark.parametrize("argv", [["--graph-prefix", "--ddtree", "4"], ["--graph-prefix", "--reps", "2"]])
def test_graph_prefix_refuses_bad_arguments(argv, capsys):
    assert pf.main(argv) == 2
    assert "--graph-prefix" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_launch_limit_skips_the_later_launches_and_prefixes_grow():
    """Inside launch_limit(2) only the first two of three launches run; prefix_costs names the
    three launches in order and times graphs of one, two and three of them: with reps 5 each graph
    replays 6 times (a warm-up, then 5 timed), 6 x (1 + 2 + 3) increments, and its counting pass
    launches nothing."""
    import numpy as np
    from numba import cuda

    @cuda.jit
    def bump(counter):
        if cuda.threadIdx.x == 0:
            counter[0] += 1

    counter = cuda.to_device(np.zeros(1, np.int32))
    bump[1, 32](counter)
    cuda.synchronize()
    seen = []
    with pf.launch_limit(2, seen) as count:
        for _ in range(3):
            bump[1, 32](counter)
    cuda.synchronize()
    assert count[0] == 3 and len(seen) == 3 and counter.copy_to_host()[0] == 3   # 1 + the first two
    launches, medians = pf.prefix_costs(lambda stream: [bump[1, 32, stream](counter) for _ in range(3)], reps=5)
    cuda.synchronize()
    assert counter.copy_to_host()[0] == 3 + 6 * (1 + 2 + 3)
    assert [name for name, _, _ in launches] == ["test_gpu_launch_limit_skips_the_later_launches_and_prefixes_grow::bump"] * 3
    assert len(medians) == 3 and all(m > 0 for m in medians)
