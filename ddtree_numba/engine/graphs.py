"""Capture a decode step once as a CUDA graph, replay it per step (limits §4, stack §4).

A step of the engine (an AR step, a DDTree round) is a Python function that only enqueues kernels
on the stream it is given: every per-step value lives in device buffers allocated before the loop,
every shape and grid is fixed, and no wrapper copies to the host. Such a function can be captured:
numba-cuda 0.30.4 launches on a ``cuda.core`` GraphBuilder given as the stream (stack §4; the
pattern of ``ddtree_numba.bench.tree_build.time_graph``), so the host-side work of a step (the
wrappers' checks, ~20-30 µs of numba launch overhead per kernel, limits §4, §8) happens once at
capture and each replay costs ~1-3 µs per kernel.

:class:`StepGraph` holds one such function:

1. :meth:`StepGraph.warm_up` runs it eagerly once (compiles and loads every kernel, runs every
   host check; a capture must not trigger either);
2. :meth:`StepGraph.capture` records it into a graph (nothing executes) under
   ``thread_local`` capture mode, with numba's deallocations deferred (a ``cuMemFree`` would be
   an unsafe call). CUDA rejects unsafe calls on the capturing stream, but NOT a synchronous copy
   on the legacy default stream (on the H200 a ``copy_to_host()`` inside the step was neither
   rejected nor recorded): the engine's steps never copy to the host, and the no-allocation tests
   check that, so keep step functions free of host copies;
3. :meth:`StepGraph.replay` launches the graph on the stream (capturing first if needed).

Under the numba-cuda simulator (no graphs) or with ``enabled=False``, :meth:`replay` just calls
the function on the stream each time: the same code path minus the capture.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sim.install import simulator_active

__all__ = ["CAPTURE_MODES", "GraphCaptureError", "StepGraph", "core_stream"]

CAPTURE_MODES = ("global", "thread_local", "relaxed")  # cuda.core GraphBuilder.begin_building modes
DEFAULT_CAPTURE_MODE = "thread_local"  # unsafe calls of this thread fail the capture


class GraphCaptureError(RuntimeError):
    """A step could not be captured (the cause is chained); nothing was executed by the capture."""


def core_stream(stream: Any) -> Any:
    """``stream`` as a ``cuda.core`` Stream (what ``Graph.launch`` takes).

    Args:
        stream: 0 / None (the legacy default stream), a numba stream, or a cuda.core Stream.

    Raises:
        TypeError: a GraphBuilder (replays go on a stream) or something that is not a stream.
    """
    from cuda.core import Stream

    if isinstance(stream, Stream):
        return stream
    if stream is None or (isinstance(stream, int) and not isinstance(stream, bool) and stream == 0):
        return Stream.from_handle(0)
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is None:
        raise TypeError(f"stream must be 0, a numba stream or a cuda.core Stream, got {type(stream).__name__}")
    return Stream.from_handle(int(protocol()[1]))


class StepGraph:
    """One step function, captured once after a warm-up call and replayed on ``stream``.

    Args:
        fn: ``fn(stream)`` enqueues the step on ``stream`` (0, a numba stream, a cuda.core Stream
            or, during capture, a GraphBuilder) and does nothing else: no host copy, no sync, no
            allocation, no per-step Python state (a replay does not run Python). Extra positional
            arguments of :meth:`warm_up` are passed after the stream (e.g. a stage clock that the
            captured call does not get).
        stream: the stream eager calls and replays go on (0, a numba stream or a cuda.core Stream).
        enabled: False: never capture (every :meth:`replay` calls ``fn`` eagerly).
        mode: cuda.core capture mode, one of CAPTURE_MODES.

    Use as a context manager, or call :meth:`close`, to free the graph.
    """

    def __init__(self, fn: Callable[..., None], stream: Any = 0, *, enabled: bool = True,
                 mode: str = DEFAULT_CAPTURE_MODE) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        if mode not in CAPTURE_MODES:
            raise ValueError(f"mode must be one of {CAPTURE_MODES}, got {mode!r}")
        self.fn = fn
        self.stream = stream
        self.mode = mode
        self.uses_graph = enabled and not simulator_active()
        self.warm = False
        self._graph: Any = None
        self._replay_stream: Any = None
        self.replays = 0

    @property
    def captured(self) -> bool:
        """Whether a graph has been captured (and not closed)."""
        return self._graph is not None

    def warm_up(self, *args: Any) -> None:
        """Run ``fn(stream, *args)`` eagerly (the call every capture must follow)."""
        self.fn(self.stream, *args)
        self.warm = True

    def capture(self) -> None:
        """Record ``fn`` into a CUDA graph (no-op without graphs or when already captured).

        Raises:
            RuntimeError: no warm-up call yet.
            GraphCaptureError: the capture failed (the cause is chained; nothing ran).
        """
        if not self.uses_graph or self._graph is not None:
            return
        if not self.warm:
            raise RuntimeError("StepGraph.capture: call warm_up first (kernels must be compiled and loaded, "
                               "host checks run, before a capture)")
        from cuda.core import Device
        from numba import cuda

        device = Device()
        device.set_current()
        builder = device.create_graph_builder()
        try:
            with cuda.defer_cleanup():  # no cuMemFree of collected numba arrays inside the capture
                builder.begin_building(self.mode)
                try:
                    self.fn(builder)
                finally:  # end the capture even when a launch failed, so later work is not captured
                    builder.end_building()
            graph = builder.complete()
        except Exception as exc:
            raise GraphCaptureError(f"capturing {getattr(self.fn, '__qualname__', self.fn)!r} failed: "
                                    f"{type(exc).__name__}: {exc}") from exc
        finally:
            builder.close()
        self._replay_stream = core_stream(self.stream)
        graph.upload(self._replay_stream)
        self._graph = graph

    def replay(self) -> None:
        """One step: a graph launch on ``stream`` (captured on first use), or an eager call."""
        if not self.uses_graph:
            self.fn(self.stream)
            self.replays += 1
            return
        self.capture()
        self._graph.launch(self._replay_stream)
        self.replays += 1

    def __call__(self) -> None:
        """The first call warms up, later calls replay."""
        if self.warm:
            self.replay()
        else:
            self.warm_up()

    def close(self) -> None:
        """Free the graph (idempotent); a later :meth:`replay` captures again."""
        if self._graph is not None:
            self._graph.close()
            self._graph = None

    def __enter__(self) -> StepGraph:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
