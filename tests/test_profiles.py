"""Device profiles: invariants, lookup, the roofline cost model, the active-profile choice."""
import math

import pytest

from sim import profiles
from sim.profiles import (
    H200,
    PROFILES,
    RTX_PRO_6000_BLACKWELL,
    DeviceProfile,
    achieved_fraction,
    active_profile,
    format_profiles_table,
    get_profile,
    profile_from_attributes,
    roofline,
    stored_profile,
)

ALL = list(PROFILES.values())


def verify_flops_bytes(n: int, t: int, h: int = 64, elem: int = 2) -> tuple[float, float]:
    """Limits §3's model of one tree-verify layer: FLOPs and bytes for N cached, T tree tokens."""
    flops = 2 * t * h * (n + t) * 1088
    n_bytes = ((n + t) * 576 + t * h * 576 + t * h * 512) * elem
    return flops, n_bytes


@pytest.mark.parametrize("p", ALL, ids=lambda p: p.name)
def test_profile_invariants(p: DeviceProfile):
    assert p.smem_per_block_optin >= p.smem_per_block_default == 48 * 1024
    assert p.smem_per_sm >= p.smem_per_block_optin + p.reserved_smem_per_block
    assert p.max_threads_per_sm >= p.max_threads_per_block == 1024
    assert p.max_threads_per_sm % p.warp_size == 0 and p.warp_size == 32
    assert p.regs_per_sm >= p.regs_per_block >= p.max_regs_per_thread * p.warp_size
    assert p.max_block_dim == (1024, 1024, 64)
    assert p.max_grid_dim == (2**31 - 1, 65535, 65535)
    assert p.hbm_bandwidth_measured is None or p.hbm_bandwidth_measured <= p.hbm_bandwidth_spec
    assert p.bf16_tensor_measured is None or p.bf16_tensor_measured <= p.bf16_tensor_peak
    assert p.bf16_tensor_peak > p.fp32_peak
    assert "datasheet" in p.source and p.name in p.describe() and p.arch in p.describe()
    assert get_profile(p.name) is p


def test_profile_values():
    assert PROFILES.keys() == {"h200", "rtx-pro-6000"}
    assert H200.compute_capability == (9, 0) and H200.arch == "sm_90"
    assert RTX_PRO_6000_BLACKWELL.compute_capability == (12, 0) and RTX_PRO_6000_BLACKWELL.arch == "sm_120"
    assert (H200.sm_count, RTX_PRO_6000_BLACKWELL.sm_count) == (132, 188)
    assert (H200.smem_per_block_optin, RTX_PRO_6000_BLACKWELL.smem_per_block_optin) == (232448, 101376)
    assert (H200.max_threads_per_sm, RTX_PRO_6000_BLACKWELL.max_threads_per_sm) == (2048, 1536)
    # FP32 peak = SMs x 128 lanes x 2 FLOP x boost clock, within the clocks' rounding.
    assert H200.fp32_peak == pytest.approx(132 * 128 * 2 * 1.98e9, rel=0.01)
    assert RTX_PRO_6000_BLACKWELL.fp32_peak == pytest.approx(188 * 128 * 2 * 2.6e9, rel=0.02)


def test_profiles_are_frozen():
    with pytest.raises(AttributeError):
        H200.sm_count = 1


@pytest.mark.parametrize("bad", ["H200", "h100", "", "rtx_pro_6000"])
def test_get_profile_unknown_names_list_valid_ones(bad):
    with pytest.raises(ValueError, match="h200.*rtx-pro-6000"):
        get_profile(bad)


def test_get_profile_type_error():
    with pytest.raises(TypeError, match="name"):
        get_profile(90)


# Rows of limits §3's table: (N, T, GFLOP, AI flop/B, t_mem µs at 4.8 TB/s, FP32 floor µs).
TABLE_ROWS = [
    (4096, 9, 5.15, 860, 1.2, 77),
    (32768, 33, 150.74, 3557, 8.8, 2250),
    (131072, 65, 1187.07, 7414, 33.4, 17718),
]


@pytest.mark.parametrize("n,t,gflop,ai,t_mem_us,fp32_us", TABLE_ROWS)
def test_roofline_matches_limits_table(n, t, gflop, ai, t_mem_us, fp32_us):
    flops, n_bytes = verify_flops_bytes(n, t)
    assert flops / 1e9 == pytest.approx(gflop, abs=0.01)
    spec = roofline(H200, n_bytes, flops, "fp32", measured=False)
    assert spec.arithmetic_intensity == pytest.approx(ai, abs=1)
    assert spec.t_memory_s * 1e6 == pytest.approx(t_mem_us, abs=0.06)
    assert spec.t_compute_s * 1e6 == pytest.approx(fp32_us, abs=0.5)  # table rounds to µs
    assert spec.bound == "compute" and spec.t_floor_s == spec.t_compute_s


def test_roofline_n32768_t33_is_2_25_ms_fp32():
    flops, n_bytes = verify_flops_bytes(32768, 33)
    r = roofline(H200, n_bytes, flops)  # measured ceilings: 4.3 TB/s copy
    assert r.t_floor_s == pytest.approx(2.25e-3, rel=1e-3)
    assert r.t_memory_s == pytest.approx(n_bytes / 4.3e12)
    assert r.bandwidth == 4.3e12 and r.peak == 67e12


def test_roofline_bf16_tensor_cores_measured_and_spec():
    flops, n_bytes = verify_flops_bytes(32768, 33)
    assert roofline(H200, n_bytes, flops, "bf16_tc", measured=False).t_compute_s * 1e6 == pytest.approx(152, abs=1)
    assert roofline(H200, n_bytes, flops, "bf16_tc").t_compute_s * 1e6 == pytest.approx(191, abs=1)
    # No measured values on the RTX PRO 6000: measured=True falls back to the datasheet.
    a = roofline(RTX_PRO_6000_BLACKWELL, n_bytes, flops, "bf16_tc", measured=True)
    b = roofline(RTX_PRO_6000_BLACKWELL, n_bytes, flops, "bf16_tc", measured=False)
    assert a == b and a.peak == 504e12 and a.bandwidth == 1.792e12


def test_roofline_memory_bound_copy_and_ridge_point():
    # A pure copy of 1 GB: memory-bound, 1e9 / 4.3e12 s.
    r = roofline(H200, 1e9, 0)
    assert r.bound == "memory" and r.t_floor_s == pytest.approx(1e9 / 4.3e12) and r.t_compute_s == 0
    # Exactly at the ridge point (peak / bandwidth FLOP per byte) both times are equal.
    ridge = H200.fp32_peak / H200.hbm_bandwidth_spec
    at_ridge = roofline(H200, 1e6, ridge * 1e6, measured=False)
    assert at_ridge.t_memory_s == pytest.approx(at_ridge.t_compute_s)
    assert roofline(H200, 1e6, 0.9 * ridge * 1e6, measured=False).bound == "memory"
    assert roofline(H200, 1e6, 1.1 * ridge * 1e6, measured=False).bound == "compute"
    assert math.isinf(roofline(H200, 0, 1e9).arithmetic_intensity)


def test_achieved_fraction():
    r = roofline(H200, 0, 67e12 * 1e-3)  # 1 ms of FP32 work
    assert achieved_fraction(1e-3, r) == pytest.approx(1.0)
    assert achieved_fraction(4e-3, r) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="t_measured"):
        achieved_fraction(0.0, r)
    with pytest.raises(ValueError, match="t_measured"):
        achieved_fraction(-1.0, r)
    with pytest.raises(TypeError, match="roofline"):
        achieved_fraction(1.0, 2.0)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(bytes_moved=-1, flops=1), ValueError, "bytes_moved"),
        (dict(bytes_moved=1, flops=float("nan")), ValueError, "flops"),
        (dict(bytes_moved=0, flops=0), ValueError, "both 0"),
        (dict(bytes_moved="1", flops=1), TypeError, "bytes_moved"),
        (dict(bytes_moved=1, flops=True), TypeError, "flops"),
        (dict(bytes_moved=1, flops=1, unit="tf32"), ValueError, "unit"),
    ],
)
def test_roofline_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        roofline(H200, **kwargs)


def test_roofline_rejects_non_profile():
    with pytest.raises(TypeError, match="profile"):
        roofline("h200", 1, 1)


ATTRS = dict(
    MULTIPROCESSOR_COUNT=84, CLOCK_RATE=1_800_000, MEMORY_CLOCK_RATE=10_000_000,
    GLOBAL_MEMORY_BUS_WIDTH=384, MAX_THREADS_PER_BLOCK=1024, MAX_THREADS_PER_MULTIPROCESSOR=1536,
    WARP_SIZE=32, MAX_REGISTERS_PER_BLOCK=65536, MAX_REGISTERS_PER_MULTIPROCESSOR=65536,
    MAX_SHARED_MEMORY_PER_BLOCK=49152, MAX_SHARED_MEMORY_PER_BLOCK_OPTIN=101376,
    MAX_SHARED_MEMORY_PER_MULTIPROCESSOR=102400, RESERVED_SHARED_MEMORY_PER_BLOCK=1024,
    L2_CACHE_SIZE=6 * 2**20, MAX_BLOCK_DIM_X=1024, MAX_BLOCK_DIM_Y=1024, MAX_BLOCK_DIM_Z=64,
    MAX_GRID_DIM_X=2**31 - 1, MAX_GRID_DIM_Y=65535, MAX_GRID_DIM_Z=65535,
)


def test_profile_from_attributes_known_and_unknown_cc():
    p = profile_from_attributes(ATTRS, device_name="Some GPU", compute_capability=(8, 6), total_memory=24 * 10**9)
    assert p.name == "device-sm_86" and p.arch == "sm_86" and p.sm_count == 84
    assert p.hbm_bandwidth_spec == pytest.approx(2 * 10e9 * 48)  # 960 GB/s
    assert p.fp32_peak == pytest.approx(84 * 128 * 2 * 1.8e9)
    assert p.bf16_tensor_peak is None and p.hbm_bandwidth_measured is None
    with pytest.raises(ValueError, match="bf16_tc"):
        roofline(p, 1, 1, "bf16_tc")
    unknown = profile_from_attributes(ATTRS, device_name="x", compute_capability=(11, 0), total_memory=1)
    assert unknown.fp32_peak is None
    with pytest.raises(ValueError, match="fp32"):
        roofline(unknown, 1, 1)


# Device attributes read with numba on an H200 (driver 580.159, 2026-11-30).
H200_ATTRS = {
    "MULTIPROCESSOR_COUNT": 132, "CLOCK_RATE": 1980000, "MEMORY_CLOCK_RATE": 3201000,
    "GLOBAL_MEMORY_BUS_WIDTH": 6016, "MAX_THREADS_PER_BLOCK": 1024, "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
    "WARP_SIZE": 32, "MAX_REGISTERS_PER_BLOCK": 65536, "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536,
    "MAX_SHARED_MEMORY_PER_BLOCK": 49152, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472, "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024,
    "L2_CACHE_SIZE": 62914560, "MAX_BLOCK_DIM_X": 1024, "MAX_BLOCK_DIM_Y": 1024, "MAX_BLOCK_DIM_Z": 64,
    "MAX_GRID_DIM_X": 2147483647, "MAX_GRID_DIM_Y": 65535, "MAX_GRID_DIM_Z": 65535,
}
LIMIT_FIELDS = (
    "compute_capability", "sm_count", "max_threads_per_block", "max_threads_per_sm", "warp_size",
    "regs_per_block", "regs_per_sm", "max_regs_per_thread", "smem_per_block_default",
    "smem_per_block_optin", "smem_per_sm", "reserved_smem_per_block", "l2_bytes", "max_block_dim",
    "max_grid_dim",
)


def test_h200_profile_matches_the_real_device_attributes():
    p = profile_from_attributes(H200_ATTRS, device_name="NVIDIA H200", compute_capability=(9, 0), total_memory=150109880320)
    assert {f: getattr(p, f) for f in LIMIT_FIELDS} == {f: getattr(H200, f) for f in LIMIT_FIELDS}
    # Derived ceilings agree with the datasheet values to within the clocks' rounding.
    assert p.hbm_bandwidth_spec == pytest.approx(H200.hbm_bandwidth_spec, rel=0.01)
    assert p.fp32_peak == pytest.approx(H200.fp32_peak, rel=0.01)


# Device attributes of an H100 SXM (sm_90 like the H200; HBM3 at 2.619 GHz on a 5120-bit bus).
H100_ATTRS = {**H200_ATTRS, "MEMORY_CLOCK_RATE": 2619000, "GLOBAL_MEMORY_BUS_WIDTH": 5120,
              "L2_CACHE_SIZE": 52428800}


def test_stored_profile_needs_the_name_as_well_as_the_compute_capability():
    assert stored_profile((9, 0), "NVIDIA H200") is H200
    assert stored_profile((9, 0), "nvidia h200 nvl") is H200
    assert stored_profile((12, 0), "NVIDIA RTX PRO 6000 Blackwell Server Edition") is RTX_PRO_6000_BLACKWELL
    # An H100 is sm_90 but not an H200: no stored profile, so it is built from its attributes,
    # with its own bandwidth (a decode-step floor at the H200's 4.3 TB/s would overstate its fraction).
    assert stored_profile((9, 0), "NVIDIA H100 80GB HBM3") is None
    assert stored_profile((9, 0), "NVIDIA GH200 480GB") is None   # whole words: a GH200 is not an H200
    assert stored_profile((8, 0), "NVIDIA H200") is None
    h100 = profile_from_attributes(H100_ATTRS, device_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0),
                                   total_memory=85 * 10**9)
    assert h100.name == "device-sm_90"
    assert h100.hbm_bandwidth_spec == pytest.approx(3.35e12, rel=0.01)
    assert h100.hbm_bandwidth_spec < H200.hbm_bandwidth_measured


def test_active_profile_env_override(monkeypatch):
    monkeypatch.setenv(profiles.PROFILE_ENV_VAR, "rtx-pro-6000")
    assert active_profile() is RTX_PRO_6000_BLACKWELL
    monkeypatch.setenv(profiles.PROFILE_ENV_VAR, "h200")
    assert active_profile() is H200
    monkeypatch.setenv(profiles.PROFILE_ENV_VAR, "a100")
    with pytest.raises(ValueError, match="DDTREE_DEVICE_PROFILE.*h200"):
        active_profile()


def test_active_profile_default_is_h200_without_a_gpu(monkeypatch):
    from numba import cuda

    monkeypatch.delenv(profiles.PROFILE_ENV_VAR, raising=False)
    if not cuda.config.ENABLE_CUDASIM:
        pytest.skip("a real GPU picks the profile by compute capability and name")
    assert active_profile() is H200


def test_format_profiles_table():
    table = format_profiles_table()
    lines = table.splitlines()
    assert lines[0].split() == ["profile", "h200", "rtx-pro-6000"]
    assert set(lines[1]) <= {"-", " "}
    for needle in ("sm_90", "sm_120", "227 KiB (232448 B)", "99 KiB (101376 B)", "4.3 TB/s", "989 TFLOP/s"):
        assert needle in table
    # Fixed width: every value column starts at the same offset on every table row.
    col = lines[0].index("h200")
    body = [line for line in lines[2:] if line and not line.startswith(("h200", "rtx-pro-6000"))]
    assert all(line[col - 2 : col] == "  " and line[col] != " " for line in body)
