"""Measured memory: peak bytes of a piece of work, and what autograd saves for backward.

Two sources of truth, one interface:

* On CUDA, the caching allocator's counters: ``torch.cuda.max_memory_allocated``
  after ``torch.cuda.reset_peak_memory_stats`` (bytes handed to tensors, block
  rounding included; not the larger "reserved" pool that ``nvidia-smi`` shows).
* Elsewhere (CPU, MPS), :class:`LiveTensorTracker`, a ``TorchDispatchMode`` that
  sees every aten op, records each new tensor storage with its exact
  ``nbytes()``, and subtracts it when the storage is freed (a weak reference to
  the storage fires). It is exact to the byte for tensor storage and counts
  nothing else (no allocator rounding, no workspaces). PyTorch's own
  ``torch.distributed._tools.mem_tracker.MemTracker`` uses the same technique.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages created while it is active, live and at peak.

    ``with LiveTensorTracker() as t: work()`` then ``t.peak`` (bytes) and
    ``t.live`` (bytes still alive, e.g. gradients). Storages created before the
    ``with`` are not counted, and freeing them does not lower the count: the
    figures are "above what was live when it started", the allocations of the
    work itself. Views share their base's storage and are counted once.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages = WeakIdKeyDictionary()
        self._refs: list = []

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage in self._storages:
            return
        nbytes = storage.nbytes()
        self._storages[storage] = nbytes
        self._refs.append(weakref.finalize(storage, self._free, nbytes))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out

    def __exit__(self, *exc):
        # Frees that happen after the block no longer concern this measurement.
        for ref in self._refs:
            ref.detach()
        self._refs.clear()
        return super().__exit__(*exc)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def peak_memory(fn: Callable[[], object], *, device: str | torch.device | None = None) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was live when it started.

    ``device``: "cuda" reads the CUDA allocator, "cpu" or "mps" uses
    :class:`LiveTensorTracker`; None (default) reads the allocator if the work
    allocated anything on CUDA, else the tracker. The tracker and the allocator
    agree on tensor bytes; the allocator adds its 512-byte block rounding and any
    library workspaces (cuBLAS), which are real memory on the GPU.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable with no arguments, got {fn!r}")
    kind = None if device is None else torch.device(device).type
    if kind not in (None, "cuda", "cpu", "mps"):
        raise ValueError(f"device must be 'cuda', 'cpu', 'mps' or None, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but this machine has no CUDA device")
    use_cuda = kind == "cuda" or (kind is None and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    tracker = LiveTensorTracker()
    if use_cuda and kind == "cuda":
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with tracker:
        fn()
    if use_cuda:
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated() - start
        if cuda_peak > 0:
            return cuda_peak
    return tracker.peak


@dataclass(frozen=True)
class SavedTensor:
    """One tensor an autograd node keeps for the backward pass."""

    node: str        # the backward node, e.g. "AddmmBackward0"
    name: str        # its attribute, e.g. "mat1"
    shape: tuple
    dtype: torch.dtype
    nbytes: int      # bytes of the whole storage it lives in
    is_parameter: bool
    storage_id: int  # equal for tensors that share a storage

    @property
    def op(self) -> str:
        """The forward op, read off the node name: "AddmmBackward0" -> "addmm"."""
        return self.node.removesuffix("0").removesuffix("Backward").lower()


def saved_tensors(output: torch.Tensor, params=()) -> list[SavedTensor]:
    """What autograd keeps alive for ``output.backward()``: one row per saved tensor.

    Walks the graph from ``output.grad_fn`` and reads each node's ``_saved_*``
    attributes (PyTorch exposes them for introspection). ``params`` (e.g.
    ``model.parameters()``) marks saved tensors that are parameters: those cost
    no extra memory. Tensors shared by several nodes appear once per node; sum
    unique ``storage_id`` s (:func:`saved_bytes`) for the memory.
    Tensors saved inside a non-reentrant checkpoint region are not listed: the
    region keeps its inputs and recomputes the rest.
    """
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        raise ValueError("output must be a tensor that requires grad (has a grad_fn)")
    param_storages = {p.untyped_storage().data_ptr() for p in params if p.device.type != "meta"}
    rows, seen_nodes, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for attr in sorted(dir(node)):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # already freed by a backward pass
                continue
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, torch.Tensor) and item.device.type != "meta":
                    storage = item.untyped_storage()
                    rows.append(SavedTensor(
                        node=type(node).__name__, name=attr.removeprefix("_saved_"),
                        shape=tuple(item.shape), dtype=item.dtype, nbytes=storage.nbytes(),
                        is_parameter=storage.data_ptr() in param_storages,
                        storage_id=storage.data_ptr()))
        stack.extend(fn for fn, _ in node.next_functions)
    return rows


def saved_bytes(output: torch.Tensor, params=(), *, include_parameters: bool = False) -> int:
    """Bytes of the distinct storages autograd saves for ``output`` (parameters excluded by default)."""
    unique = {}
    for row in saved_tensors(output, params):
        if include_parameters or not row.is_parameter:
            unique[row.storage_id] = row.nbytes
    return sum(unique.values())
