"""Install the simulator extensions (warp intrinsics, launch check, thread-safe shared arrays, an
event-driven block scheduler, plain NumPy arrays inside kernels) when the simulator is on."""
from __future__ import annotations

_installed = False


def simulator_active() -> bool:
    """True when ``numba.cuda`` is the CPU simulator (imports numba.cuda)."""
    from numba import cuda

    return bool(cuda.config.ENABLE_CUDASIM)


def install() -> bool:
    """Install the extensions once if the simulator is active; return whether they are on.

    On a real GPU this is a no-op: the hardware has the intrinsics and enforces its limits.
    """
    global _installed
    if _installed:
        return True
    if not simulator_active():
        return False
    from . import fastpaths, launch, scheduler, shared, warp

    warp.install()
    shared.install()
    scheduler.install()
    fastpaths.install()
    launch.install_simulator_hook()
    _installed = True
    return True
