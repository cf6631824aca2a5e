"""The command line: subcommands wired to the modules that do the work."""
import importlib
import sys
import types

import pytest

from ddtree_numba import cli
from reference.golden_cases import GOLDEN_FILES


def test_golden_families_match_the_golden_files():
    assert sorted(cli.GOLDEN_FAMILIES) == sorted(GOLDEN_FILES)


def test_every_benchmark_module_has_a_main():
    for name, (module, _) in cli.BENCHMARKS.items():
        assert callable(importlib.import_module(f"ddtree_numba.bench.{module}").main), name


def test_golden_check_passes_on_the_committed_files(capsys):
    assert cli.main(["golden", "check", "--only", "tree"]) == 0
    assert "match the reference" in capsys.readouterr().out


def test_golden_check_on_a_missing_directory_names_the_file_and_the_fix(tmp_path, capsys):
    assert cli.main(["golden", "check", "--dir", str(tmp_path / "nowhere"), "--only", "topk"]) == 2
    err = capsys.readouterr().err
    assert "topk.h5" in err and "ddtree-numba golden regen" in err


@pytest.mark.parametrize("argv", [["golden", "check", "--only", "nope"],  # unknown golden family
                                  ["bench", "sweep", "--kernel", "nope"]])  # unknown sweep kernel
def test_unknown_choice_is_a_usage_error(argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2


def test_profiles_prints_both_devices(capsys):
    assert cli.main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert "sm_90" in out and "sm_120" in out


def test_cpu_tree_benchmark_runs_on_the_host(tmp_path, capsys):
    out = tmp_path / "runs.h5"
    assert cli.main(["bench", "cpu-tree", "--batch", "2", "--budgets", "4", "--reps", "1",
                     "--vocab", "512", "--out", str(out)]) == 0
    import xarray as xr

    with xr.open_datatree(out, engine="h5netcdf") as tree:
        (run,) = tree["cpu_tree"].children.values()
        ds = run.to_dataset()
        assert ds.attrs["benchmark"] == "cpu_tree" and ds.attrs["git_sha"]
        assert float(ds["heap_ms"][0]) > 0.0


@pytest.mark.parametrize("argv, expected", [
    (["bench", "sweep", "--help"], ["{topk,tree_build,verify_attention,accept_compact,e2e,all}", "--quick"]),
    (["--help"], ["plot", "generate"]),
])
def test_help_lists_the_choices(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(text in out for text in expected), expected


def test_generate_without_the_engine_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ddtree_numba.engine.generate", None)  # import raises ImportError
    assert cli.main(["generate", "--batch", "2"]) == 2
    assert "ddtree_numba.engine.generate" in capsys.readouterr().err


def test_generate_hands_its_options_to_the_engine_module(monkeypatch):
    seen = {}
    module = types.ModuleType("ddtree_numba.engine.generate")
    module.add_arguments = lambda parser: parser.add_argument("--budget", type=int, default=32)
    module.main = lambda args: seen.setdefault("budget", args.budget) and 0
    monkeypatch.setitem(sys.modules, "ddtree_numba.engine.generate", module)
    assert cli.main(["generate", "--budget", "64"]) == 0
    assert seen == {"budget": 64}
