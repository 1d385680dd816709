"""Measured memory: peak bytes of a piece of work, what autograd saves, and where a step's bytes go.

Two sources of truth, one interface:

* On CUDA, ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``
  (bytes handed to tensors, block rounding included; not the "reserved" pool).
* Elsewhere (CPU, MPS), :class:`LiveTensorTracker`, a ``TorchDispatchMode`` that records each
  new storage's ``nbytes()`` and subtracts it when the storage is freed: exact for tensor
  storage, nothing else (as PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker``).

:func:`step_breakdown` runs one training step on the tracker and sorts every byte into
parameters, gradients, optimizer state, activations (what autograd saved) and transient bytes.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig, check_batch, check_config
from course_lib.units import MEMORY_CATEGORIES, as_dtype, storage_bytes, storage_key
from course_lib.validation import (
    WrongTypeError,
    device as as_device,
    fields,
    function,
    integer,
    positive_int,
)

# Ops whose tensor argument is a storage made outside the dispatcher (``torch.tensor([...])``
# builds it in C++ then "lifts" it): their output is a new allocation, not a foreign tensor.
_LIFT_OPS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class _Storage:
    """What the tracker knows about one storage it counted."""

    __slots__ = ("index", "nbytes", "born", "died", "phase", "died_phase")

    def __init__(self, index: int, nbytes: int, born: int, phase: str):
        self.index, self.nbytes, self.born, self.phase = index, nbytes, born, phase
        self.died, self.died_phase = None, None


class LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages created while it is active, live and at peak.

    ``with LiveTensorTracker() as t: work()`` then ``t.peak`` (bytes) and
    ``t.live`` (bytes still alive, e.g. gradients). Storages created before the
    ``with`` are "foreign": they are not counted, nor are views of them or the
    results of in-place ops on them (``param.mul_(0.9)`` allocates nothing), and
    freeing them does not lower the count. The figures are therefore the
    allocations of the work itself, "above what was live when it started".
    Views share their base's storage and are counted once; a storage that an op
    resizes (``out=`` arguments, ``resize_``) is recounted at its new size.

    Every allocation and free is also an event numbered in order (``t.clock``);
    ``t.storages`` keeps, per counted storage, its size, birth and death, and the
    ``t.phase`` label current at each (for timelines).
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.clock = 0
        self.phase = ""
        self.storages: list[_Storage] = []
        self._ours = WeakIdKeyDictionary()     # storage -> _Storage
        self._foreign = WeakIdKeyDictionary()  # storage -> True
        self._refs: list = []

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _free(self, record: _Storage) -> None:
        self.live -= record.nbytes
        record.died, record.died_phase = self._tick(), self.phase

    def _see_input(self, tensor: torch.Tensor) -> None:
        storage = _storage_of(tensor)
        if storage is not None and storage not in self._ours:
            self._foreign[storage] = True

    def _track(self, tensor: torch.Tensor) -> None:
        storage = _storage_of(tensor)
        if storage is None or storage in self._foreign:
            return
        nbytes = storage.nbytes()
        record = self._ours.get(storage)
        if record is None:
            record = _Storage(len(self.storages), nbytes, self._tick(), self.phase)
            self.storages.append(record)
            self._ours[storage] = record
            self._refs.append(weakref.finalize(storage, self._free, record))
            self.live += nbytes
        elif record.nbytes != nbytes:  # resized in place
            self.live += nbytes - record.nbytes
            record.nbytes = nbytes
            self._tick()
        self.peak = max(self.peak, self.live)

    def record_of(self, tensor: torch.Tensor) -> _Storage | None:
        """The record of the storage ``tensor`` lives in, if this tracker counted it.

        Args:
            tensor (torch.Tensor): any tensor.

        Returns:
            The storage's record (its size in bytes, birth, death and phases), or None for a
            foreign storage (made before the tracker started) or a tensor without a storage.
        """
        storage = _storage_of(tensor)
        return None if storage is None else self._ours.get(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _LIFT_OPS:
            for item in tree_flatten((args, kwargs))[0]:
                if isinstance(item, torch.Tensor):
                    self._see_input(item)
        out = func(*args, **kwargs)
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


def _storage_of(tensor: torch.Tensor):
    if tensor.device.type == "meta":
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


def _device_kind(device) -> str | None:
    if device is None:
        return None
    try:
        kind = torch.device(device).type if isinstance(device, str | torch.device) else None
    except (RuntimeError, TypeError, ValueError):
        kind = None
    if kind not in ("cuda", "cpu", "mps"):
        raise ValueError(f"device must be 'cuda', 'cpu', 'mps' or None, got {device!r}")
    return kind


def peak_memory(fn: Callable[[], object], *, device: str | torch.device | None = None) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was live when it started.

    The tracker and the allocator agree on tensor bytes; the allocator adds its 512-byte block
    rounding and any library workspaces (cuBLAS), which are real memory on the GPU. One
    difference of definition: the allocator's figure drops when ``fn`` frees memory that was
    live before it started; the tracker ignores such frees (it counts the work's own
    allocations), so for work that frees old tensors it reads higher.

    Args:
        fn (callable): the work, called with no arguments.
        device (str or torch.device, optional): "cuda" reads the CUDA allocator
            (``torch.cuda.max_memory_allocated``), "cpu" or "mps" uses
            :class:`LiveTensorTracker`; None (default) reads the allocator if the work
            allocated anything on CUDA, else the tracker.

    Returns:
        int: bytes.

    Raises:
        ValueError: naming ``fn`` (not callable) or ``device`` (not cuda, cpu, mps or None), or
            for ``device="cuda"`` or ``"mps"`` on a machine without it.

    Example:
        >>> peak_memory(lambda: torch.zeros(1024, 1024), device="cpu")  # 4 MiB of fp32
        4194304
    """
    if not callable(fn):
        raise WrongTypeError(f"fn must be callable with no arguments, got {fn!r}")
    kind = _device_kind(device)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but this machine has no CUDA device")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device='mps' but this machine has no MPS device")
    use_cuda = kind == "cuda" or (kind is None and torch.cuda.is_available())
    if use_cuda:
        # Garbage of earlier work (reference cycles) would otherwise be collected during fn:
        # the allocator's figure would drop below fn's own peak (on an H200 the engine then
        # looked 12-27 % high).
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    if kind == "cuda":
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    tracker = LiveTensorTracker()
    with tracker:
        fn()
    if use_cuda:
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated() - start
        if cuda_peak > 0:
            return cuda_peak
    return tracker.peak


# --------------------------------------------------------------------------- saved tensors

@dataclass(frozen=True)
class SavedTensor:
    """One tensor an autograd node keeps for the backward pass."""

    node: str
    name: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    is_parameter: bool
    storage_id: int

    @property
    def op(self) -> str:
        """The forward op, read off the node name: "AddmmBackward0" -> "addmm"."""
        return self.node.removesuffix("0").removesuffix("Backward").lower()


def _packed_by_hooks(raw) -> bool:
    """True if ``saved_tensors_hooks`` packed a saved tensor into a non-tensor (a checkpoint
    placeholder, an offload handle): reading it would run the unpack hook, so it is left alone."""
    items = raw if isinstance(raw, list | tuple) else (raw,)
    return any(getattr(item, "unpack_hook", None) is not None
               and not isinstance(item.data, torch.Tensor) for item in items)


def _saved_values(node):
    """``(name, value)`` of what ``node`` saved: ``_saved_*`` of built-in nodes,
    ``saved_tensors`` of custom ``autograd.Function`` s (e.g. reentrant checkpointing)."""
    for attr in sorted(dir(node)):
        if attr.startswith("_saved_"):
            name = attr.removeprefix("_saved_")
            if _packed_by_hooks(getattr(node, f"_raw_saved_{name}", None)):
                continue
            try:
                yield name, getattr(node, attr)
            except RuntimeError:  # already freed by a backward pass
                continue
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        try:
            yield "saved_tensors", node.saved_tensors
        except RuntimeError:
            pass


def saved_tensors(output: torch.Tensor, params=()) -> list[SavedTensor]:
    """What autograd keeps alive for ``output.backward()``: one row per saved tensor.

    Walks the graph from ``output.grad_fn`` and reads each node's ``_saved_*``
    attributes (PyTorch exposes them for introspection; custom functions expose
    ``saved_tensors``). Tensors shared by several nodes appear once per node; sum unique
    ``storage_id`` s (:func:`saved_bytes`) for the memory. Tensors saved through
    ``saved_tensors_hooks`` are not listed and not unpacked: inside a non-reentrant
    checkpoint region they are placeholders, and unpacking one would recompute the
    region (the region's inputs, which it does keep, are held by the checkpoint
    itself; ``course_lib.training.checkpointing.measure_kept_bytes`` measures them). After
    ``backward()`` the graph has let go of its tensors and nothing is listed.

    Args:
        output (torch.Tensor): a tensor with a ``grad_fn`` (the loss).
        params (iterable of torch.Tensor): tensors to mark as parameters (e.g.
            ``model.parameters()``): those cost no extra memory.

    Returns:
        list of SavedTensor: one row per saved tensor per node.

    Raises:
        ValueError: naming ``output``, for a non-tensor or a tensor without a ``grad_fn``;
            for ``params`` holding something without a storage.
    """
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        raise ValueError("output must be a tensor that requires grad (has a grad_fn)")
    try:
        params = list(params) if not isinstance(params, torch.Tensor | str) else None
    except TypeError:
        params = None
    if params is None or not all(isinstance(p, torch.Tensor) for p in params):
        raise ValueError("params must be an iterable of tensors (model.parameters())")
    param_storages = {storage_key(p) for p in params}
    rows, seen_nodes, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for name, value in _saved_values(node):
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, torch.Tensor):
                    key = storage_key(item)
                    rows.append(SavedTensor(
                        node=type(node).__name__, name=name,
                        shape=tuple(item.shape), dtype=item.dtype,
                        nbytes=item.untyped_storage().nbytes(),
                        is_parameter=key in param_storages, storage_id=key))
        stack.extend(fn for fn, _ in node.next_functions)
    return rows


def saved_bytes(output: torch.Tensor, params=(), *, include_parameters: bool = False) -> int:
    """Bytes of the distinct storages autograd saves for ``output`` (parameters excluded by default).

    A storage shared by several saved tensors (views, or one tensor saved by two
    nodes) counts once, at its full ``nbytes``: that is the memory it holds.

    Args:
        output (torch.Tensor): a tensor with a ``grad_fn`` (the loss).
        params (iterable of torch.Tensor): the parameters, whose storages are left out.
        include_parameters (bool): count the parameters' storages too.

    Returns:
        int: bytes.

    Raises:
        ValueError: naming ``include_parameters`` (not a bool) or ``output`` (no ``grad_fn``).

    Example:
        >>> from course_lib.model.gpt import GPT, random_tokens
        >>> model = GPT(GPTConfig())
        >>> logits, loss = model(*random_tokens(GPTConfig(), 2))
        >>> saved_bytes(loss, model.parameters())
        1256964
    """
    if not isinstance(include_parameters, bool):
        raise WrongTypeError(f"include_parameters must be True or False, got {include_parameters!r}")
    unique = {}
    for row in saved_tensors(output, params):
        if include_parameters or not row.is_parameter:
            unique[row.storage_id] = row.nbytes
    return sum(unique.values())


#: The backward node of each fused kernel of ``F.scaled_dot_product_attention``, as the graph
#: names it; the math kernel has none of its own (it is written with ``bmm`` and ``softmax``).
SDPA_NODES = {"ScaledDotProductFlashAttentionForCpuBackward0": "flash",
              "ScaledDotProductFlashAttentionBackward0": "flash",
              "ScaledDotProductEfficientAttentionBackward0": "efficient",
              "ScaledDotProductCudnnAttentionBackward0": "cudnn"}


@dataclass(frozen=True)
class AttentionSaved:
    """What one call of ``F.scaled_dot_product_attention`` kept for backward
    (:func:`sdpa_saved`)."""

    kernel: str
    saved_bytes: int
    square_bytes: int
    tensors: tuple


def _sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend

    return {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _kernel_that_ran(output: torch.Tensor) -> str:
    stack, seen = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in SDPA_NODES:
            return SDPA_NODES[type(node).__name__]
        stack += [next_node for next_node, _ in node.next_functions]
    return "math"


def sdpa_saved(config: GPTConfig, batch_size: int, dtype=torch.float32, *, kernel: str | None = None,
               device: str | torch.device = "cpu", seed: int = 0) -> AttentionSaved:
    """Measure what one attention call keeps for backward, and which SDPA kernel ran.

    Builds q, k, v as the course GPT does (head views of one ``(b, s, 3h)`` QKV tensor that
    requires grad), calls ``F.scaled_dot_product_attention(q, k, v, dropout_p=config.dropout,
    is_causal=True)``, under ``torch.nn.attention.sdpa_kernel`` when ``kernel`` forces one, and
    reads the saved tensors off the graph (:func:`saved_tensors`). The math kernel keeps the
    ``b*a*s*s`` probabilities; the fused ones (FlashAttention, Dao et al. 2022) their output and
    a per-row log-sum-exp, from which their backward rebuilds the probabilities.
    :func:`course_lib.prediction.activations.attention_core_saved` predicts it.

    Args:
        config (GPTConfig): the shape (``d_model``, ``n_heads``, ``seq_len``, ``dropout``).
        batch_size (int): sequences, a positive int; the QKV tensor holds at most
            :data:`course_lib.model.kernels.MAX_DETECT_ELEMENTS` elements, and so do the math kernel's
            ``b*a*s*s`` probabilities.
        dtype (torch.dtype or str): fp32, fp16 or bf16.
        kernel (str, optional): one of :data:`course_lib.model.kernels.SDPA_KERNELS` to force; None:
            PyTorch's choice (:func:`course_lib.model.kernels.sdpa_kernel` predicts it).
        device (str or torch.device): where it runs.
        seed (int): seeds q, k and v, an int from 0 to 2**63 - 1.

    Returns:
        AttentionSaved: the kernel that ran, the bytes it keeps, the saved tensors.

    Raises:
        ValueError: naming the argument, for a bad value, too large a call, or a ``kernel`` that
            cannot run here (the CPU has no memory-efficient or cuDNN kernel, a T4 no bf16 flash:
            :func:`course_lib.model.kernels.forced_kernel`, the rule the prediction follows).
    """
    check_config(config)
    b = positive_int("batch_size", batch_size, maximum=kernels.MAX_DETECT_ELEMENTS)
    dtype = as_dtype(dtype)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    device = as_device("device", device)
    if device.type in ("cpu", "cuda"):  # the rule the prediction follows, where it has one
        kernels.forced_kernel(kernel, config, dtype, None if device.type == "cpu" else "cuda")
    elif kernel is not None and kernel not in kernels.SDPA_KERNELS:
        raise ValueError(f"kernel must be one of {kernels.SDPA_KERNELS} or None, got {kernel!r}")
    seed = integer("seed", seed, minimum=0, maximum=2**63 - 1)
    s, h, a = config.seq_len, config.d_model, config.n_heads
    if max(b * s * 3 * h, b * a * s * s) > kernels.MAX_DETECT_ELEMENTS:
        raise ValueError(f"batch_size={b} makes too large a call for this measurement: at most "
                         f"{kernels.MAX_DETECT_ELEMENTS:,} elements in q, k, v and in b*a*s*s")
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, 3 * h, generator=generator).to(device=device, dtype=dtype)
    q, k, v = (t.view(b, s, a, h // a).transpose(1, 2) for t in qkv.requires_grad_().split(h, 2))
    forced = (contextlib.nullcontext() if kernel is None
              else torch.nn.attention.sdpa_kernel(_sdpa_backends()[kernel]))
    try:
        with forced, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # why each kernel was refused: the error says it
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=config.dropout, is_causal=True)
    except RuntimeError as exc:
        raise ValueError(f"kernel={kernel!r} does not run here ({device}, {dtype}, head size "
                         f"{h // a}, dropout {config.dropout}): {str(exc)[:120]}") from exc
    rows = tuple(saved_tensors(out))
    squares = {r.storage_id: r.nbytes for r in rows if r.shape[-2:] == (s, s)}
    return AttentionSaved(_kernel_that_ran(out), saved_bytes(out), sum(squares.values()), rows)


def saved_table(output: torch.Tensor, params=(), *, parameters: bool = False) -> str:
    """:func:`saved_tensors` as a text table, in forward order, one row per saved tensor.

    Columns: the backward node that keeps it (``Backward0`` dropped), its slot as PyTorch names
    it, shape, dtype, the bytes of its storage, and a letter per storage (A, B, ... in order of
    first appearance): two rows with one letter are one piece of memory, kept once. Lecture 02
    reads it aloud.

    Args:
        output (torch.Tensor): a tensor with a ``grad_fn`` (the loss).
        params (iterable of torch.Tensor): the parameters.
        parameters (bool): list the rows that hold a parameter too (letter ``param``).

    Returns:
        str: a header line, then one line per row.

    Raises:
        ValueError: as :func:`saved_tensors`, or naming ``parameters`` (not a bool).
    """
    if not isinstance(parameters, bool):
        raise WrongTypeError(f"parameters must be True or False, got {parameters!r}")
    rows = [r for r in reversed(saved_tensors(output, params)) if parameters or not r.is_parameter]
    letters: dict[int, str] = {}

    def letter(row: SavedTensor) -> str:
        if row.is_parameter:
            return "param"
        n = letters.setdefault(row.storage_id, len(letters))
        return chr(65 + n % 26) + (str(n // 26) if n >= 26 else "")

    cells = [(r.node.removesuffix("0").removesuffix("Backward"), r.name, str(r.shape),
              str(r.dtype).removeprefix("torch."), f"{r.nbytes:,d}", letter(r)) for r in rows]
    head = ("kept by", "slot", "shape", "dtype", "bytes", "storage")
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(6)]
    return "\n".join(f"{c[0]:{widths[0]}s}  {c[1]:{widths[1]}s}  {c[2]:{widths[2]}s}  "
                     f"{c[3]:{widths[3]}s}  {c[4]:>{widths[4]}s}  {c[5]}" for c in [head, *cells])


# --------------------------------------------------------------------------- one training step

#: What a step's bytes are (:data:`course_lib.units.MEMORY_CATEGORIES` in stacking order, but
#: master weights: they are filed with the optimizer state, as the ZeRO paper counts them), the
#: vocabulary of :class:`StepBreakdown`, and the step's phases.
CATEGORIES = tuple(name for name in MEMORY_CATEGORIES if name != "master_weights")
PHASES = ("forward", "backward", "optimizer")


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  inputs: torch.Tensor, targets: torch.Tensor, *,
                  on_phase: Callable[[str, torch.Tensor | None], None] | None = None) -> float:
    """The course's canonical step: forward, backward, ``optimizer.step()``, ``zero_grad``.

    Forward to the loss, ``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad(set_to_none=True)``. Keeps only the loss (a model may return ``(logits, loss)``, as the course GPT does).

    Args:
        model (torch.nn.Module): called as ``model(inputs, targets)``.
        optimizer (torch.optim.Optimizer): steps the model's parameters.
        inputs (torch.Tensor): the batch's inputs.
        targets (torch.Tensor): the batch's targets.
        on_phase (callable, optional): ``on_phase(name, loss)``, called as each of
            :data:`PHASES` begins (``loss`` is None before the forward pass) and with
            ``"zero_grad"`` after the optimizer step: :func:`step_breakdown` uses it to label
            its timeline.

    Returns:
        float: the loss's value.

    Raises:
        ValueError: naming ``model``, ``optimizer``, ``inputs``, ``targets`` or ``on_phase``, for
            a value of the wrong kind or a batch the model cannot train on
            (:func:`course_lib.model.gpt.check_batch`).
    """
    if not isinstance(model, torch.nn.Module):
        raise WrongTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise WrongTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_batch(model, inputs, targets)
    hook = function("on_phase", on_phase, optional=True) or (lambda name, loss: None)
    hook("forward", None)
    out = model(inputs, targets)
    loss = out[1] if isinstance(out, tuple) else out
    del out
    hook("backward", loss)
    loss.backward()
    hook("optimizer", loss)
    optimizer.step()
    hook("zero_grad", loss)
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def resident_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes that stay on the model's device between steps, each storage once.

    Parameters, master weights (an optimizer with a ``master`` list) and optimizer state.

    On CUDA each storage counts as the caching allocator holds it (rounded up to 512 bytes),
    and AdamW's ``step`` counters, which live on the host there, are left out.

    Args:
        model (torch.nn.Module): a model with at least one parameter; its first parameter's
            device is the device counted.
        optimizer (torch.optim.Optimizer): its optimizer.

    Returns:
        int: bytes.

    Raises:
        ValueError: ``model`` is not a ``torch.nn.Module`` with a parameter, or ``optimizer`` is
            not a ``torch.optim.Optimizer``.
    """
    from course_lib.model.kernels import CUDA_BLOCK

    if not isinstance(model, torch.nn.Module):
        raise WrongTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError("model must have at least one parameter, got a module with none")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise WrongTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    device = first.device
    tensors = [*model.parameters(), *getattr(optimizer, "master", ()),
               *_optimizer_tensors(optimizer)]
    return storage_bytes((t for t in tensors if t.device == device),
                         block=CUDA_BLOCK if device.type == "cuda" else 1)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


@dataclass
class StepBreakdown:
    """Where the bytes of one training step went, from :func:`step_breakdown` (all in bytes)."""

    at_peak: dict
    baseline: dict
    peak: int
    peak_phase: str
    phase_peaks: dict
    events: list = field(repr=False)
    series: dict = field(repr=False)

    def __post_init__(self):
        fields(self, at_peak=dict, baseline=dict, peak=int, peak_phase=str, phase_peaks=dict,
               events=list, series=dict)
        for name in ("at_peak", "baseline"):
            by_category = getattr(self, name)
            if set(by_category) != set(CATEGORIES) or not all(
                    type(n) is int and n >= 0 for n in by_category.values()):
                raise ValueError(f"StepBreakdown.{name} must map each of {CATEGORIES} to bytes "
                                 f"(an int >= 0), got {by_category!r:.120}")

    @property
    def total(self) -> int:
        """Bytes live at the peak, all categories: ``sum(at_peak.values())``."""
        return sum(self.at_peak.values())

    def table(self) -> str:
        """The breakdown at the peak as aligned text lines (bytes and share)."""
        from course_lib.units import format_bytes

        lines = [f"{'category':16s} {'bytes at peak':>14s} {'':>11s} share"]
        for name in CATEGORIES:
            value = self.at_peak[name]
            lines.append(f"{name:16s} {value:14,d} {format_bytes(value):>11s} "
                         f"{value / max(self.total, 1):6.1%}")
        lines.append(f"{'total':16s} {self.total:14,d} {format_bytes(self.total):>11s} "
                     f"(peak in the {self.peak_phase} phase)")
        return "\n".join(lines)


def step_breakdown(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   inputs: torch.Tensor, targets: torch.Tensor) -> StepBreakdown:
    """Run :func:`training_step` once under a :class:`LiveTensorTracker` and sort its bytes.

    Each storage the step allocates gets one category, decided by what it turned
    out to be: saved by autograd in the forward pass (read off the graph with
    :func:`saved_tensors` before backward) -> "activations"; ending up as a
    parameter's ``.grad`` -> "gradients"; held in ``optimizer.state`` after the
    step -> "optimizer_state"; anything else (logits, the gradients flowing
    between layers, an optimizer's scratch tensors) -> "transient". What was live
    before the step is the baseline. Same idea as PyTorch's ``MemTracker``
    (``torch.distributed._tools.mem_tracker``), which sorts by module and role;
    here every byte is attributed exactly and the whole timeline is kept.

    A mixed-precision optimizer (:class:`course_lib.training.mixed_precision.MasterWeightAdamW`) keeps
    fp32 master weights: they are filed with the optimizer state, as the ZeRO paper counts
    them (its ``K`` bytes per parameter), and their fp32 gradients with the gradients.

    Args:
        model (torch.nn.Module): returns the loss, or ``(logits, loss)``, from
            ``model(inputs, targets)``.
        optimizer (torch.optim.Optimizer): the model's optimizer.
        inputs (torch.Tensor): the batch's inputs.
        targets (torch.Tensor): the batch's targets.

    Returns:
        StepBreakdown: bytes by category at the peak, the baseline and the timeline.

    Raises:
        ValueError: naming ``model`` (not an ``nn.Module``) or ``optimizer`` (not a
            ``torch.optim.Optimizer``).
    """
    if not isinstance(model, torch.nn.Module):
        raise WrongTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise WrongTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_batch(model, inputs, targets)
    params = list(model.parameters())
    baseline = dict.fromkeys(CATEGORIES, 0)
    baseline["parameters"] = storage_bytes(params)
    baseline["gradients"] = storage_bytes(p.grad for p in params if p.grad is not None)
    master = list(getattr(optimizer, "master", ()))
    baseline["optimizer_state"] = storage_bytes(_optimizer_tensors(optimizer) + master)

    tracker = LiveTensorTracker()
    category: dict[int, str] = {}

    def mark(tensors, name):
        for t in tensors:
            record = tracker.record_of(t)
            if record is not None and record.index not in category:
                category[record.index] = name

    def on_phase(name, loss):
        if name == "backward":  # forward done: what the graph saved is the activations
            ptrs = {row.storage_id for row in saved_tensors(loss, params) if not row.is_parameter}
            for record, ptr in _live_records(tracker):
                if ptr in ptrs:
                    category.setdefault(record.index, "activations")
        elif name == "optimizer":
            mark((p.grad for p in params if p.grad is not None), "gradients")
            prepare = getattr(optimizer, "prepare_grads", None)
            if callable(prepare):  # fp32 master gradients now, as course_lib.training.loop.train does
                prepare()
                mark((m.grad for m in master if m.grad is not None), "gradients")
        elif name == "zero_grad":
            mark(_optimizer_tensors(optimizer), "optimizer_state")
        tracker.phase = "optimizer" if name == "zero_grad" else name

    with tracker:
        training_step(model, optimizer, inputs, targets, on_phase=on_phase)
    return _summarise(tracker, category, baseline)


def _live_records(tracker: LiveTensorTracker):
    """``(record, storage_key(storage))`` for every storage the tracker counted that is still alive."""
    for storage, record in list(tracker._ours.items()):
        yield record, storage_key(storage)


def _summarise(tracker: LiveTensorTracker, category: dict, baseline: dict) -> StepBreakdown:
    events = []  # (clock, delta, category, phase)
    for record in tracker.storages:
        name = category.get(record.index, "transient")
        events.append((record.born, record.nbytes, name, record.phase))
        if record.died is not None:
            events.append((record.died, -record.nbytes, name, record.died_phase))
    events.sort(key=lambda e: e[0])
    live = dict(baseline)
    series = {name: [] for name in CATEGORIES}
    phases, best, at_peak, peak_phase = [], -1, dict(baseline), PHASES[0]
    phase_peaks = dict.fromkeys(PHASES, sum(baseline.values()))
    for _, delta, name, phase in events:
        live[name] += delta
        for key in CATEGORIES:
            series[key].append(live[key])
        phases.append(phase)
        total = sum(live.values())
        if phase in phase_peaks:
            phase_peaks[phase] = max(phase_peaks[phase], total)
        if total > best:
            best, at_peak, peak_phase = total, dict(live), phase
    return StepBreakdown(at_peak=at_peak, baseline=baseline,
                         peak=tracker.peak, peak_phase=peak_phase, phase_peaks=phase_peaks,
                         events=phases, series=series)
