"""Device profiles (H200 sm_90, RTX PRO 6000 Blackwell sm_120) and a roofline cost model.

A :class:`DeviceProfile` holds the limits a launch or a compiled kernel must respect (threads,
registers, shared memory, grid and block dimensions) and the ceilings a kernel is measured
against (HBM bandwidth, FP32 and bf16 tensor-core peaks). Limits come from the CUDA programming
guide's table for the compute capability; bandwidth and peaks are datasheet values unless a
field says *measured* (limits §3). The roofline helpers turn bytes and FLOPs into a time floor
(limits §3: every tree-verify shape is compute-bound with H=64).

Importing this module does not import ``numba.cuda``; only :func:`active_profile` does.
"""
from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DeviceProfile",
    "H200",
    "RTX_PRO_6000_BLACKWELL",
    "PROFILES",
    "stored_profile",
    "PROFILE_ENV_VAR",
    "get_profile",
    "active_profile",
    "profile_from_attributes",
    "Roofline",
    "roofline",
    "achieved_fraction",
    "format_profiles_table",
]

PROFILE_ENV_VAR = "DDTREE_DEVICE_PROFILE"

KIB = 1024
MIB = 1024 * KIB
# Limits shared by every compute capability >= 3.0 (CUDA programming guide, feature table).
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)


@dataclass(frozen=True)
class DeviceProfile:
    """Limits and performance ceilings of one GPU model.

    Sizes are in bytes, rates in bytes/s or FLOP/s. ``None`` marks a ceiling that is unknown
    (a measured value not taken yet, or a profile built from device attributes).
    """

    name: str  # short key, e.g. "h200"
    device_name: str
    compute_capability: tuple[int, int]
    sm_count: int
    max_threads_per_block: int
    max_threads_per_sm: int
    warp_size: int
    regs_per_block: int  # 32-bit registers
    regs_per_sm: int
    max_regs_per_thread: int
    smem_per_block_default: int  # without the opt-in attribute (static + dynamic)
    smem_per_block_optin: int  # with cudaFuncAttributeMaxDynamicSharedMemorySize
    smem_per_sm: int
    reserved_smem_per_block: int  # taken by the system out of smem_per_sm for each block
    l2_bytes: int
    hbm_bytes: int
    hbm_bandwidth_spec: float | None
    hbm_bandwidth_measured: float | None
    fp32_peak: float | None
    bf16_tensor_peak: float | None  # dense (no 2:4 sparsity)
    bf16_tensor_measured: float | None
    clock_notes: str
    source: str
    max_block_dim: tuple[int, int, int] = MAX_BLOCK_DIM
    max_grid_dim: tuple[int, int, int] = MAX_GRID_DIM
    # Words a GPU's reported name must contain (case-insensitive, whole words) to take this profile,
    # besides its compute capability: an H100 is sm_90 too, with 3.35 TB/s and 80 GB, not the H200's
    # ceilings, and a GH200 ("NVIDIA GH200 480GB") is not an H200 either. Empty: the compute
    # capability alone decides (a profile built from device attributes).
    name_match: str = ""

    @property
    def arch(self) -> str:
        """The ptxas/nvJitLink architecture name, e.g. ``"sm_90"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    def describe(self) -> str:
        """One-line identity used in error messages: ``'h200' (NVIDIA H200, sm_90)``."""
        return f"'{self.name}' ({self.device_name}, {self.arch})"


H200 = DeviceProfile(
    name="h200",
    device_name="NVIDIA H200 SXM",
    compute_capability=(9, 0),
    sm_count=132,
    max_threads_per_block=1024,
    max_threads_per_sm=2048,
    warp_size=32,
    regs_per_block=64 * KIB,
    regs_per_sm=64 * KIB,
    max_regs_per_thread=255,
    smem_per_block_default=48 * KIB,
    smem_per_block_optin=227 * KIB,  # 232448 B
    smem_per_sm=228 * KIB,
    reserved_smem_per_block=1 * KIB,
    l2_bytes=60 * MIB,  # L2_CACHE_SIZE = 62914560; PyTorch prints it as "60 MB" (limits §3)
    hbm_bytes=141 * 10**9,
    hbm_bandwidth_spec=4.8e12,
    hbm_bandwidth_measured=4.3e12,  # device-to-device copy, limits §3
    fp32_peak=67e12,
    bf16_tensor_peak=989e12,
    bf16_tensor_measured=790e12,  # bf16 GEMM, limits §3
    name_match="H200",  # the lent H200 reports "NVIDIA H200"
    clock_notes="peaks at the 1.98 GHz boost clock: 132 SMs x 128 FP32 lanes x 2 x 1.98 GHz = 67 TFLOP/s",
    source=(
        "thread/register/shared-memory/L2/grid limits: CUDA programming guide table for compute "
        "capability 9.0, and equal to the device attributes read on an H200 here (2026-11-30); "
        "SM count, HBM size and bandwidth, FP32 and bf16 peaks: NVIDIA H200 datasheet (the device "
        "reports 150,109,880,320 B of memory; 2 x 3.201 GHz x 6016-bit bus = 4.81 TB/s); measured "
        "copy bandwidth (4.3 TB/s) and bf16 GEMM (~790 TFLOP/s): gpu-limits.md §3"
    ),
)

RTX_PRO_6000_BLACKWELL = DeviceProfile(
    name="rtx-pro-6000",
    device_name="NVIDIA RTX PRO 6000 Blackwell (GB202)",
    compute_capability=(12, 0),
    sm_count=188,
    max_threads_per_block=1024,
    max_threads_per_sm=1536,
    warp_size=32,
    regs_per_block=64 * KIB,
    regs_per_sm=64 * KIB,
    max_regs_per_thread=255,
    smem_per_block_default=48 * KIB,
    smem_per_block_optin=99 * KIB,  # 101376 B
    smem_per_sm=100 * KIB,
    reserved_smem_per_block=1 * KIB,
    l2_bytes=128 * MIB,
    hbm_bytes=96 * 10**9,  # GDDR7, not HBM; the field name is kept for one shape of profile
    hbm_bandwidth_spec=1.792e12,
    hbm_bandwidth_measured=None,
    fp32_peak=125e12,
    bf16_tensor_peak=504e12,
    bf16_tensor_measured=None,
    name_match="RTX PRO 6000",
    clock_notes="peaks at the ~2.6 GHz boost clock: 188 SMs x 128 FP32 lanes x 2 x 2.6 GHz ~ 125 TFLOP/s",
    source=(
        "thread/register/shared-memory limits: CUDA programming guide table for compute capability "
        "12.0; SM count, L2, memory size and bandwidth, FP32 and dense bf16 peaks: NVIDIA RTX PRO "
        "6000 Blackwell datasheet (approximate, ~); nothing measured on this card"
    ),
)

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (H200, RTX_PRO_6000_BLACKWELL)}

# FP32 lanes per SM for the compute capabilities we know; used to derive a peak from the clock.
_FP32_LANES_PER_SM: dict[tuple[int, int], int] = {
    (8, 0): 64,
    (8, 6): 128,
    (8, 9): 128,
    (9, 0): 128,
    (10, 0): 128,
    (12, 0): 128,
}


def get_profile(name: str) -> DeviceProfile:
    """Return the profile called ``name`` ("h200" or "rtx-pro-6000").

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: unknown ``name``; the message lists the valid names.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"name: unknown device profile {name!r}; valid names: {', '.join(sorted(PROFILES))}"
        ) from None


def profile_from_attributes(
    attrs: Mapping[str, int],
    *,
    device_name: str,
    compute_capability: tuple[int, int],
    total_memory: int,
) -> DeviceProfile:
    """Build a profile from CUDA device attributes (names without ``CU_DEVICE_ATTRIBUTE_``).

    Used on a GPU that matches no stored profile. Bandwidth is the theoretical
    ``2 x memory clock x bus width`` (approximate for GDDR7); the FP32 peak needs a known
    lanes-per-SM count; the bf16 tensor-core peak and every measured value are ``None``.
    """
    cc = tuple(compute_capability)
    sm_count = attrs["MULTIPROCESSOR_COUNT"]
    clock_hz = attrs.get("CLOCK_RATE", 0) * 1e3  # attribute is in kHz
    mem_clock_hz = attrs.get("MEMORY_CLOCK_RATE", 0) * 1e3
    bus_bytes = attrs.get("GLOBAL_MEMORY_BUS_WIDTH", 0) / 8
    lanes = _FP32_LANES_PER_SM.get(cc)
    bandwidth = 2.0 * mem_clock_hz * bus_bytes or None
    fp32_peak = sm_count * lanes * 2.0 * clock_hz if lanes and clock_hz else None
    return DeviceProfile(
        name=f"device-sm_{cc[0]}{cc[1]}",
        device_name=device_name,
        compute_capability=cc,
        sm_count=sm_count,
        max_threads_per_block=attrs["MAX_THREADS_PER_BLOCK"],
        max_threads_per_sm=attrs["MAX_THREADS_PER_MULTIPROCESSOR"],
        warp_size=attrs["WARP_SIZE"],
        regs_per_block=attrs["MAX_REGISTERS_PER_BLOCK"],
        regs_per_sm=attrs["MAX_REGISTERS_PER_MULTIPROCESSOR"],
        max_regs_per_thread=255,  # not a device attribute; 255 for every cc >= 3.5
        smem_per_block_default=attrs["MAX_SHARED_MEMORY_PER_BLOCK"],
        smem_per_block_optin=attrs["MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"],
        smem_per_sm=attrs["MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"],
        reserved_smem_per_block=attrs.get("RESERVED_SHARED_MEMORY_PER_BLOCK", 0),
        l2_bytes=attrs["L2_CACHE_SIZE"],
        hbm_bytes=total_memory,
        hbm_bandwidth_spec=bandwidth,
        hbm_bandwidth_measured=None,
        fp32_peak=fp32_peak,
        bf16_tensor_peak=None,
        bf16_tensor_measured=None,
        clock_notes=f"SM clock {clock_hz / 1e9:.2f} GHz, memory clock {mem_clock_hz / 1e9:.2f} GHz (device attributes)",
        source="CUDA device attributes of the current device (numba cuda.get_current_device())",
        max_block_dim=(attrs["MAX_BLOCK_DIM_X"], attrs["MAX_BLOCK_DIM_Y"], attrs["MAX_BLOCK_DIM_Z"]),
        max_grid_dim=(attrs["MAX_GRID_DIM_X"], attrs["MAX_GRID_DIM_Y"], attrs["MAX_GRID_DIM_Z"]),
    )


_DEVICE_ATTRIBUTES = (
    "MULTIPROCESSOR_COUNT", "CLOCK_RATE", "MEMORY_CLOCK_RATE", "GLOBAL_MEMORY_BUS_WIDTH",
    "MAX_THREADS_PER_BLOCK", "MAX_THREADS_PER_MULTIPROCESSOR", "WARP_SIZE",
    "MAX_REGISTERS_PER_BLOCK", "MAX_REGISTERS_PER_MULTIPROCESSOR",
    "MAX_SHARED_MEMORY_PER_BLOCK", "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", "RESERVED_SHARED_MEMORY_PER_BLOCK", "L2_CACHE_SIZE",
    "MAX_BLOCK_DIM_X", "MAX_BLOCK_DIM_Y", "MAX_BLOCK_DIM_Z",
    "MAX_GRID_DIM_X", "MAX_GRID_DIM_Y", "MAX_GRID_DIM_Z",
)


def stored_profile(compute_capability: tuple[int, int], device_name: str) -> DeviceProfile | None:
    """The stored profile of a GPU with this compute capability and reported name, or None.

    Both must match (``DeviceProfile.name_match``: whole words of the name, case-insensitive):
    an H100 shares the H200's sm_90 but not its bandwidth or memory, so it gets None and the
    caller builds its profile from the device's attributes.
    """
    cc = tuple(compute_capability)
    for profile in PROFILES.values():
        words = rf"\b{re.escape(profile.name_match)}\b" if profile.name_match else ""
        if profile.compute_capability == cc and re.search(words, device_name, re.IGNORECASE):
            return profile
    return None


# Profiles built from a device's attributes, by device id: active_profile runs at every checked
# launch, and building one reads every attribute and the memory size.
_BUILT: dict[int, DeviceProfile] = {}


def _current_device_profile() -> DeviceProfile:
    """The stored profile matching the current GPU (compute capability and name), else one built
    from its attributes."""
    from numba import cuda

    device = cuda.get_current_device()
    cc = tuple(device.compute_capability)
    name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
    profile = stored_profile(cc, name)
    if profile is not None:
        return profile
    key = int(device.id)
    if key not in _BUILT:
        attrs = {attr: getattr(device, attr) for attr in _DEVICE_ATTRIBUTES}
        total_memory = cuda.current_context().get_memory_info().total
        _BUILT[key] = profile_from_attributes(attrs, device_name=name, compute_capability=cc,
                                              total_memory=total_memory)
    return _BUILT[key]


def active_profile() -> DeviceProfile:
    """The profile launches are checked against.

    Order: ``$DDTREE_DEVICE_PROFILE`` if set; under the simulator (or with no GPU), H200, the
    primary target; on a GPU, the stored profile with its compute capability and name
    (:func:`stored_profile`: 9.0 and "H200" -> h200, 12.0 and "RTX PRO 6000" -> rtx-pro-6000) or
    one built from its attributes (an H100: ``device-sm_90``). Imports ``numba.cuda``.

    Raises:
        ValueError: ``$DDTREE_DEVICE_PROFILE`` names no profile.
    """
    requested = os.environ.get(PROFILE_ENV_VAR)
    if requested:
        if requested not in PROFILES:
            raise ValueError(
                f"{PROFILE_ENV_VAR}={requested!r} names no device profile; "
                f"valid names: {', '.join(sorted(PROFILES))}"
            )
        return PROFILES[requested]
    from numba import cuda

    if cuda.config.ENABLE_CUDASIM or not cuda.is_available():
        return H200
    return _current_device_profile()


# ---------------------------------------------------------------------------------------------
# Roofline cost model
# ---------------------------------------------------------------------------------------------

Unit = Literal["fp32", "bf16_tc"]


@dataclass(frozen=True)
class Roofline:
    """Time floor of a kernel: the slower of moving its bytes and doing its FLOPs."""

    t_memory_s: float
    t_compute_s: float
    t_floor_s: float
    bound: Literal["memory", "compute"]
    arithmetic_intensity: float  # FLOP per byte (inf when no bytes move)
    bandwidth: float  # B/s used
    peak: float  # FLOP/s used


def _check_amount(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


def _ceiling(measured_value: float | None, spec_value: float | None, measured: bool) -> float | None:
    """The measured ceiling when asked for and known, else the datasheet one."""
    return measured_value if measured and measured_value is not None else spec_value


def roofline(
    profile: DeviceProfile,
    bytes_moved: float,
    flops: float,
    unit: Unit = "fp32",
    measured: bool = True,
) -> Roofline:
    """Roofline floor for ``bytes_moved`` bytes of DRAM traffic and ``flops`` FLOPs.

    ``unit`` picks the compute ceiling: "fp32" (CUDA cores, FFMA = 2 FLOPs) or "bf16_tc"
    (dense bf16 tensor cores). With ``measured=True`` measured ceilings are used where the
    profile has them, datasheet values otherwise. Limits §3: N=32768, T=33, H=64 on the H200
    is 150.7 GFLOP, a 2.25 ms FP32 floor, compute-bound.

    Raises:
        TypeError: ``profile`` is not a DeviceProfile, or an amount is not a real number.
        ValueError: negative or non-finite amounts, both zero, unknown ``unit``, or a ceiling
            the profile does not know.
    """
    if not isinstance(profile, DeviceProfile):
        raise TypeError(f"profile must be a DeviceProfile, got {type(profile).__name__}")
    n_bytes = _check_amount(bytes_moved, "bytes_moved")
    n_flops = _check_amount(flops, "flops")
    if n_bytes == 0 and n_flops == 0:
        raise ValueError("bytes_moved and flops are both 0: nothing to bound")
    if unit == "fp32":
        peak = profile.fp32_peak  # no measured FP32 ceiling is stored
    elif unit == "bf16_tc":
        peak = _ceiling(profile.bf16_tensor_measured, profile.bf16_tensor_peak, measured)
    else:
        raise ValueError(f"unit must be 'fp32' or 'bf16_tc', got {unit!r}")
    bandwidth = _ceiling(profile.hbm_bandwidth_measured, profile.hbm_bandwidth_spec, measured)
    if peak is None:
        raise ValueError(f"unit: profile {profile.describe()} has no {unit} peak")
    if bandwidth is None:
        raise ValueError(f"profile {profile.describe()} has no memory bandwidth")
    t_memory = n_bytes / bandwidth
    t_compute = n_flops / peak
    return Roofline(
        t_memory_s=t_memory,
        t_compute_s=t_compute,
        t_floor_s=max(t_memory, t_compute),
        bound="compute" if t_compute >= t_memory else "memory",
        arithmetic_intensity=n_flops / n_bytes if n_bytes else math.inf,
        bandwidth=bandwidth,
        peak=peak,
    )


def achieved_fraction(t_measured: float, bound: Roofline) -> float:
    """Fraction of the roofline reached: ``t_floor / t_measured`` (1.0 = at the roof).

    Raises:
        TypeError: ``t_measured`` is not a real number or ``bound`` not a Roofline.
        ValueError: ``t_measured`` is not finite and > 0.
    """
    if not isinstance(bound, Roofline):
        raise TypeError(f"roofline must be a Roofline, got {type(bound).__name__}")
    t = _check_amount(t_measured, "t_measured")
    if t == 0:
        raise ValueError("t_measured must be > 0")
    return bound.t_floor_s / t


# ---------------------------------------------------------------------------------------------
# Table for `ddtree-numba profiles`
# ---------------------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    if n >= 10**9 and n % 10**9 == 0:
        return f"{n // 10**9} GB"
    if n % MIB == 0:
        return f"{n // MIB} MiB"
    if n % KIB == 0:
        return f"{n // KIB} KiB ({n} B)"
    return f"{n} B"


def _fmt_rate(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value / 1e12:g} {unit}"


_TABLE_ROWS: tuple[tuple[str, Callable[[DeviceProfile], str]], ...] = (
    ("device", lambda p: p.device_name),
    ("arch", lambda p: p.arch),
    ("SMs", lambda p: str(p.sm_count)),
    ("threads / block", lambda p: str(p.max_threads_per_block)),
    ("threads / SM", lambda p: str(p.max_threads_per_sm)),
    ("warp size", lambda p: str(p.warp_size)),
    ("registers / block", lambda p: str(p.regs_per_block)),
    ("registers / SM", lambda p: str(p.regs_per_sm)),
    ("registers / thread", lambda p: str(p.max_regs_per_thread)),
    ("smem / block (default)", lambda p: _fmt_bytes(p.smem_per_block_default)),
    ("smem / block (opt-in)", lambda p: _fmt_bytes(p.smem_per_block_optin)),
    ("smem / SM", lambda p: _fmt_bytes(p.smem_per_sm)),
    ("reserved smem / block", lambda p: _fmt_bytes(p.reserved_smem_per_block)),
    ("L2", lambda p: _fmt_bytes(p.l2_bytes)),
    ("DRAM", lambda p: _fmt_bytes(p.hbm_bytes)),
    ("DRAM bandwidth (spec)", lambda p: _fmt_rate(p.hbm_bandwidth_spec, "TB/s")),
    ("DRAM bandwidth (measured)", lambda p: _fmt_rate(p.hbm_bandwidth_measured, "TB/s")),
    ("FP32 peak", lambda p: _fmt_rate(p.fp32_peak, "TFLOP/s")),
    ("bf16 TC dense (spec)", lambda p: _fmt_rate(p.bf16_tensor_peak, "TFLOP/s")),
    ("bf16 TC (measured)", lambda p: _fmt_rate(p.bf16_tensor_measured, "TFLOP/s")),
)


def format_profiles_table(profiles: Mapping[str, DeviceProfile] | None = None) -> str:
    """Fixed-width table of the profiles (default: all stored ones), then their sources."""
    chosen = list((profiles or PROFILES).values())
    header = ["profile"] + [p.name for p in chosen]
    rows = [header] + [[label] + [fmt(p) for p in chosen] for label, fmt in _TABLE_ROWS]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    for p in chosen:
        lines.append(f"{p.name}: {p.clock_notes}")
        lines.append(f"{p.name} sources: {p.source}")
    return "\n".join(lines)
