"""Replay a program's call as CUDA graphs: one launch instead of many Python-issued ones.

A graph bakes in the addresses it was captured with, so calls are cached by their tensors'
addresses, shapes and dtypes. The very first call runs eagerly: cuBLAS, flash attention and
friends create handles and workspaces on first use, which a capture forbids. Inside a caller's own
capture (a model captured whole, with the program's call in it) the call is simply issued, so it
is recorded into the caller's graph: captures cannot nest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class CallGraphs:
    """`graphs(call, tensors)`: run `call()` eagerly once, then capture it once per set of
    `tensors` (a capture records, runs nothing) and replay; keeps the newest `capacity` graphs."""

    def __init__(self, capacity: int = 32):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._warm = False

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, call: Callable[[], None], tensors: Iterable[torch.Tensor]) -> None:
        if self._warm and torch.cuda.is_current_stream_capturing():
            call()
            return
        if not self._warm:
            self._warm = True
            call()
            return
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)
        graph = self._graphs.get(key)
        if graph is None:
            if len(self._graphs) >= self.capacity:
                self._graphs.pop(next(iter(self._graphs)))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                call()
            self._graphs[key] = graph
        graph.replay()
