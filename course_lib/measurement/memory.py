"""Measured memory: peak bytes, what autograd saves, and where a step's bytes go.

On CUDA ``torch.cuda.max_memory_allocated``; elsewhere :class:`LiveTensorTracker`, exact for
tensor storage (as PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker``).
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
from course_lib.units import MEMORY_CATEGORIES, as_dtype, format_bytes, storage_bytes, storage_key
from course_lib.validation import (
    WrongTypeError,
    available_device,
    device as as_device,
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

    ``with LiveTensorTracker() as t: work()`` then ``t.peak`` and ``t.live``: the work's own
    allocations (storages made before, their views and in-place results are not counted).
    ``t.storages`` keeps each storage's size, birth and death (``t.clock``, ``t.phase``).
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.clock = 0
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

    def _track(self, tensor: torch.Tensor) -> None:
        """Count an op's output storage, new or resized."""
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
        """The record of ``tensor``'s storage, or None if this tracker did not count it.
        Args:
            tensor (torch.Tensor): a tensor made while the tracker was active.
        Returns:
            the record (``nbytes``, ``born``, ``died``, ``phase``), or None.
        """
        storage = _storage_of(tensor)
        return None if storage is None else self._ours.get(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _LIFT_OPS:
            for item in tree_flatten((args, kwargs))[0]:
                storage = _storage_of(item) if isinstance(item, torch.Tensor) else None
                if storage is not None and storage not in self._ours:
                    self._foreign[storage] = True
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
    """``tensor``'s untyped storage; None on ``meta`` or for storage-less layouts."""
    if tensor.device.type == "meta":
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


def peak_memory(fn: Callable[[], object], *, device: str | torch.device | None = None) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was live when it started.

    ``device="cuda"``: ``torch.cuda.max_memory_allocated`` (512-byte blocks, cuBLAS' workspace);
    ``"cpu"``/``"mps"``: :class:`LiveTensorTracker`, which ignores frees of older tensors; None:
    the allocator if ``fn`` allocated on CUDA, else the tracker.
    Args:
        fn (callable): the work, without arguments.
        device (str or torch.device, optional): ``"cuda"``, ``"cpu"``, ``"mps"`` or None.
    Returns:
        int: the peak, in bytes.
    Raises:
        ValueError: naming ``device``, for another kind or one this machine lacks.

    >>> peak_memory(lambda: torch.zeros(1024, 1024), device="cpu")  # 4 MiB of fp32
    4194304
    """
    function("fn", fn)
    kind = None if device is None else available_device("device", device).type
    if kind not in (None, "cuda", "cpu", "mps"):
        raise ValueError(f"device must be 'cuda', 'cpu', 'mps' or None, got {device!r}")
    use_cuda = kind == "cuda" or (kind is None and torch.cuda.is_available())
    if use_cuda:
        # Earlier work's garbage (reference cycles) collected during fn would lower the figure
        # below fn's own peak (on an H200 the engine then looked 12-27 % high).
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    if kind == "cuda":
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with LiveTensorTracker() as tracker:
        fn()
    if use_cuda:
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated() - start
        if cuda_peak > 0:
            return cuda_peak
    return tracker.peak


@dataclass(frozen=True)
class _SavedTensor:
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


def _saved_values(node):
    """``(name, value)`` of what ``node`` saved: ``_saved_*``, or a Function's ``saved_tensors``."""
    for attr in sorted(dir(node)):
        if attr.startswith("_saved_"):
            name = attr.removeprefix("_saved_")
            raw = getattr(node, f"_raw_saved_{name}", None)
            if any(getattr(item, "unpack_hook", None) is not None  # packed by saved_tensors_hooks
                   and not isinstance(item.data, torch.Tensor)
                   for item in (raw if isinstance(raw, list | tuple) else (raw,))):
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


def saved_tensors(output: torch.Tensor, params=()) -> list[_SavedTensor]:
    """What autograd keeps alive for ``output.backward()``: one row per saved tensor per node
    (``node``, ``name``, ``shape``, ``dtype``, ``nbytes`` of its storage, ``is_parameter``: one of
    ``params``, ``storage_id``); tensors packed by ``saved_tensors_hooks`` are not listed.
    Args:
        output (torch.Tensor): a result that requires grad, before its backward pass.
        params (iterable of torch.Tensor): the parameters (``model.parameters()``).
    Returns:
        list: the rows, ``output``'s node first.
    Raises:
        ValueError: naming ``output`` (no grad_fn) or ``params`` (not tensors).

    >>> x = torch.ones(4, requires_grad=True)
    >>> [(r.node, r.name, r.nbytes) for r in saved_tensors(x.exp().sum())]  # exp keeps its result
    [('ExpBackward0', 'result', 16)]
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
                    rows.append(_SavedTensor(
                        node=type(node).__name__, name=name,
                        shape=tuple(item.shape), dtype=item.dtype,
                        nbytes=item.untyped_storage().nbytes(),
                        is_parameter=key in param_storages, storage_id=key))
        stack.extend(fn for fn, _ in node.next_functions)
    return rows


def saved_bytes(output: torch.Tensor, params=(), *, include_parameters: bool = False) -> int:
    """Bytes of the distinct storages autograd saves for ``output`` (``params`` left out unless
    ``include_parameters``); a storage shared by several saved tensors counts once, in full.
    Args:
        output (torch.Tensor): a result that requires grad, before its backward pass.
        params (iterable of torch.Tensor): the parameters (``model.parameters()``).
        include_parameters (bool): count the parameters' storages too.
    Returns:
        int: the bytes.

    >>> w = torch.ones(256, 256, requires_grad=True)
    >>> x = torch.ones(8, 256)  # 8 KiB of fp32
    >>> saved_bytes((x @ w).sum(), [w])  # the matmul keeps x for w's gradient
    8192
    """
    if not isinstance(include_parameters, bool):
        raise WrongTypeError(f"include_parameters must be True or False, got {include_parameters!r}")
    unique = {row.storage_id: row.nbytes for row in saved_tensors(output, params)
              if include_parameters or not row.is_parameter}
    return sum(unique.values())


#: The backward node of each fused kernel of ``F.scaled_dot_product_attention``; the math kernel
#: has none of its own (it is written with ``bmm`` and ``softmax``).
SDPA_NODES = {"ScaledDotProductFlashAttentionForCpuBackward0": "flash",
              "ScaledDotProductFlashAttentionBackward0": "flash",
              "ScaledDotProductEfficientAttentionBackward0": "efficient",
              "ScaledDotProductCudnnAttentionBackward0": "cudnn"}
_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION"}


@dataclass(frozen=True)
class _AttentionSaved:
    """What one call of ``F.scaled_dot_product_attention`` kept for backward."""

    kernel: str
    saved_bytes: int
    square_bytes: int
    tensors: tuple


def sdpa_saved(config: GPTConfig, batch_size: int, dtype=torch.float32, *, kernel: str | None = None,
               device: str | torch.device = "cpu", seed: int = 0) -> _AttentionSaved:
    """What one causal attention call of the course GPT's shape keeps for backward, under the
    SDPA ``kernel`` it forces (else PyTorch's choice): the math kernel the ``b*a*s*s``
    probabilities, FlashAttention (Dao et al. 2022) its output and a log-sum-exp per row.
    Args:
        config (GPTConfig): the shape (``seq_len``, ``d_model``, ``n_heads``, ``dropout``).
        batch_size (int): the batch size.
        dtype (torch.dtype or str): float32, float16 or bfloat16.
        kernel (str, optional): ``"flash"``, ``"cudnn"``, ``"efficient"`` or ``"math"``.
        device (torch.device or str): where the call runs.
        seed (int): the seed of the random inputs.
    Returns:
        ``kernel`` (that ran), ``saved_bytes``, ``square_bytes`` and ``tensors``.
    Raises:
        ValueError: naming the argument, for a value out of range or a kernel that cannot run.
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
    forced = (contextlib.nullcontext() if kernel is None else torch.nn.attention.sdpa_kernel(
        getattr(torch.nn.attention.SDPBackend, _BACKENDS[kernel])))
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
    ran = next((SDPA_NODES[r.node] for r in rows if r.node in SDPA_NODES), "math")
    return _AttentionSaved(ran, saved_bytes(out), sum(squares.values()), rows)


def saved_table(output: torch.Tensor, params=(), *, parameters: bool = False) -> str:
    """:func:`saved_tensors` as a table in forward order, one letter per storage (two rows with
    one letter are one piece of memory); ``parameters`` lists the parameters' rows too.
    Args:
        output (torch.Tensor): a result that requires grad, before its backward pass.
        params (iterable of torch.Tensor): the parameters (``model.parameters()``).
        parameters (bool): list the parameters' rows too.
    Returns:
        str: a header line, then a line per saved tensor.
    """
    if not isinstance(parameters, bool):
        raise WrongTypeError(f"parameters must be True or False, got {parameters!r}")
    rows = [r for r in reversed(saved_tensors(output, params)) if parameters or not r.is_parameter]
    letters: dict[int, str] = {}

    def letter(row: _SavedTensor) -> str:
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


#: What a step's bytes are (:data:`course_lib.units.MEMORY_CATEGORIES` but master weights, filed
#: with the optimizer state as the ZeRO paper counts them), and the step's phases.
CATEGORIES = tuple(name for name in MEMORY_CATEGORIES if name != "master_weights")
PHASES = ("forward", "backward", "optimizer")


def _check_model(model, optimizer) -> None:
    """Refuse a ``model`` that is not a module or an ``optimizer`` that is not an optimizer."""
    if not isinstance(model, torch.nn.Module):
        raise WrongTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise WrongTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  inputs: torch.Tensor, targets: torch.Tensor, *,
                  on_phase: Callable[[str, torch.Tensor | None], None] | None = None) -> float:
    """The course's step: forward to the loss (``model(inputs, targets)`` returns it or
    ``(logits, loss)``), backward, ``optimizer.step()``, ``zero_grad``; returns the loss's value.
    ``on_phase(name, loss)`` is called as each of :data:`PHASES` and ``"zero_grad"`` begins.
    Args:
        model (torch.nn.Module): the model to train.
        optimizer (torch.optim.Optimizer): its optimizer.
        inputs (torch.Tensor): the batch's inputs (token ids for the course GPT).
        targets (torch.Tensor): the batch's targets.
        on_phase (callable, optional): called with ``(name, loss)``.
    Returns:
        float: the loss.
    Raises:
        ValueError: naming the argument, for a batch the model cannot train on.
    """
    _check_model(model, optimizer)
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
    """Bytes that stay on the model's device between steps, each storage once: parameters, master
    weights, optimizer state (on CUDA in 512-byte blocks, without AdamW's host-side ``step``).
    Args:
        model (torch.nn.Module): the model.
        optimizer (torch.optim.Optimizer): its optimizer.
    Returns:
        int: the bytes.
    Raises:
        ValueError: naming ``model``, for a module without parameters.

    >>> model = torch.nn.Linear(1024, 1024)  # 1,049,600 fp32 parameters
    >>> resident_bytes(model, torch.optim.AdamW(model.parameters()))  # no state before a step
    4198400
    """
    _check_model(model, optimizer)
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError("model must have at least one parameter, got a module with none")
    device = first.device
    tensors = [*model.parameters(), *getattr(optimizer, "master", ()),
               *_optimizer_tensors(optimizer)]
    return storage_bytes((t for t in tensors if t.device == device),
                         block=kernels.CUDA_BLOCK if device.type == "cuda" else 1)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


@dataclass
class StepBreakdown:
    """Where the bytes of one training step went (:func:`step_breakdown`), all in bytes."""

    at_peak: dict
    baseline: dict
    peak: int
    peak_phase: str
    phase_peaks: dict
    events: list = field(repr=False)
    series: dict = field(repr=False)

    @property
    def total(self) -> int:
        """Bytes live at the peak, all categories."""
        return sum(self.at_peak.values())

    def table(self) -> str:
        """The breakdown at the peak as aligned text lines (bytes and share)."""
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
    """Run :func:`training_step` under a :class:`LiveTensorTracker` and file each byte as what
    it turned out to be: "activations" (saved by autograd), "gradients", "optimizer_state"
    (master weights too, as ZeRO counts them) or "transient"; as PyTorch's ``MemTracker``.
    Args:
        model (torch.nn.Module): the model to train.
        optimizer (torch.optim.Optimizer): its optimizer.
        inputs (torch.Tensor): the batch's inputs.
        targets (torch.Tensor): the batch's targets.
    Returns:
        StepBreakdown: the bytes by category at the peak, and each phase's peak.
    """
    _check_model(model, optimizer)  # training_step checks the batch
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
            for storage, record in list(tracker._ours.items()):
                if storage_key(storage) in ptrs:
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
