"""Helpers of the tests that compile kernels in a process without the simulator (not a test module)."""
import os

import pytest


def compiler_available() -> bool:
    """Whether NVVM, NVRTC and nvJitLink can be loaded (they come with the cuda wheels)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        for lib in ("nvvm", "nvrtc", "nvJitLink"):
            load_nvidia_dynamic_lib(lib)
    except Exception:
        return False
    return True


needs_compiler = pytest.mark.skipif(not compiler_available(), reason="NVVM / NVRTC / nvJitLink not found")


def no_sim_env() -> dict[str, str]:
    """This process's environment with the simulator explicitly off."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_ENABLE_CUDASIM"] = "0"  # explicit, so nothing turns the simulator on
    return env
