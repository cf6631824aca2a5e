"""bench.forward_ab: its command line (the timing itself needs a GPU and CUDA graphs)."""
import argparse

import pytest

from ddtree_numba.bench import forward_ab


def test_variants_parse_and_refuse():
    assert forward_ab._variants("auto/auto,64/4,auto-pf/auto,auto/auto-plain,auto-skip/auto,auto-noskip/auto") == [
        ("auto", "auto"), ("64", "4"), ("auto-pf", "auto"), ("auto", "auto-plain"), ("auto-skip", "auto"),
        ("auto-noskip", "auto")]
    for bad in ("32/auto", "auto/8", "auto", "64/auto,", "64-pf/auto", "auto/plain"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant"):
            forward_ab._variants(bad)


def test_score_first_variants_parse():
    """sfHxK[rR] (AR-step tiles), sfHxK[rR]+ (small trees too) and tsfHxK[rR] (small trees only)
    name score-first tiles (R: heads per thread in the score tile)."""
    assert forward_ab._variants("sf2x128/auto,sf4x128+/4,h8/auto,tsf8x128r4/auto") == [
        ("sf2x128", "auto"), ("sf4x128+", "4"), ("h8", "auto"), ("tsf8x128r4", "auto")]
    assert forward_ab._score_first_tile("sf4x128+") == (4, 128, 1)
    assert forward_ab._score_first_tile("sf16x128r4") == (16, 128, 4)
    assert forward_ab._score_first_tile("sf2x") is None and forward_ab._score_first_tile("auto") is None
    for bad in ("sfHxK/auto", "sf2/auto", "sfx128/auto", "sf32x128/auto", "sf8x128r3/auto",
                "sf2x128r4/auto", "tsf4/auto"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant"):
            forward_ab._variants(bad)


def test_merge_and_lanes_variants_parse():
    """automTxH: the small trees' segment merge in blocks of T threads and H heads; auto-serial:
    the absorbs of many rows in the thread-serial kernel."""
    assert forward_ab._variants("autom512x1/auto,autom256x8/auto-serial") == [
        ("autom512x1", "auto"), ("autom256x8", "auto-serial")]
    assert forward_ab._merge_tile("autom128x4") == (128, 4) and forward_ab._merge_tile("auto") is None
    assert forward_ab._variants("auto/auto-serial-mt2,auto/auto-serial-l1,auto/auto-serial-odd,"
                                "auto/auto-serial-even") == [
        ("auto", "auto-serial-mt2"), ("auto", "auto-serial-l1"), ("auto", "auto-serial-odd"),
        ("auto", "auto-serial-even")]
    for bad in ("autom100x1/auto", "autom2048x1/auto", "autom128x3/auto", "autom128/auto", "auto/serial",
                "auto/auto-serial-l3", "auto/auto-serial-mt5", "auto/auto-odd"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant"):
            forward_ab._variants(bad)


def test_help_explains_the_variants(capsys):
    with pytest.raises(SystemExit) as exc:
        forward_ab.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "TILE" in text and "COLS" in text and "--variants" in text


def test_logits_saved_by_one_process_are_compared_by_another(tmp_path, monkeypatch, capsys):
    """--save-logits writes the first variant's logits per row count (atomically, no temp file
    left); --compare-logits reports each row count's bits against them and exits 1 where any
    differ (another build of the kernels, say). Timing is faked: no GPU here."""
    import numpy as np

    logits_now = {1: np.arange(6, dtype=np.float32).reshape(1, 6), 33: np.ones((33, 6), np.float32)}

    def fake_time_variants(preset, past, row_counts, variants, same_bits=None, logits=None):
        for rows in row_counts:
            logits.setdefault(rows, logits_now[rows].copy())
            for variant in variants:
                same_bits.setdefault(variant.name, {})[rows] = True
        return {variant.name: {rows: 1.0 for rows in row_counts} for variant in variants}

    monkeypatch.setattr(forward_ab, "time_variants", fake_time_variants)
    saved = tmp_path / "base.npz"
    assert forward_ab.main(["--rows", "1", "33", "--variants", "auto/auto", "--save-logits", str(saved)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.npz"]
    with np.load(saved) as data:
        assert sorted(data.files) == ["rows_1", "rows_33"] and np.array_equal(data["rows_33"], logits_now[33])
    assert forward_ab.main(["--rows", "1", "33", "--variants", "auto/auto", "--compare-logits", str(saved)]) == 0
    assert capsys.readouterr().out.count("same bits as") == 2
    logits_now[33][5, 2] = np.nextafter(np.float32(1), np.float32(2))   # one ulp in one row
    assert forward_ab.main(["--rows", "1", "33", "--variants", "auto/auto", "--compare-logits", str(saved)]) == 1
    out = capsys.readouterr().out
    assert "logits at 1 rows: same bits as" in out and "logits at 33 rows: DIFFERENT BITS from" in out
    # -0.0 against 0.0 is a different bit pattern, though equal as numbers
    logits_now[33][5, 2] = np.float32(1)
    logits_now[1][0, 0] = np.float32(-0.0)
    assert forward_ab.main(["--rows", "1", "33", "--variants", "auto/auto", "--compare-logits", str(saved)]) == 1
    assert "logits at 1 rows: DIFFERENT BITS from" in capsys.readouterr().out
    # a row count the file does not hold
    logits_now[3] = np.zeros((3, 6), np.float32)
    assert forward_ab.main(["--rows", "3", "--variants", "auto/auto", "--compare-logits", str(saved)]) == 1
    assert "logits at 3 rows: MISSING from" in capsys.readouterr().out


def test_logits_paths_are_checked_before_any_run(tmp_path, monkeypatch, capsys):
    def no_run(*args, **kwargs):
        raise AssertionError("timed before the paths were checked")

    monkeypatch.setattr(forward_ab, "time_variants", no_run)
    (tmp_path / "not.npz").write_text("not an npz")
    (tmp_path / "a_dir").mkdir()
    same = str(tmp_path / "same.npz")
    for argv, message in ((["--compare-logits", str(tmp_path / "none.npz")], "does not exist"),
                          (["--compare-logits", str(tmp_path / "not.npz")], "is not a --save-logits .npz"),
                          (["--save-logits", str(tmp_path / "no" / "dir.npz")], "--save-logits"),
                          (["--save-logits", str(tmp_path / "a_dir")], "--save-logits"),
                          (["--save-logits", same, "--compare-logits", same], "the same file")):
        with pytest.raises(SystemExit) as exc:
            forward_ab.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv


@pytest.mark.gpu
def test_gpu_variants_time_one_forward(tmp_path):
    import xarray as xr

    assert forward_ab.main(["--preset", "tiny", "--rows", "1", "3", "--variants", "auto/auto,64/4,auto/auto-tc,auto/auto/pdl",
                            "--out", str(tmp_path / "ab.h5")]) == 0
    import h5py
    with h5py.File(tmp_path / "ab.h5") as f:
        group = "forward_ab/" + list(f["forward_ab"])[0]
    ds = xr.open_dataset(tmp_path / "ab.h5", group=group, engine="h5netcdf")
    assert ds.forward_us.shape == (4, 2) and float(ds.forward_us.min()) > 0
    assert list(ds.variant.values) == ["auto/auto", "64/4", "auto/auto-tc", "auto/auto/pdl"]
    assert ds.same_bits.values.tolist() == [[1, 1]] * 4   # layouts and PDL keep the bits; tc is its own first


def test_async_ring_variants_parse():
    """auto-seg-asyncN: the segment absorbs (the engine's default) with the weights' async ring at
    N slots a warp, N in 2..8 (linear.MAX_RING_STAGES)."""
    assert forward_ab._variants("auto/auto-seg,auto/auto-seg-async4,auto/auto-seg-async8") == [
        ("auto", "auto-seg"), ("auto", "auto-seg-async4"), ("auto", "auto-seg-async8")]
    for bad in ("auto/auto-seg-async1", "auto/auto-seg-async9", "auto/auto-async4", "auto/auto-seg-async"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant"):
            forward_ab._variants(bad)


def test_launch_merge_variants_parse():
    """auto-merge: the segment merge launched where the plan needs none; auto-unfused: that and the
    RoPE / kv write and the MoE RMSNorm in their own launches; auto-normroute: the RMSNorm inside
    the routing launch; auto-unfold: the shared expert in launches of its own; auto-bound: the
    expert launches' grid y for the slot bound's waves; auto-entrytile: the experts' down projection
    in the row tile of its entries; auto-unfold-bound: all three (4d403ab's MoE launches)."""
    assert forward_ab._variants("auto-merge/auto-seg,auto/auto-seg,auto-unfused/auto-seg,auto-normroute/auto-seg") == [
        ("auto-merge", "auto-seg"), ("auto", "auto-seg"), ("auto-unfused", "auto-seg"), ("auto-normroute", "auto-seg")]
    assert forward_ab._variants("auto-unfold/auto-seg,auto-bound/auto-seg,auto-entrytile/auto-seg,"
                                "auto-unfold-bound/auto-seg") == [
        ("auto-unfold", "auto-seg"), ("auto-bound", "auto-seg"), ("auto-entrytile", "auto-seg"),
        ("auto-unfold-bound", "auto-seg")]


def test_occupancy_variant_parses():
    """auto-occ3: the small tree's attention kernel compiled for 3 blocks an SM; auto-seg-occ2: the
    11-row product tiles for 2 (linear.ODD_TILE_BLOCKS)."""
    assert forward_ab._variants("auto-occ3/auto-seg,auto/auto-seg") == [("auto-occ3", "auto-seg"), ("auto", "auto-seg")]
    with pytest.raises(argparse.ArgumentTypeError, match="variant"):
        forward_ab._variants("auto-occ4/auto-seg")
    assert forward_ab._variants("auto/auto-seg-occ2") == [("auto", "auto-seg-occ2")]
    assert forward_ab._variants("auto/auto-seg-u3,auto/auto-seg-u4") == [("auto", "auto-seg-u3"), ("auto", "auto-seg-u4")]
    with pytest.raises(argparse.ArgumentTypeError, match="variant"):
        forward_ab._variants("auto/auto-seg-u5")
    with pytest.raises(argparse.ArgumentTypeError, match="variant"):
        forward_ab._variants("auto/auto-seg-occ3")


def test_absorb_lanes_parse():
    """auto-seg-lN sets the absorb tiles' segment lanes to N; a name that only starts like it (a run once
    read the 's' of a COLS auto-seg-lanes as N) gives none."""
    assert forward_ab._tile_lanes("auto-seg-l2") == 2 and forward_ab._tile_lanes("auto-seg-l1") == 1
    assert forward_ab._tile_lanes("auto-seg-lanes") is None and forward_ab._tile_lanes("auto-seg") is None


def test_tensor_core_variant_parses():
    """auto-tc: the dense products on the tensor cores (TargetModel's products, numerics: its own
    cache), the absorbs as auto-seg."""
    assert forward_ab._variants("auto/auto-seg,auto/auto-tc,auto/auto-tc-ring1,auto/auto-tc-ring") == [
        ("auto", "auto-seg"), ("auto", "auto-tc"), ("auto", "auto-tc-ring1"), ("auto", "auto-tc-ring")]
    for bad in ("auto/tc", "auto/auto-tc4", "auto/auto-seg-tc"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant"):
            forward_ab._variants(bad)


def test_pdl_variants_parse():
    """A third part /pdl: the same layout captured with programmatic launches, its own result key;
    /pdlx: the same with every release at the blocks' exits (engine.model.PDL_RELEASE_EARLY off)."""
    variants = forward_ab._variants("auto/auto-seg,auto/auto-seg/pdl,sf2x128/auto-tc/pdl,auto/auto-seg/pdlx")
    assert variants == [("auto", "auto-seg"), ("auto", "auto-seg"), ("sf2x128", "auto-tc"), ("auto", "auto-seg")]
    assert [v.pdl for v in variants] == [False, True, True, True]
    assert [v.exit_release for v in variants] == [False, False, False, True]
    assert [v.name for v in variants] == ["auto/auto-seg", "auto/auto-seg/pdl", "sf2x128/auto-tc/pdl",
                                          "auto/auto-seg/pdlx"]
    assert variants[2].score_first == (2, 128, 1)
    copied = __import__("copy").copy(variants[1])
    assert copied.pdl and copied.name == "auto/auto-seg/pdl"
    copied = __import__("copy").copy(variants[3])
    assert copied.exit_release and copied.name == "auto/auto-seg/pdlx"
    for bad in ("auto/auto-seg/pd", "auto/auto-seg/pdl/pdl", "auto/pdl", "auto/auto-seg/", "auto/auto-seg/pdlxx"):
        with pytest.raises(argparse.ArgumentTypeError, match="variant"):
            forward_ab._variants(bad)


def test_pdl_release_choices(capsys):
    """--pdl-release takes kernels.pdl.RELEASE_MODES only (set before any compile)."""
    with pytest.raises(SystemExit) as exc:
        forward_ab.main(["--pdl-release", "never"])
    assert exc.value.code == 2 and "--pdl-release" in capsys.readouterr().err


def test_a_variant_named_twice_keeps_both_passes(tmp_path, monkeypatch):
    """pass_labels names the n-th pass of a variant ``NAME #n``; the HDF5 group's variant axis holds
    every pass's median (an A/B timed twice in one process keeps its spread). Timing is faked."""
    import xarray as xr

    assert forward_ab.pass_labels(["a", "b", "a", "a", "b"]) == ["a", "b", "a #2", "a #3", "b #2"]
    medians = iter([10.0, 20.0, 11.0, 21.0])

    def fake_time_variants(preset, past, row_counts, variants, same_bits=None, logits=None):
        results = {}
        for variant, label in zip(variants, forward_ab.pass_labels([v.name for v in variants])):
            results[label] = {rows: next(medians) for rows in row_counts}
            same_bits[label] = {rows: True for rows in row_counts}
        return results

    monkeypatch.setattr(forward_ab, "time_variants", fake_time_variants)
    out = tmp_path / "fab.h5"
    assert forward_ab.main(["--rows", "33", "--variants", "auto/auto,auto-tree/auto,auto/auto,auto-tree/auto",
                            "--out", str(out)]) == 0
    group = xr.open_datatree(out, engine="h5netcdf")["forward_ab"].children
    (name,) = group
    with xr.open_dataset(out, group=f"forward_ab/{name}", engine="h5netcdf") as back:
        assert list(back["variant"].values) == ["auto/auto", "auto-tree/auto", "auto/auto #2", "auto-tree/auto #2"]
        assert back["forward_us"].sel(rows=33).values.tolist() == [10.0, 20.0, 11.0, 21.0]
