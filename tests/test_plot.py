"""``ddtree-numba plot``: figures from synthetic sweep files (fake timers), written atomically."""
import os

import pytest

from ddtree_numba import cli, plot
from ddtree_numba.bench import e2e, sweep
from test_bench_e2e import GRID as E2E_GRID
from test_bench_e2e import FakeConfig, FakeEngine
from test_bench_sweep import GRID, fake_backend

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweeps") / "sweeps.h5"
    sweep.run_sweeps(sweep.KERNELS, {k: GRID for k in sweep.KERNELS}, fake_backend(), path, echo=lambda s: None)
    from ddtree_numba.bench.common import write_run

    write_run(path, e2e.run_e2e(E2E_GRID, FakeEngine(), FakeConfig(), {}, echo=lambda s: None))
    return path


@pytest.fixture(autouse=True)
def low_dpi(monkeypatch):
    monkeypatch.setattr(plot, "DPI", 50)  # rendering dominates the test time


@pytest.fixture(scope="module")
def topk_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("topk") / "topk_only.h5"
    sweep.run_sweeps(["topk"], {k: GRID for k in sweep.KERNELS}, fake_backend(), path, echo=lambda s: None)
    return path


def test_every_figure_is_written_as_png(sweep_file, tmp_path):
    out = tmp_path / "figures"
    written = plot.make_figures([sweep_file], out)
    assert sorted(p.name for p in written) == sorted(plot.FIGURES)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, path.name
    assert sorted(os.listdir(out)) == sorted(plot.FIGURES)  # no temp files left behind


def test_latest_group_of_each_benchmark_wins(tmp_path):
    from ddtree_numba.bench.common import write_run

    for batch in (4, 2):  # the later run wins, whatever its values
        write_run(tmp_path / f"run{batch}.h5",
                  sweep.sweep_accept_compact(sweep.Grid(batch=(batch,), budget=(16,), reps=20), fake_backend()))
    runs = plot.latest_runs([tmp_path])
    assert list(runs) == ["sweep_accept_compact"]
    assert list(runs["sweep_accept_compact"]["batch"].values) == [2]


def test_a_failed_save_leaves_no_file(tmp_path):
    class Broken:
        def savefig(self, target, **kwargs):
            with open(target, "wb") as f:
                f.write(PNG_MAGIC)  # half a PNG, then a crash
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        plot.save_png(Broken(), tmp_path / "x.png")
    assert os.listdir(tmp_path) == []


def test_cli_plot(topk_file, tmp_path, capsys):
    assert cli.main(["plot", str(topk_file), "--out", str(tmp_path / "f")]) == 0
    assert capsys.readouterr().out.count("wrote ") == 2  # only the figures of the sweeps present
    assert sorted(os.listdir(tmp_path / "f")) == ["topk_vs_budget.png", "topk_vs_rows.png"]
    assert cli.main(["plot", str(tmp_path / "f"), "--out", str(tmp_path / "g")]) == 1  # no .h5 there
    assert cli.main(["plot", str(tmp_path / "missing.h5"), "--out", str(tmp_path / "g")]) == 2
    assert "missing.h5" in capsys.readouterr().err
