"""Test set-up: the simulator is turned on before numba.cuda is imported where no GPU is found."""
import os
import sys

# Must happen before anything imports numba.cuda (NUMBA_ENABLE_CUDASIM is read at import).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sim.detect import enable_simulator_if_no_gpu  # noqa: E402

SIMULATED = enable_simulator_if_no_gpu()
if SIMULATED:
    # Simulated CUDA threads are Python threads blocking at barriers: switch seldom (why and the
    # measurements: sim/scheduler.py's SWITCH_INTERVAL_S).
    from sim.scheduler import SWITCH_INTERVAL_S

    sys.setswitchinterval(SWITCH_INTERVAL_S)

import pytest  # noqa: E402

import ddtree_numba  # noqa: E402,F401  (installs the simulator extensions)


def pytest_collection_modifyitems(config, items):
    if not SIMULATED:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (running under the numba-cuda simulator)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_report_header(config):
    return f"ddtree-numba: {'CUDA simulator (no GPU found)' if SIMULATED else 'real CUDA GPU'}"
