"""ddtree-numba: DDTree speculative decoding with the whole round on the GPU, in Numba CUDA.

Importing the package installs the simulator extensions (warp intrinsics, launch check) when
numba-cuda runs its CPU simulator (``NUMBA_ENABLE_CUDASIM=1``); on a GPU it changes nothing.
"""
from sim.install import install as _install_simulator_extensions

__version__ = "0.1.0"

_install_simulator_extensions()
