"""Numba CUDA kernels. Each module registers its kernels with :mod:`.registry` so that the
sm_90 / sm_120 compile check (``ddtree-numba compile-check``) sees every one of them."""
