"""The kernel registry and the sm_90 / sm_120 compile check.

The log parser and the checks run in-process on real nvJitLink logs captured with numba-cuda
0.30.4 + nvJitLink 13.5; the compiler itself runs in a subprocess without the simulator.
"""
import importlib
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
from numba import cuda, float32, int32

from ddtree_numba.kernels import registry
from sim import compile_check
from sim.compile_check import (
    CompileCheckError,
    CompileResult,
    check_result,
    format_report,
    max_threads_per_block,
    parse_link_log,
)
from sim.profiles import H200, RTX_PRO_6000_BLACKWELL
from tests.compile_helpers import needs_compiler, no_sim_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Mangled entry names as numba-cuda emits them.
ENTRY_SMEM = (
    "_ZN8__main__8smem_sumB2v1B108cw51cXTLSUwv1sDUaKthqaNgoKmjgOR3W3CwAkMXLaJtQYkOIgxJU0gCqOkEJoHkbttqdVho"
    "qlspQGNFHSgJ5BkDWempebpABwN5IKfXagIAE5ArrayIfLi1E1C7mutable7alignedE5ArrayIfLi1E1C7mutable7alignedE"
)
ENTRY_LOCAL = (
    "_ZN8__main__3locB2v2B116cw51cXTLSUwv1sDUaKthaKSjYKCpo4DkeVtwuAKDFy2mbUGpDiIMSVRIAqgJBSaB5HDbanVYcKpbKUC"
    "jRR0oCeQZA1npqXm6QBcDeSC312oCAA_3d_3dE5ArrayIfLi1E1C7mutable7alignedEi"
)
ENTRY_SPILL = (
    "_ZN13_3cdynamic_3e5spillB2v3B108cw51cXTLSUwv1sDUaKthqaNgoKmjgOR3W3CwAkMXLaJtQYkOIgxJU0gCqOkEJoHkbttqdV"
    "hoqlspQGNFHSgJ5BkDWempebpABwN5IKfXagIAE5ArrayIfLi1E1C7mutable7alignedE5ArrayIfLi1E1C7mutable7alignedE"
)

# Real nvJitLink -v logs (LTO-IR -> cubin, numba-cuda 0.30.4, nvJitLink 13.5), names spliced in.
# sm_90: a 128-float shared array, one syncthreads, an atomic.
LOG_SMEM_SM90 = """\
INFO: NVVM70 LTOIR Container created (4252 bytes)
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{e}' for 'sm_90'
ptxas info    : Function properties for {e}
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 512 bytes smem
ptxas info    : Compile time = 5.425 ms
\x00""".format(e=ENTRY_SMEM)

# sm_120: a 64-float local array (stack frame, no shared memory: ptxas prints no smem).
LOG_LOCAL_SM120 = """\
INFO: Solid LTOIR Container created (7436 bytes)
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{e}' for 'sm_120'
ptxas info    : Function properties for {e}
ptxas         .     256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 256 bytes cumulative stack size
ptxas info    : Compile time = 40.404 ms
\x00""".format(e=ENTRY_LOCAL)

# sm_90 with -maxrregcount=24: 48 live floats spill.
LOG_SPILL_SM90 = """\
INFO: NVVM70 LTOIR Container created (16012 bytes)
ptxas info    : Overriding maximum register limit 256 for '{e}' with  24 of maxrregcount option
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{e}' for 'sm_90'
ptxas info    : Function properties for {e}
ptxas         .     368 bytes stack frame, 896 bytes spill stores, 908 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers, 368 bytes cumulative stack size
ptxas info    : Compile time = 56.145 ms
\x00""".format(e=ENTRY_SPILL)

# A device function that was not inlined gets its own properties block, without "entry".
DEVICE_FUNCTION_BLOCK = """\
ptxas info    : Function properties for _ZN5other6helperEi
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""


# ------------------------------------------------------------------------------------------
# Log parser
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "log,arch,entry,resources",
    [
        # (registers, barriers, stack, smem, spill stores, spill loads)
        (LOG_SMEM_SM90, "sm_90", ENTRY_SMEM, (10, 1, 0, 512, 0, 0)),
        (LOG_LOCAL_SM120, "sm_120", ENTRY_LOCAL, (40, 0, 256, 0, 0, 0)),
        (LOG_SPILL_SM90, "sm_90", ENTRY_SPILL, (24, 0, 368, 0, 896, 908)),
    ],
    ids=["smem-sm_90", "local-sm_120", "spills-sm_90"],
)
def test_parse_link_log_real_samples(log, arch, entry, resources):
    r = parse_link_log(log, arch)
    assert r.entry == entry
    assert (r.registers, r.barriers, r.stack_bytes, r.smem_bytes, r.spill_store_bytes, r.spill_load_bytes) == resources


def test_parse_link_log_takes_the_entry_not_a_device_function():
    log = LOG_SMEM_SM90.replace("ptxas info    : Compiling", DEVICE_FUNCTION_BLOCK + "ptxas info    : Compiling")
    r = parse_link_log(log, "sm_90")
    assert (r.registers, r.stack_bytes, r.spill_store_bytes) == (10, 0, 0)


def test_parse_link_log_rejects_wrong_arch_and_entry_count():
    with pytest.raises(CompileCheckError, match="compiled for sm_90, expected sm_120"):
        parse_link_log(LOG_SMEM_SM90, "sm_120")
    with pytest.raises(CompileCheckError, match="found 0"):
        parse_link_log("ptxas info    : 0 bytes gmem\n", "sm_90")
    with pytest.raises(CompileCheckError, match="found 2"):
        parse_link_log(LOG_SMEM_SM90 + LOG_SPILL_SM90, "sm_90")


@pytest.mark.parametrize(
    "old,new,match",
    [
        ("Used 10 registers, ", "", "registers"),
        ("used 1 barriers", "", "barriers"),
        ("0 bytes stack frame, ", "", "stack frame"),
        ("0 bytes spill stores, ", "", "spill stores"),
        (", 0 bytes spill loads", "", "spill loads"),
    ],
)
def test_parse_link_log_missing_field_raises_with_log(old, new, match):
    broken = LOG_SMEM_SM90.replace(old, new, 1)
    assert broken != LOG_SMEM_SM90
    with pytest.raises(CompileCheckError, match=match) as err:
        parse_link_log(broken, "sm_90")
    assert "Compile time = 5.425 ms" in str(err.value)  # the log is in the message


def test_parse_link_log_missing_properties_section():
    no_props = "\n".join(line for line in LOG_SMEM_SM90.splitlines() if "Function properties" not in line)
    with pytest.raises(CompileCheckError, match="no function properties"):
        parse_link_log(no_props, "sm_90")


# ------------------------------------------------------------------------------------------
# Checks and report
# ------------------------------------------------------------------------------------------


def result(**overrides) -> CompileResult:
    base = dict(
        name="k", signature="(array(float32, 1d, C))", arch="sm_90", registers=32, barriers=1,
        stack_bytes=0, smem_bytes=1536, spill_store_bytes=0, spill_load_bytes=0,
        ltoir_bytes=5000, cubin_bytes=7000,
    )
    return CompileResult(**(base | overrides))


@pytest.mark.parametrize(
    "overrides,problem",
    [
        ({}, None),
        (dict(arch="sm_120", smem_bytes=512), None),
        (dict(smem_bytes=48 * 1024), None),
        (dict(smem_bytes=48 * 1024 + 4), "static smem 49156 B > default limit 49152 B"),
        (dict(arch="sm_120", smem_bytes=48 * 1024 + 4), "static smem 49156 B > default limit 49152 B"),
        (dict(smem_bytes=200 * 1024, smem_opt_in=True), None),
        (dict(arch="sm_120", smem_bytes=99 * 1024, smem_opt_in=True), None),
        (dict(arch="sm_120", smem_bytes=200 * 1024, smem_opt_in=True), "> opt-in limit 101376 B"),
        (dict(registers=255), None),
        (dict(registers=256), "256 registers > 255 per thread"),
        (dict(spill_store_bytes=8), "spills 8 B stores / 0 B loads"),
        (dict(spill_load_bytes=4), "spills 0 B stores / 4 B loads"),
        (dict(stack_bytes=256), None),  # local arrays live on the stack: reported, not a failure
        (dict(registers=70, block_threads=896), None),
        (dict(registers=70, block_threads=1024), "70 registers allow 896 threads per block, launched with 1024"),
        (dict(registers=216, block_threads=288), "216 registers allow 256 threads per block, launched with 288"),
        (dict(registers=255, block_threads=512), "255 registers allow 256 threads per block, launched with 512"),
        (dict(registers=255, block_threads=None), None),
        (dict(programmatic=True, pdl_wait=True), None),
        (dict(programmatic=False, pdl_wait=False), None),   # an ordinary kernel needs no wait
        (dict(programmatic=True, pdl_wait=False), "no griddepcontrol.wait"),
    ],
)
def test_check_result(overrides, problem):
    problems = check_result(result(**overrides))
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0]


@pytest.mark.parametrize(
    "registers,expected",
    [(0, 1024), (16, 1024), (32, 1024), (64, 1024), (65, 896), (70, 896), (72, 896), (73, 768),
     (122, 512), (128, 512), (168, 384), (216, 256), (255, 256)],
)
def test_max_threads_per_block(registers, expected):
    # 70 regs -> 9 units x 256 = 2304 per warp; 16384 / 2304 -> 7 warps per sub-partition, 28.
    # 122 and 216 were launched on an H200: 512 ran, 544 failed; 288 failed.
    assert max_threads_per_block(registers, H200) == expected
    assert max_threads_per_block(registers, RTX_PRO_6000_BLACKWELL) == expected


def test_max_threads_per_block_brute_force():
    for registers in range(256):
        per_warp = -(-registers // 8) * 8 * 32  # 8 registers per thread = one 256-register unit
        # Warps go round-robin to 4 sub-partitions of 16384 registers each.
        best = max(w * 32 for w in range(1, 33) if -(-w // 4) * per_warp <= 16384)
        assert max_threads_per_block(registers, H200) == best


def test_check_result_compile_error():
    failed = CompileResult("bad", "(int32)", "sm_120", error="compile failed: TypingError: x\nmore")
    assert check_result(failed) == ["failed to compile: compile failed: TypingError: x"]


def test_format_report():
    results = [
        result(),
        result(arch="sm_120", registers=70, smem_bytes=512, spill_store_bytes=8, spill_load_bytes=12),
        CompileResult("bad", "(int32)", "sm_90", error="compile failed: TypingError"),
    ]
    lines = format_report(results).splitlines()
    assert lines[0].split() == ["kernel", "signature", "arch", "regs", "max", "tpb", "smem", "stack", "spills", "check"]
    assert lines[2].split()[-1] == "ok" and "1536" in lines[2]
    assert "(float32[1d,C])" in lines[2] and "array(" not in lines[2]
    assert lines[3].split()[3:5] == ["70", "896"]
    assert "sm_120" in lines[3] and "8/12" in lines[3] and "FAIL: spills 8 B stores / 12 B loads" in lines[3]
    assert lines[4].startswith("bad") and "FAIL: failed to compile" in lines[4]
    assert lines[-1] == "3 compiled, 2 failed"
    # Fixed width: the arch column starts at the same offset on every row.
    col = lines[0].index("arch")
    assert all(line[col:col + 3] == "sm_" for line in lines[2:5])


def test_json_written_atomically(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    compile_check._write_json_atomic(str(path), [result(), result(registers=300)])
    data = json.loads(path.read_text())
    assert [d["registers"] for d in data] == [32, 300]
    assert data[0]["problems"] == [] and "300 registers" in data[1]["problems"][0]
    assert data[0]["max_threads_per_block"] == 1024
    assert os.listdir(tmp_path) == ["out.json"]  # no temp file left


def test_main_refuses_under_the_simulator(capsys):
    if not cuda.config.ENABLE_CUDASIM:
        pytest.skip("the simulator is off in this process")
    assert compile_check.main(["--arch", "sm_90"]) == 2
    assert "run it in a process without the simulator" in capsys.readouterr().err


def test_main_help_explains_checks(capsys):
    with pytest.raises(SystemExit) as exc:
        compile_check.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in ("sm_90", "sm_120", "255", "spill", "48 KiB", "--kernel", "--json", "NUMBA_ENABLE_CUDASIM"):
        assert needle in text


@pytest.mark.parametrize("argv", [["--arch", "sm_80"], ["--json", "/nonexistent-dir/x.json"]])
def test_main_usage_errors_exit_2_before_compiling(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        compile_check.main(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_registry(monkeypatch):
    """Register into a copy of the registry so test kernels never leak into the real one."""
    registry.all_kernels()  # package modules register into the real registry, not the copy
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def _make_kernel(qualname: str):
    def body(a):
        a[cuda.threadIdx.x] = 1.0

    body.__qualname__ = qualname
    return cuda.jit(body)


SIG = ((float32[::1],),)


def test_register_and_get(fresh_registry):
    k = _make_kernel("k_a")
    assert registry.register("test_a", k, SIG, "writes ones", smem_opt_in=True, block_threads=256) is k
    spec = registry.get("test_a")
    assert spec.kernel is k and spec.signatures == SIG and spec.smem_opt_in and spec.description == "writes ones"
    assert spec.block_threads == 256
    registry.register("test_b", _make_kernel("k_b"), SIG, "defaults")
    assert registry.get("test_b").block_threads is None and not registry.get("test_b").smem_opt_in
    assert registry.get("test_b").archs is None and spec.archs is None
    registry.register("test_c", _make_kernel("k_c"), SIG, "Hopper only", archs=["sm_90"])
    assert registry.get("test_c").archs == ("sm_90",)
    registry.register("test_d", _make_kernel("k_d"), SIG, "a generator", archs=(a for a in ["sm_120"]))
    assert registry.get("test_d").archs == ("sm_120",)
    assert "test_a" in [s.name for s in registry.all_kernels()]
    names = [s.name for s in registry.all_kernels()]
    assert names == sorted(names)
    assert callable(spec.kernel.py_func)


def test_register_lists_become_tuples(fresh_registry):
    registry.register("test_lists", _make_kernel("k_l"), [[float32[::1], int32]], "lists")
    assert registry.get("test_lists").signatures == ((float32[::1], int32),)


def test_register_duplicates(fresh_registry):
    k = _make_kernel("k_dup")
    registry.register("test_dup", k, SIG, "first")
    registry.register("test_dup", k, SIG, "same object again")  # allowed
    reloaded = _make_kernel("k_dup")  # what a module reload produces: a new object, same definition
    registry.register("test_dup", reloaded, SIG, "reloaded")
    assert registry.get("test_dup").kernel is reloaded
    with pytest.raises(ValueError, match="'test_dup' is already registered by .*k_dup"):
        registry.register("test_dup", _make_kernel("k_other"), SIG, "different kernel")


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((1, "K", SIG, "d"), TypeError, "name"),
        (("", "K", SIG, "d"), ValueError, "name"),
        (("n", lambda a: None, SIG, "d"), TypeError, "kernel"),
        (("n", "K", (), "d"), ValueError, "signatures"),
        (("n", "K", "float32", "d"), ValueError, "signatures"),
        (("n", "K", (float32[::1],), "d"), TypeError, "signatures"),
        (("n", "K", (("float32",),), "d"), TypeError, "signatures"),
        (("n", "K", SIG, None), TypeError, "description"),
        (("n", "K", SIG, ""), ValueError, "description"),
    ],
)
def test_register_rejects_bad_input(fresh_registry, args, exc, match):
    args = tuple(_make_kernel("k_bad") if a == "K" else a for a in args)
    with pytest.raises(exc, match=match):
        registry.register(*args)
    assert "n" not in registry._REGISTRY


@pytest.mark.parametrize("threads,exc", [(0, ValueError), (1025, ValueError), (256.0, TypeError), (True, TypeError)])
def test_register_rejects_bad_block_threads(fresh_registry, threads, exc):
    with pytest.raises(exc, match="block_threads"):
        registry.register("n", _make_kernel("k_bt"), SIG, "d", block_threads=threads)
    assert "n" not in registry._REGISTRY


@pytest.mark.parametrize("archs", [(), "sm_90", [90], ["hopper"]])
def test_register_rejects_bad_archs(fresh_registry, archs):
    with pytest.raises(ValueError, match="archs"):
        registry.register("n", _make_kernel("k_ar"), SIG, "d", archs=archs)
    assert "n" not in registry._REGISTRY


def test_get_unknown_lists_names(fresh_registry):
    registry.register("test_known", _make_kernel("k_known"), SIG, "d")
    with pytest.raises(ValueError, match="no kernel registered as 'nope'.*test_known"):
        registry.get("nope")


def test_all_kernels_imports_every_kernel_module(fresh_registry, monkeypatch):
    imported = []
    real_import = registry.importlib.import_module

    def spy(name, *a):
        imported.append(name)
        return real_import(name, *a)

    monkeypatch.setattr(registry, "importlib", types.SimpleNamespace(import_module=spy))
    registry.all_kernels()
    for package in registry.KERNEL_PACKAGES:  # the round kernels and the engine's glue kernels
        modules = {m for m in imported if m.startswith(f"{package}.")}
        folder = os.path.dirname(importlib.import_module(package).__file__)
        on_disk = {f"{package}.{f[:-3]}" for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py"}
        assert modules == on_disk
    assert "ddtree_numba.kernels.registry" in imported


# ------------------------------------------------------------------------------------------
# End to end, in a process without the simulator
# ------------------------------------------------------------------------------------------




E2E_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from numba import cuda, float32, int32
    from ddtree_numba.kernels import registry
    from sim import compile_check as cc

    N = 128

    @cuda.jit(device=True)
    def squared(x):  # a called device function: typed for the target cc, not the (absent) GPU
        return x * x

    def smem_sum(a, out):
        s = cuda.shared.array(N, float32)
        i = cuda.threadIdx.x
        s[i] = a[i]
        cuda.syncthreads()  # all stores before the reversed read
        cuda.atomic.add(out, 0, s[N - 1 - i])

    def local_scratch(a, n):
        scratch = cuda.local.array(64, float32)
        for j in range(64):
            scratch[j] = a[(j * n) % 64]
        acc = float32(0)
        for j in range(n):
            acc += scratch[(j * 7) % 64] * squared(scratch[(j * 3 + n) % 64])
        a[cuda.threadIdx.x] = acc

    def untypable(a):
        a[0] = "not a float"

    from ddtree_numba.kernels import pdl

    def waits_first(a):
        pdl.pdl_begin()
        a[cuda.threadIdx.x] = float32(1.0)

    @cuda.jit(device=True)
    def pdl_begin():  # the name without the instruction: taken for programmatic launches, unsafe
        pass

    def waits_in_name_only(a):
        pdl_begin()
        a[cuda.threadIdx.x] = float32(1.0)

    registry.register("test_e2e_smem", cuda.jit(smem_sum), ((float32[::1], float32[::1]),), "smem", block_threads=N)
    registry.register("test_e2e_local", cuda.jit(local_scratch), ((float32[::1], int32),), "local")
    registry.register("test_e2e_bad", cuda.jit(untypable), ((float32[::1],),), "bad")
    registry.register("test_e2e_sm90", cuda.jit(smem_sum), ((float32[::1], float32[::1]),), "Hopper only",
                      block_threads=N, archs=("sm_90",))
    registry.register("test_e2e_pdl", cuda.jit(waits_first), ((float32[::1],),), "pdl")
    registry.register("test_e2e_fake_pdl", cuda.jit(waits_in_name_only), ((float32[::1],),), "fake pdl")
    out = {"direct": []}
    out["pdl"] = [(r.programmatic, r.pdl_wait, cc.check_result(r))
                  for name in ("test_e2e_pdl", "test_e2e_fake_pdl", "test_e2e_smem")
                  for r in [cc.compile_kernel(registry.get(name), registry.get(name).signatures[0], "sm_90")]]
    out["arch_specific"] = [r.arch for r in cc.run(("sm_90", "sm_120"), ["test_e2e_sm90"], progress=False)]
    out["arch_by_cc"] = [r.arch for r in cc.run(((9, 0), (12, 0)), ["test_e2e_sm90"], progress=False)]
    for name in ("test_e2e_smem", "test_e2e_local"):
        spec = registry.get(name)
        for cc_ in ((9, 0), "sm_120"):
            out["direct"].append(vars(cc.compile_kernel(spec, spec.signatures[0], cc_)))
    try:
        cc.compile_kernel(registry.get("test_e2e_bad"), (float32[::1],), "sm_90")
    except cc.CompileCheckError as exc:
        out["bad_error"] = str(exc)
    out["main_ok"] = cc.main(["--kernel", "test_e2e_smem", "--arch", "sm_120", "--jobs", "1",
                              "--json", sys.argv[1] + ".ok.json"])
    # two forked workers: they inherit the kernels registered above; results keep the task order
    out["main_bad"] = cc.main(["--kernel", "test_e2e_smem", "--kernel", "test_e2e_bad", "--jobs", "2",
                               "--json", sys.argv[1] + ".bad.json"])
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
    """
)


@needs_compiler
def test_compile_end_to_end_without_simulator(tmp_path):
    path = str(tmp_path / "e2e.json")
    proc = subprocess.run(
        [sys.executable, "-c", E2E_SCRIPT, path], cwd=ROOT, env=no_sim_env(),
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(open(path).read())
    assert out["arch_specific"] == ["sm_90"]  # a kernel registered for sm_90 only is not built for sm_120
    assert out["arch_by_cc"] == ["sm_90"]     # the same when the archs are given as compute capabilities
    real, fake, plain = out["pdl"]   # (programmatic, pdl_wait, problems)
    assert real == [True, True, []] and plain == [False, False, []]
    assert fake[:2] == [True, False] and "no griddepcontrol.wait" in fake[2][0]
    smem90, smem120, local90, local120 = out["direct"]
    assert [r["arch"] for r in out["direct"]] == ["sm_90", "sm_120"] * 2
    for r in out["direct"]:
        assert 0 < r["registers"] <= 255 and r["error"] is None
        assert r["spill_store_bytes"] == r["spill_load_bytes"] == 0
        assert r["ltoir_bytes"] > 0 and r["cubin_bytes"] > 0
    for r in (smem90, smem120):
        assert r["block_threads"] == 128
        assert r["signature"] == "(array(float32, 1d, C), array(float32, 1d, C))"
        assert r["smem_bytes"] == 128 * 4 and r["barriers"] == 1 and r["stack_bytes"] == 0
    for r in (local90, local120):
        assert r["smem_bytes"] == 0 and r["stack_bytes"] >= 64 * 4 and r["barriers"] == 0
    assert "compile failed: TypingError" in out["bad_error"] and "\x1b[" not in out["bad_error"]
    assert out["main_ok"] == 0 and out["main_bad"] == 1
    ok = json.loads(open(path + ".ok.json").read())
    assert [(r["name"], r["arch"], r["problems"]) for r in ok] == [("test_e2e_smem", "sm_120", [])]
    bad = json.loads(open(path + ".bad.json").read())
    assert [(r["name"], r["arch"]) for r in bad] == [
        ("test_e2e_smem", "sm_90"), ("test_e2e_smem", "sm_120"), ("test_e2e_bad", "sm_90"), ("test_e2e_bad", "sm_120"),
    ]
    assert [bool(r["problems"]) for r in bad] == [False, False, True, True]
    assert "4 compiled, 2 failed" in proc.stdout
    # One progress line per kernel x signature x arch on stderr.
    assert proc.stderr.count("compile-check: test_e2e_bad") == 2


@needs_compiler
def test_compile_check_module_on_a_package_kernel(tmp_path):
    names = [s.name for s in registry.all_kernels() if s.kernel.py_func.__module__ == "ddtree_numba.kernels.warp"]
    assert names, "ddtree_numba/kernels/warp.py registers its kernels"
    name = names[0]
    path = tmp_path / "cc.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sim.compile_check", "--kernel", name, "--json", str(path)],
        cwd=ROOT, env=no_sim_env(), capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(path.read_text())
    n_sigs = len(registry.get(name).signatures)
    assert len(data) == 2 * n_sigs and {r["arch"] for r in data} == {"sm_90", "sm_120"}
    assert all(r["name"] == name and r["problems"] == [] and r["registers"] > 0 for r in data)
    assert f"{2 * n_sigs} compiled, 0 failed" in proc.stdout
