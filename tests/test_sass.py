"""sim.sass (``ddtree-numba sass``): a kernel's SASS without a GPU and where its PDL wait falls.

The listing parser runs everywhere; the build and disassembly run in a process without the
simulator where NVVM / nvJitLink and nvdisasm are installed (the ``gpu`` extra: CI has them).
With nvJitLink 13.5 this build keeps the 1-row products' first weight loads before the wait
(PERFORMANCE.md, run "branches"), so the order is asserted from 13.5 on. It is this build's order,
not every GPU's: on the project's GPU machine numba's launch build put the wait first with its
image's nvJitLink 13.0 (run "pdl early timed") and with 13.5 loaded too (run "tree split";
tests/test_pdl.py's GPU test reads that build)."""
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sim import sass
from tests.compile_helpers import needs_compiler, no_sim_env

ROOT = Path(__file__).resolve().parent.parent


def test_pdl_order_reads_nvdisasm_lines():
    listing = textwrap.dedent("""
        /*04b0*/                   USHF.R.S64 UR4, UR5, UR4, UR6 ;
        /*0000*/ 	.byte	0x04, 0x2f
        /*04c0*/                   ACQBULK ;
        /*0b70*/               @P3 LDG.E.128.CONSTANT R28, desc[UR6][R66.64+0x600] ;
                                                                                     /* 0x000000 */
        /*0c40*/               @P0 PREEXIT ;
        /*0d40*/                   LDG.E R93, desc[UR6][R44.64] ;
        /*0d50*/               @P1 LDG.E.128.CONSTANT R4, desc[UR6][R2.64] ;
    """)
    assert sass.pdl_order(listing) == (1, [2, 5])
    with pytest.raises(ValueError, match="no ACQBULK"):
        sass.pdl_order("/*0000*/ EXIT ;")


def test_cli_rejects_an_unknown_kernel_and_a_missing_tool(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        sass.main(["no_such_kernel"])
    assert exc.value.code == 2 and "no kernel registered as 'no_such_kernel'" in capsys.readouterr().err
    monkeypatch.setattr(sass, "nvdisasm_path", lambda: None)
    assert sass.main(["gemv_rmsnorm", "--pdl-order"]) == 2
    assert "nvdisasm not found" in capsys.readouterr().err
    with pytest.raises(IndexError, match="has 1 registered signatures"):
        sass.kernel_sass("gemv_rmsnorm", signature=3)


ORDER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from sim import sass

    out = {name: sass.pdl_order(sass.kernel_sass(name, "sm_90"))
           for name in ("gemv_rmsnorm", "absorb_split_mt1_l4")}
    json.dump({"order": out, "nvjitlink": sass.nvjitlink_version()}, open(sys.argv[1], "w"))
    """
)


@needs_compiler
@pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm not installed (the gpu extra brings it)")
def test_first_weight_loads_precede_the_pdl_wait_in_the_1_row_products(tmp_path):
    """gemv (the RMSNorm 1-row product) and the 1-row split absorb, built for sm_90 as numba builds
    them at launch (one process without the simulator): every first-round weight load is found
    (at least 8 / 32 16-byte loads), and with nvJitLink >= 13.5 all 8 / 32 come before ACQBULK,
    so an early PDL release overlaps them with the previous kernel. The CLI prints the same."""
    import json

    path = tmp_path / "order.json"
    proc = subprocess.run([sys.executable, "-c", ORDER_SCRIPT, str(path)], cwd=ROOT, env=no_sim_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(path.read_text())
    for name, first in (("gemv_rmsnorm", 8), ("absorb_split_mt1_l4", 32)):
        wait, loads = got["order"][name]
        assert len(loads) >= first and wait > 0, (name, wait, len(loads))
        if tuple(got["nvjitlink"]) >= (13, 5):
            assert sum(i < wait for i in loads) == first, (name, wait, loads[:40])
    cli = subprocess.run([sys.executable, "-m", "ddtree_numba.cli", "sass", "--pdl-order", "rms_norm_rows"],
                         cwd=ROOT, env=no_sim_env(), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert re.fullmatch(r"rms_norm_rows sm_90: ACQBULK at instruction \d+; 0 of \d+ LDG\.E\.128\.CONSTANT "
                        r"before it \(nvJitLink .+\)", cli.stdout.strip()), cli.stdout
