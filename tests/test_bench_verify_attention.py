"""Host-side pieces of the verify-attention benchmark: random trees' visibility, FLOPs, peer sizing."""
import dataclasses
import math

import numpy as np
import pytest
from numba import cuda

from ddtree_numba.bench import verify_attention as bva
from reference import unpack_visibility
from sim.profiles import H200


@pytest.mark.parametrize("bs,t", [(1, 1), (2, 9), (3, 33), (1, 70)])
def test_random_visibility_is_an_ancestor_closure(bs, t):
    vis, packed = bva.random_visibility(np.random.default_rng(t), bs, t)
    assert vis.shape == (bs, t, t) and packed.shape == (bs, t, -(-t // 32)) and packed.dtype == np.uint32
    np.testing.assert_array_equal(unpack_visibility(packed, t), vis)
    for b in range(bs):
        assert vis[b].diagonal().all() and not np.triu(vis[b], 1).any()  # self, and parents precede
        assert vis[b, :, 0].all()  # node 0 (the root) is everyone's ancestor
        for i in range(1, t):
            parent = max(j for j in range(i) if vis[b, i, j] and vis[b, i].sum() == vis[b, j].sum() + 1)
            expected = vis[b, parent].copy()
            expected[i] = True
            np.testing.assert_array_equal(vis[b, i], expected)  # a node sees its parent's row and itself


def test_flops_and_peer_sizing():
    assert bva.flops(8, 33, 32768) == 8 * 2.0 * 33 * 64 * (32768 + 33) * 1088
    assert bva.torch_scores_bytes(1, 33, 1024) == 4.0 * 33 * 64 * (1024 + 33)


def test_score_first_tiles_are_the_engines():
    """The bench's score-first tiles are the ones engine.model picks for AR steps and small trees."""
    import ddtree_numba.engine.model as em
    for name, tile in (("sf2x256", em.DECODE_TILE), ("sf8x128r4", em.FEW_NODES_TILE)):
        cfg = bva.TILES[name]
        assert (cfg.heads, cfg.score_keys, cfg.qk_rows) == (tile + (1,))[:3]


def test_decode_tiles_differ_only_in_the_prefetch():
    """The bench's 8-head tiles: the chunk layout's decode tiling, with and without the L2 prefetch
    (layout, not numerics), so their A/B times the prefetch alone."""
    assert bva.TILES["h8"].heads == 8 and not bva.TILES["h8"].prefetch_l2
    assert bva.TILES["h8-prefetch"].prefetch_l2
    assert dataclasses.replace(bva.TILES["h8-prefetch"], prefetch_l2=False) == bva.TILES["h8"]


def test_skip_tiles_differ_only_in_the_skip():
    """The bench's -skip tiles (the engine's default) are the plain score-first tiles with
    skip_dead_keys on (layout, not numerics), so their A/B times the skip alone."""
    for name in ("sf2x128", "sf2x256", "sf8x128r4"):
        skip = bva.TILES[f"{name}-skip"]
        assert skip.skip_dead_keys and not bva.TILES[name].skip_dead_keys
        assert dataclasses.replace(skip, skip_dead_keys=False) == bva.TILES[name]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["sf8x128r4", "sf8x128r4-skip"])
def test_gpu_graph_timing_gives_per_call_times(tile):
    """--graph: replays of one captured graph of GRAPH_LAUNCHES rotated calls, a positive time per
    call and finite outputs (the engine's short-prefix verify shape)."""
    m = bva.measure(1, 33, 160, tile=tile, reps=20, graph=True)
    assert len(m["gpu"]) == 20 and all(0 < t < 1e5 for t in m["gpu"]) and m["finite"]


def test_any_score_first_tile_by_name():
    """--tile takes any score-first tile sfHxK[rR][-skip] (the AR tile exploration of run "lane
    squares": 1-4 heads, 128 or 256 keys a pass), built as va.default_config builds it; a known
    name is the TILES entry; anything else is an argparse error naming the choices."""
    assert bva.tile_config("sf2x256-skip") == bva.TILES["sf2x256-skip"]
    cfg = bva.tile_config("sf4x256r4-skip")
    assert (cfg.heads, cfg.score_keys, cfg.qk_rows, cfg.skip_dead_keys) == (4, 256, 4, True)
    one = bva.tile_config("sf1x128")
    assert (one.heads, one.score_keys, one.qk_rows, one.skip_dead_keys, one.threads) == (1, 128, 1, False, 64)
    for bad in ("sf3x128", "sf2x256r3", "h7", "sf2x"):
        with pytest.raises(ValueError):
            bva.tile_config(bad)
    with pytest.raises(SystemExit):
        bva.main(["--tile", "nope"])


def test_split_option_is_repeatable_and_checked(capsys):
    """--split takes several segment sizes (each tile and shape timed at each, one process); a
    size <= 0 is an argparse error naming --split before anything else runs."""
    with pytest.raises(SystemExit):
        bva.main(["--split", "64", "--split", "0"])
    assert "--split must be positive, got 0" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_small_splits_match_the_reference():
    """The AR step's tile over 160 cached rows in three segments of 64 keys (a merge launch) and in
    one (merge-free): both within the bench's reference bound, finite."""
    for split in (64, 2048):
        m = bva.measure(1, 1, 160, tile="sf2x256-skip", split=split, reps=20, check=True)
        assert m["finite"] and m["out_err"] < 1e-4 and m["lse_err"] < 1e-5, (split, m["out_err"], m["lse_err"])


def _device_zeros(shape, aligned):
    """A float32 device array of zeros; ``aligned`` False: one float past a 16-byte boundary."""
    size = int(np.prod(shape))
    if aligned:
        return cuda.to_device(np.zeros(shape, np.float32))
    return cuda.to_device(np.zeros(size + 1, np.float32))[1:].reshape(shape)


def _launched(monkeypatch, bs, t, s, tile, aligned=True):
    """The kernels va.run launches (recorded, not run) for a plan of bs requests, t tree rows and s
    cache rows at a bench tile, on q / kv arrays that are 16-byte aligned or not; with the plan."""
    from ddtree_numba.kernels import verify_attention as va
    from ddtree_numba.kernels._args import data_address
    cfg = bva.tile_config(tile)
    p = va.plan(bs, t, bva.HEADS, s, config=cfg)
    arrays = [_device_zeros(shape, aligned) for shape in
              ((bs, t, bva.HEADS, bva.LATENT), (bs, t, bva.HEADS, bva.ROPE), (bs, s, bva.LATENT), (bs, s, bva.ROPE))]
    assert all((data_address(a) % 16 == 0) is aligned for a in arrays)
    past = cuda.to_device(np.full(bs, s - t, np.int32))
    sizes = cuda.to_device(np.full(bs, t, np.int32))
    visibility = cuda.to_device(bva.random_visibility(np.random.default_rng(t), bs, t)[1])
    out = cuda.device_array((bs, t, bva.HEADS, bva.LATENT), np.float32)
    lse = cuda.device_array((bs, t, bva.HEADS), np.float32)
    launched = []
    monkeypatch.setattr(va, "launch", lambda kernel, *args, **kwargs: launched.append(kernel))
    va.run(p, *arrays, past, sizes, visibility, bva.SCALE, out, lse, p.allocate_workspace())
    monkeypatch.undo()
    return launched, p, cfg


@pytest.mark.parametrize("bs,t,s,tile,split_on,split_off", [
    (1, 33, 225, "sf8x128r4-skip", "tree-split", "one"),  # small's verify shape: the split fits
    (2, 33, 225, "sf8x128r4-skip", "one", "one"),         # past TREE_SPLIT_MAX_BATCH
    (1, 65, 300, "sf8x128r4-skip", "one", "one"),         # past TREE_SPLIT_MAX_NODES
    (1, 33, 4096 + 33, "sf8x128r4-skip", "one+merge", "one+merge"),  # keys past segment 0: the merge
    (1, 1, 193, "sf2x256-skip", "decode-split", "decode-split"),     # an AR step
])
@pytest.mark.parametrize("aligned", [True, False])
def test_plan_launches_names_what_run_launches(monkeypatch, bs, t, s, tile, split_on, split_off, aligned):
    if not aligned:   # run refuses unaligned q / kv for the score-first tiles; the chunk tiles take them
        tile = {"sf8x128r4-skip": "h16", "sf2x256-skip": "h8"}[tile]
    """VerifyPlan.launches, which run dispatches on and the bench's launches column reports, against
    the kernels run launches (recorded in place of the launch): the small-tree pair only where
    TREE_SPLIT is on, the plan fits it (2 .. TREE_SPLIT_MAX_NODES rows, batch <= TREE_SPLIT_MAX_BATCH,
    merge-free) and q / kv are 16-byte aligned; the one-node pair for an AR step (aligned or not
    when its lanes' slices are not whole quads); else the tile's launch, with the merge where keys
    pass the first segment."""
    from ddtree_numba.kernels import verify_attention as va
    assert (va.TREE_SPLIT_MAX_BATCH, va.TREE_SPLIT_MAX_NODES, va.DEFAULT_SPLIT_SIZE, va.DECODE_SPLIT) == (
        1, 64, 2048, True)
    for on, label in ((True, split_on), (False, split_off)):
        with bva.tree_split_setting(on):
            launched, p, cfg = _launched(monkeypatch, bs, t, s, tile, aligned)
            got = p.launches(aligned)
        if not aligned and label == "tree-split":
            label = "one"
        if not aligned and label == "decode-split" and math.gcd(cfg.k_slice // cfg.k_groups, 4) == 4:
            label = "one"
        assert got == label, (on, aligned)
        expected = {"tree-split": lambda: list(va.get_tree_kernels(cfg, bva.HEADS)[:2]),
                    "decode-split": lambda: list(va.get_decode_kernels(cfg, bva.HEADS)),
                    "one": lambda: list(va.get_kernels(cfg))[:1],
                    "one+merge": lambda: list(va.get_kernels(cfg))}[label]()
        assert launched == expected, (on, aligned, label, launched)


def test_tree_split_setting_is_restored():
    """measure's TREE_SPLIT override holds inside the block only, also when the block raises;
    None leaves the module's setting alone."""
    from ddtree_numba.kernels import verify_attention as va
    saved = va.TREE_SPLIT
    for on in (True, False):
        with pytest.raises(RuntimeError):
            with bva.tree_split_setting(on):
                assert va.TREE_SPLIT is on
                raise RuntimeError("inside")
        assert va.TREE_SPLIT is saved
    with bva.tree_split_setting(None):
        assert va.TREE_SPLIT is saved


def test_tree_split_option_is_checked(capsys):
    """--tree-split takes on / off (repeatable); anything else is an argparse error naming it."""
    with pytest.raises(SystemExit):
        bva.main(["--tree-split", "yes"])
    assert "--tree-split" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_tree_split_times_both_layouts():
    """--tree-split on / off at small's verify shape (33 rows over 192 cached): the two launches and
    the one launch, each timed, finite and within the reference bound; TREE_SPLIT restored after."""
    from ddtree_numba.kernels import verify_attention as va
    saved = va.TREE_SPLIT
    for on in (True, False):
        m = bva.measure(1, 33, 192, tile="sf8x128r4-skip", reps=20, check=True, tree_split=on)
        assert m["launches"] == ("tree-split" if on else "one") and va.TREE_SPLIT is saved
        assert m["finite"] and m["out_err"] < 1e-4 and m["lse_err"] < 1e-5, (on, m["out_err"], m["lse_err"])


def test_tree_split_cases_interleave_and_are_stored(tmp_path, monkeypatch, capsys):
    """main with --tree-split off --tree-split on: each shape timed at each setting in the given order
    (measure faked: no GPU), and the HDF5 group keeps what was asked (tree_split) beside what ran
    (launches)."""
    import xarray as xr
    asked = []

    def fake_measure(bs, t, n, *, tree_split=None, **kwargs):
        asked.append((t, tree_split))
        return {"gpu": [10.0 + t] * 20, "torch_fp32": [], "torch_bf16": [], "out_err": float("nan"),
                "lse_err": float("nan"), "finite": True, "launches": "tree-split" if tree_split and t > 1 else "one"}

    monkeypatch.setattr(bva, "measure", fake_measure)
    monkeypatch.setattr(bva.cuda.config, "ENABLE_CUDASIM", False)   # main's GPU check; nothing launches
    monkeypatch.setattr(bva, "active_profile", lambda: H200)
    out = tmp_path / "va.h5"
    assert bva.main(["--shape", "1,33,192", "--shape", "1,1,192", "--tree-split", "off", "--tree-split", "on",
                     "--out", str(out)]) == 0
    assert asked == [(33, False), (33, True), (1, False), (1, True)]
    group = capsys.readouterr().out.strip().splitlines()[-1].split(":", 1)[1]
    ds = xr.open_dataset(out, group=group, engine="h5netcdf")
    assert list(ds.tree_split.values) == ["off", "on", "off", "on"]
    assert list(ds.launches.values) == ["one", "tree-split", "one", "one"]
    assert list(ds.tree.values) == [33, 33, 1, 1] and list(ds.median_us.values) == [43.0, 43.0, 11.0, 11.0]
    ds.close()
