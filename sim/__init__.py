"""A CPU standing in for the target GPU.

- :mod:`sim.detect`: is there a real GPU? (decided before ``numba.cuda`` is imported)
- :mod:`sim.warp`: warp intrinsics for the numba-cuda simulator, which lacks them
- :mod:`sim.profiles`: device profiles (H200 sm_90, RTX PRO 6000 Blackwell sm_120), roofline
- :mod:`sim.launch`: launch-configuration check against a profile, in the simulator too
- :mod:`sim.compile_check`: compile every kernel for sm_90 / sm_120 without a GPU

:func:`sim.install.install` wires the simulator extensions in; ``import ddtree_numba`` calls
it, so any program that runs the package under ``NUMBA_ENABLE_CUDASIM=1`` gets them.
"""
from .detect import enable_simulator_if_no_gpu, gpu_available, simulator_requested

__all__ = ["enable_simulator_if_no_gpu", "gpu_available", "simulator_requested"]
