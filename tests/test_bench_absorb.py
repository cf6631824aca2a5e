"""bench.absorb: its layouts and command line (the timing itself needs a GPU)."""
import pytest

from ddtree_numba.bench import absorb as bench
from ddtree_numba.kernels import absorb as ab


def test_layouts_parse_and_refuse():
    assert bench.parse_layout("auto") == ("auto", ())
    assert bench.parse_layout("tile:4,8,9,2") == ("tile", (4, 8, 9, 2))
    assert bench.parse_layout("tile:4,16,10,1,4,1") == ("tile", (4, 16, 10, 1, 4, 1))
    for bad in ("tile:4,8,9", "tile:a,b,c,d", "split:1,2,3,4", "tiles", "", "tile:4,8,9,1,2,0,0", "tile:4,8,10,1,2,7"):
        with pytest.raises(ValueError, match="layout"):
            bench.parse_layout(bad)


def test_layout_plans_are_the_kernels_plans():
    """Each layout names a plan that absorb() accepts for the shapes (small's 33-row value absorb)."""
    assert bench.layout_plan("auto", 33, 64, 128, 512, 132) == ab.plan_absorb(33, 64, 128, 512)
    assert bench.layout_plan("split", 33, 64, 128, 512, 132).kind == "split"
    forced = bench.layout_plan("tile:4,8,9,1", 33, 64, 128, 512, 132)
    assert (forced.lanes, forced.threads, forced.grid) == (1, 72, (4, 1, 64))
    for layout in ("tile", "tile:4,8,9,1", "tile:4,8,9,2", "tile:8,16,3,1"):
        plan = bench.layout_plan(layout, 33, 64, 128, 512, 132)
        assert ab._fits(plan, 33, 64, 128, 512, True), layout
    paired = bench.layout_plan("tile:4,8,10,2,3,1", 33, 64, 128, 512, 132)
    assert (paired.blocks_per_sm, paired.pairs, paired.row_groups) == (3, True, 10)
    assert ab._fits(paired, 33, 64, 128, 512, True)
    # no 3-row tile thread; past 48 KiB; pairs of an odd row-group count; 5 blocks an SM
    for bad in ("tile:3,8,9,1", "tile:8,32,8,1", "tile:4,8,9,2,2,1", "tile:4,8,9,1,5"):
        with pytest.raises(ValueError, match="layout"):
            bench.layout_plan(bad, 33, 64, 128, 512, 132)


def test_command_line_errors_name_the_option(capsys):
    for argv, word in ((["--reps", "5"], "--reps"), (["--rows", "0"], "--rows"),
                       (["--layout", "tile:1"], "layout"), (["--rows", "x"], "invalid literal"),
                       (["--layout", "tile:4,8,16,2"], "shared memory")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert word in capsys.readouterr().err
