"""08: the other levers: optimizer step in backward, chunked loss, offloading, small optimizer states.

The tested code of the levers lecture 08 measures side by side, beyond the precision,
accumulation, checkpointing and sharding of lectures 01-07:

* :func:`optimizer_in_backward`: each parameter is updated, and its gradient freed, as soon as
  its gradient is complete (``Tensor.register_post_accumulate_grad_hook``; PyTorch tutorial
  "How to save memory by fusing the optimizer step into the backward pass"; Lv et al. 2023,
  LOMO);
* :func:`chunked_cross_entropy`: the loss without the whole ``(tokens, vocab)`` logits, chunk
  by chunk (Liger Kernel's fused linear cross-entropy; Wijmans et al. 2024, "Cut Your Losses in
  Large-Vocabulary Language Models"); :func:`use_chunked_loss` switches the course GPT to it;
* :class:`OffloadSavedTensors`: a ``saved_tensors_hooks`` pair that moves what autograd saves to
  the host (the idea behind ``torch.autograd.graph.save_on_cpu``) and counts the bytes;
  :func:`course_lib.prediction.time_model.transfer_seconds` converts them into time at a link's bandwidth;
* :func:`optimizer_state_bytes` (measured) and :func:`low_bit_state_bytes` (predicted) for 8-
  and 4-bit AdamW (torchao's ``AdamW8bit``/``AdamW4bit``, :func:`low_bit_adamw`; Dettmers et al.
  2022; Li et al. 2023, "Memory Efficient Optimizers with 4-bit States");
* :func:`lora_parameter_count`: the trainable parameters of LoRA adapters (Hu et al. 2021).

:func:`course_lib.planning.fit_ladder.ladder` ranks all of them for a model and a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn

from course_lib.model.gpt import BLOCK_SHAPES, GPTConfig, check_config
from course_lib.units import storage_bytes, storage_key
from course_lib.validation import (
    MAX_COUNT,
    WrongTypeError,
    available_device as as_device,
    boolean,
    integer,
    items,
    positive_int,
)

#: The largest tokens or chunk rows any function here takes.
MAX_TOKENS = MAX_COUNT

# --------------------------------------------------------------------------- optimizer in backward


class OptimizerInBackward:
    """What :func:`optimizer_in_backward` installed: one optimizer and one hook per parameter."""

    def __init__(self, optimizers: dict, handles: list):
        self.optimizers = optimizers
        self._handles = handles
        self.steps = 0

    def remove(self) -> None:
        """Remove every hook: later backward passes leave the gradients in ``.grad`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def active(self) -> bool:
        """True until :meth:`remove` is called."""
        return bool(self._handles)

    def state_dict(self) -> dict:
        """Each optimizer's ``state_dict()``, in parameter order (for checkpoints)."""
        return {i: opt.state_dict() for i, opt in enumerate(self.optimizers.values())}


def optimizer_in_backward(model: nn.Module,
                          make_optimizer: Callable[[list], torch.optim.Optimizer]
                          ) -> OptimizerInBackward:
    """Update each parameter, and free its gradient, as soon as its gradient is complete.

    For every parameter ``p`` of ``model`` that requires a gradient (a tied weight
    once), ``make_optimizer([p])`` builds an optimizer over ``p`` alone, and
    ``p.register_post_accumulate_grad_hook`` runs ``optimizer.step()`` then
    ``optimizer.zero_grad(set_to_none=True)`` right after autograd has accumulated
    ``p``'s gradient of the backward pass. After ``loss.backward()`` the step is done
    and no gradient is left: call neither ``optimizer.step()`` nor ``zero_grad()``.

    Memory: an ordinary step holds every gradient (``P`` elements) between the
    backward pass and ``optimizer.step()``; here at most a few parameters'
    gradients are alive at once, so the peak loses up to the whole gradient,
    ``P x bytes per gradient``. Per-parameter optimizers give the same update as one
    optimizer over all parameters when the update of a parameter depends on its own
    gradient only (SGD, Adam, AdamW); see lecture 08 for what it cannot do as is:
    gradient accumulation (each backward pass steps) and clipping by the global
    gradient norm (no moment has all the gradients).

    Args:
        model (nn.Module): the module whose parameters to train.
        make_optimizer (callable): ``make_optimizer(params)`` with ``params`` a list of one
            parameter, returning a ``torch.optim.Optimizer`` (or any object with
            ``step()`` and ``zero_grad(set_to_none=...)``), e.g.
            ``lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)``.

    Returns:
        An :class:`OptimizerInBackward` handle; ``handle.remove()`` removes the hooks.

    Raises:
        ValueError: if ``model`` is not an ``nn.Module`` with a parameter that
            requires a gradient, ``make_optimizer`` is not callable, or it returns
            something without ``step`` and ``zero_grad``.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> handle = optimizer_in_backward(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> model(torch.ones(3, 4)).sum().backward()
        >>> model.weight.grad is None, handle.steps
        (True, 2)
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise WrongTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(make_optimizer):
        raise WrongTypeError(f"make_optimizer must be callable as make_optimizer([param]), "
                         f"got {make_optimizer!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model must have at least one parameter that requires grad")
    optimizers, handles = {}, []
    handle = OptimizerInBackward(optimizers, handles)
    for p in params:  # every optimizer made before any hook, so a refusal leaves none behind
        opt = make_optimizer([p])
        if not (callable(getattr(opt, "step", None)) and callable(getattr(opt, "zero_grad", None))):
            raise ValueError(f"make_optimizer must return an optimizer (with step() and "
                             f"zero_grad()), got {type(opt).__name__}")
        optimizers[p] = opt
    for p, opt in optimizers.items():

        def hook(param, opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=True)
            handle.steps += 1

        handles.append(p.register_post_accumulate_grad_hook(hook))
    return handle


# --------------------------------------------------------------------------- chunked cross-entropy


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss's dtype: fp32 for 16-bit inputs (as the course GPT's loss), fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, ``chunk`` rows at a time.

    Forward keeps its inputs and each row's fp32 log-sum-exp; backward recomputes each chunk's
    logits into ``softmax - one_hot`` in place and adds the chunk's share to both gradients.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, ignore_index):
        n, wide = hidden.size(0), _loss_dtype(hidden.dtype)
        valid = targets != ignore_index
        count = int(valid.sum())
        lse = torch.empty(n, dtype=wide, device=hidden.device)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        for i in range(0, n, chunk):
            z = (hidden[i:i + chunk] @ weight.t()).to(wide)  # (c, V), at least fp32
            t, v = targets[i:i + chunk], valid[i:i + chunk]
            picked = z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)  # the target's logit
            top = z.amax(dim=1)  # log-sum-exp in place: no second (c, V) buffer
            rows = z.sub_(top.unsqueeze(1)).exp_().sum(dim=1).log_().add_(top)
            del z
            lse[i:i + chunk] = rows
            total += ((rows - picked) * v).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.ignore_index, ctx.count = chunk, ignore_index, count
        return total / count  # 0/0 = nan when every target is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, n = ctx.chunk, hidden.size(0)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        scale = grad_loss / ctx.count
        for i in range(0, n, chunk):
            h, t = hidden[i:i + chunk], targets[i:i + chunk]
            z = (h @ weight.t()).to(lse.dtype)
            z.sub_(lse[i:i + chunk].unsqueeze(1)).exp_()              # softmax, in place
            z.scatter_add_(1, t.clamp(min=0).unsqueeze(1),
                           torch.full((t.numel(), 1), -1.0, dtype=z.dtype, device=z.device))
            z.mul_(((t != ctx.ignore_index) * scale).unsqueeze(1))    # ignored rows: 0
            g = z.to(hidden.dtype)
            del z
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[i:i + chunk])
            if grad_weight is not None:
                grad_weight.addmm_(g.t(), h)
            del g
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T`` without ever holding all of them.

    ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=ignore_index)`` keeps
    the ``(N, V)`` logits' log-softmax (fp32, ``4 N V`` bytes) for its backward pass
    and allocates two more ``N x V`` fp32 buffers in it: at a 128k vocabulary and 8k
    tokens that is 4 GiB each. Here the rows go through in chunks of ``chunk_size``:
    the forward pass keeps only each row's log-sum-exp (``4 N`` bytes); the backward
    pass recomputes one chunk's logits at a time (``chunk_size x V``) and turns them
    into the gradient ``(softmax - one_hot) / n_valid``. Same loss, same gradients
    (to float rounding), for one more ``hidden @ weight.T`` (``2 N h V`` FLOPs).

    Args:
        hidden (torch.Tensor): ``(N, h)`` or ``(B, T, h)`` final hidden states (any float dtype; the
            log-softmax runs in fp32).
        weight (torch.Tensor): ``(V, h)`` output embedding (the LM head's weight), same dtype as
            ``hidden``.
        targets (torch.Tensor): ``(N,)`` or ``(B, T)`` integer class ids; ``ignore_index`` marks
            positions left out of the mean.
        chunk_size (int): rows per chunk, a positive int; ``>= N`` means one chunk.
        ignore_index (int): target value to leave out (default -100, as ``F.cross_entropy``).

    Returns:
        The 0-d mean (fp32; fp64 for fp64 inputs) over non-ignored targets (nan if all are ignored, as
        ``F.cross_entropy``), differentiable with respect to ``hidden`` and ``weight``.

    Raises:
        ValueError: naming the argument: ``chunk_size`` not a positive int; shapes that
            do not match; ``targets`` not an integer tensor; dtypes that differ.

    Example:
        >>> import torch.nn.functional as F
        >>> h, w = torch.randn(6, 4), torch.randn(10, 4)
        >>> t = torch.tensor([1, 2, 3, -100, 5, 9])
        >>> torch.allclose(chunked_cross_entropy(h, w, t, chunk_size=4),
        ...                F.cross_entropy(h @ w.T, t))
        True
    """
    if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
            or not 1 <= chunk_size <= MAX_TOKENS):
        raise ValueError(f"chunk_size must be a positive int (rows per chunk) of at most "
                         f"{MAX_TOKENS:,}, got {chunk_size!r}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3) \
            or not hidden.is_floating_point():
        raise ValueError("hidden must be a float tensor of shape (N, h) or (B, T, h), got "
                         f"{getattr(hidden, 'shape', type(hidden).__name__)}")
    h = hidden.size(-1)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.size(1) != h:
        raise ValueError(f"weight must be a (V, {h}) tensor, got "
                         f"{tuple(getattr(weight, 'shape', ())) or type(weight).__name__}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() \
            or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError("targets must be an integer tensor of class ids")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])} (hidden's without "
                         f"its last dimension), got {tuple(targets.shape)}")
    ignore_index = integer("ignore_index", ignore_index, minimum=-(2**63), maximum=2**63 - 1)
    return _ChunkedCrossEntropy.apply(hidden.reshape(-1, h), weight, targets.reshape(-1),
                                      chunk_size, ignore_index)


def _chunked_forward(model, idx, targets=None, ignore_index=-100):
    """The course GPT's forward with the loss of :func:`chunked_cross_entropy`: ``(None, loss)``."""
    if targets is None:
        return type(model).forward(model, idx)
    T = idx.size(1)
    if T > model.config.seq_len:
        raise ValueError(f"sequence length {T} exceeds config.seq_len={model.config.seq_len}")
    pos = torch.arange(T, device=idx.device)
    x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
    hidden = model.ln_f(model.run_blocks(x))
    loss = chunked_cross_entropy(hidden, model.lm_head.weight, targets, model.loss_chunk,
                                 ignore_index)
    return None, loss


def use_chunked_loss(model: nn.Module, chunk_size: int | None) -> nn.Module:
    """Switch the course GPT ``model`` to :func:`chunked_cross_entropy`; None switches back.

    With targets ``model(idx, targets)`` returns ``(None, loss)`` (no logits exist); per
    instance, like :func:`course_lib.training.checkpointing.enable_checkpointing`;
    ``model.loss_chunk`` holds the chunk.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "lm_head") \
            or not hasattr(model, "ln_f"):
        raise ValueError(f"model must be a course GPT (with lm_head and ln_f), got {type(model)}")
    if chunk_size is not None:
        chunk_size = positive_int("chunk_size", chunk_size, maximum=MAX_TOKENS)
    model.__dict__.pop("forward", None)
    model.loss_chunk = None
    if chunk_size is None:
        return model
    model.loss_chunk = chunk_size
    model.forward = _chunked_forward.__get__(model)
    return model


def logits_bytes(n_tokens: int, vocab_size: int, dtype=torch.float32) -> int:
    """Bytes of one ``(n_tokens, vocab_size)`` logits tensor in ``dtype``: ``N x V x bytes``.

    The plain loss of the course GPT holds several tensors of this size at its worst
    moment (lecture 08 counts them; the memory engine replays them).

    Args:
        n_tokens (int): N, from 1 to :data:`MAX_TOKENS`.
        vocab_size (int): V, from 1 to ``CONFIG_MAXIMUM["vocab_size"]``.
        dtype (torch.dtype or str): the logits' dtype.

    Returns:
        int: bytes.

    Raises:
        ValueError: for a count that is not a positive int in range, or a bad ``dtype``.

    Example:
        >>> logits_bytes(8 * 1024, 50257)  # 1.5 GiB of fp32 logits
        1646821376
    """
    from course_lib.model.gpt import CONFIG_MAXIMUM
    from course_lib.units import dtype_bytes

    return positive_int("n_tokens", n_tokens, maximum=MAX_TOKENS) * positive_int(
        "vocab_size", vocab_size, maximum=CONFIG_MAXIMUM["vocab_size"]) * dtype_bytes(dtype)


# --------------------------------------------------------------------------- offloading



class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Move what autograd saves to ``device`` in the forward pass, back when backward needs it.

    A hand-written version of ``torch.autograd.graph.save_on_cpu``: ``pack`` copies
    each saved tensor to ``device`` (pinned host memory when ``pin_memory`` and CUDA
    is there), ``unpack`` copies it back to where it came from. Each storage is packed once,
    however many tensors view it.

    On a CPU-only machine the tensors already are on the host: nothing moves, and the
    counts say what would move from a GPU.

    Args:
        device (str or torch.device): where saved tensors go (the host, ``"cpu"``).
        pin_memory (bool): copy into pinned host memory (faster copies that do not block the
            CPU); only where CUDA is available. Like ``save_on_cpu``'s, the copies are issued on
            the current CUDA stream: they run between the compute kernels, not beside them.
        skip_parameters (bool): leave parameters (and views of them) where they are
            (``save_on_cpu`` copies them too, every step).

    Attributes:
        packed_bytes: bytes of the distinct storages packed: what the device no longer
            has to hold between the forward and the backward pass.
        moved_bytes: bytes copied to the host, tensor by tensor (a storage that two ops
            save is copied twice, as ``save_on_cpu`` does); they come back in the backward pass.
        packed: number of tensors packed; skipped: parameters (and views of them) left in place.

    Raises:
        ValueError: naming ``device``, ``pin_memory`` or ``skip_parameters``, for a bad value.
    """

    def __init__(self, device: str | torch.device = "cpu", *, pin_memory: bool = True,
                 skip_parameters: bool = True):
        self.device = as_device("device", device)
        self.pin_memory = boolean("pin_memory", pin_memory) and torch.cuda.is_available()
        self.skip_parameters = boolean("skip_parameters", skip_parameters)
        self.packed_bytes, self.moved_bytes, self.packed, self.skipped = 0, 0, 0, 0
        self._seen: dict = {}
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor):
        # A linear saves its weight as a transposed view: a parameter all the same.
        if self.skip_parameters and (isinstance(tensor, nn.Parameter)
                                     or isinstance(tensor._base, nn.Parameter)):
            self.skipped += 1
            return tensor
        self.packed += 1
        self.moved_bytes += tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        seen = self._seen.get(storage_key(tensor))
        # A weak reference: holding the storage would keep on the device what is offloaded,
        # and a freed storage's key may come back for a new one, which counts again.
        if seen is None or seen() is not storage:
            self._seen[storage_key(tensor)] = weakref.ref(storage)
            self.packed_bytes += storage.nbytes()
        if tensor.device == self.device:
            return tensor.device, tensor  # already there: nothing to move
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=self.pin_memory)
        host.copy_(tensor, non_blocking=self.pin_memory)
        return tensor.device, host

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, tensor = packed
        return tensor.to(device, non_blocking=self.pin_memory)


# --------------------------------------------------------------------------- optimizer states


def _flat_tensors(value) -> list[torch.Tensor]:
    """The plain tensors that hold ``value``: a tensor subclass's inner tensors, recursively."""
    if not isinstance(value, torch.Tensor):
        return []
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is None or type(value) in (torch.Tensor, nn.Parameter):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [t for name in names for t in _flat_tensors(getattr(value, name))]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of an optimizer's state, measured from its tensors, each storage once.

    Walks ``optimizer.state`` (and ``optimizer.master``, where a
    :class:`course_lib.training.mixed_precision.MasterWeightAdamW` keeps fp32 copies, which count here
    too) and sums ``untyped_storage().nbytes()`` over distinct storages. A quantized
    state (torchao's ``OptimState8bit``/``OptimState4bit``) is a tensor subclass: its
    inner tensors are counted (codes, scales, quantization map), not its nominal
    shape. Step counters are included (4 bytes each for AdamW).

    Args:
        optimizer (torch.optim.Optimizer): any optimizer with a ``state`` mapping.

    Returns:
        int: bytes.

    Raises:
        ValueError: for an object without a ``state`` mapping.
    """
    state = getattr(optimizer, "state", None)
    if not hasattr(state, "values"):
        raise ValueError(f"optimizer must have a .state mapping, got {type(optimizer).__name__}")
    tensors = [t for s in state.values() for v in s.values() for t in _flat_tensors(v)]
    tensors += [t for m in getattr(optimizer, "master", ()) for t in _flat_tensors(m)]
    return storage_bytes(tensors)


#: torchao's block-wise quantized AdamW by bits: elements per fp32 scale, fp32 map entries.
_LOW_BIT = {8: {"block": 256, "qmap": 256}, 4: {"block": 128, "qmap": 16}}


def low_bit_state_bytes(numels: list[int], bits: int, *, param_bytes: int = 4) -> int:
    """Predicted bytes of AdamW's ``m`` and ``v`` (and step counters) with ``bits``-bit states.

    torchao (``torchao.optim.AdamW8bit``/``AdamW4bit``) quantizes a state tensor
    only when it has at least 4096 elements and its block size divides them
    (following bitsandbytes); each such tensor then holds ``n x bits / 8`` bytes of
    codes, one fp32 scale per block (``4 n / block``; block 256 for 8-bit, 128 for
    4-bit) and its own fp32 quantization map (256 or 16 entries). Smaller tensors keep
    ``m`` and ``v`` in the parameter's dtype (``param_bytes``). ``bits=32`` gives
    plain AdamW, ``2 x param_bytes x n`` per tensor (fp32: 8 bytes per parameter).
    Each parameter also has a 4-byte fp32 ``step`` counter.

    So per parameter of a large tensor: 8-bit ``2 x (1 + 4/256)`` = 2.03 bytes plus
    the maps, 4-bit ``2 x (0.5 + 4/128)`` = 1.06 bytes, against 8 for fp32 AdamW.

    Args:
        numels (list of int): elements of each parameter tensor.
        bits (int): 32, 8 or 4.
        param_bytes (int): bytes per element of the parameters (4 for fp32).

    Returns:
        Bytes, as :func:`optimizer_state_bytes` measures after the first step.

    Raises:
        ValueError: for ``bits`` not in (32, 8, 4), ``numels`` not a list of positive ints
            (each at most :data:`course_lib.validation.MAX_COUNT`), or ``param_bytes`` not an
            int from 1 to 8.
    """
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (32, 8, 4):
        raise ValueError(f"bits must be one of (32, 8, 4), got {bits!r}")
    param_bytes = positive_int("param_bytes", param_bytes, maximum=8)
    numels = items("numels", numels)
    total = 0
    for n in numels:
        n = positive_int("numels", n, maximum=MAX_COUNT)  # an int: the sum stays exact
        total += 4  # the step counter
        if bits == 32:
            total += 2 * n * param_bytes
            continue
        spec = _LOW_BIT[bits]
        if n >= 4096 and n % spec["block"] == 0:
            total += 2 * (n * bits // 8 + 4 * (n // spec["block"]) + 4 * spec["qmap"])
        else:
            total += 2 * n * param_bytes
    return total


def low_bit_adamw(bits: int):
    """torchao's ``AdamW8bit`` (``bits=8``) or ``AdamW4bit`` (``bits=4``) class.

    Imported on first use, with torchao's import-time messages about CUDA-only
    extensions it cannot load on a CPU machine silenced (they do not concern these
    optimizers). torchao's step is ``torch.compile``-d per parameter shape (tens of
    seconds per shape on a small CPU); lecture 08 runs it eagerly
    (``torch.compiler.set_stance("force_eager")``, :func:`eager_compile`), which computes the
    same update.

    Args:
        bits (int): 8 or 4.

    Returns:
        type: the optimizer class.

    Raises:
        ValueError: for ``bits`` other than 8 or 4.
        ImportError: when torchao is not installed (``pip install torchao``).
    """
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from torchao.optim import AdamW4bit, AdamW8bit
            except ImportError:  # torchao < 0.10 kept them in the prototype namespace
                from torchao.prototype.low_bit_optim import AdamW4bit, AdamW8bit
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return AdamW8bit if bits == 8 else AdamW4bit


@contextlib.contextmanager
def eager_compile():
    """Run ``torch.compile``-d functions eagerly inside the block (torchao's low-bit step):
    ``torch.compiler.set_stance("force_eager")``, or dynamo disabled on torch < 2.6.

    Yields:
        None; the block runs eagerly.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # torch < 2.6: fall back to disabling dynamo
        with torch._dynamo.config.patch(disable=True):
            yield
        return
    with set_stance("force_eager"):
        yield


# --------------------------------------------------------------------------- LoRA

#: The linear layers of a course GPT block LoRA can adapt (:data:`course_lib.model.gpt.BLOCK_SHAPES`).
LORA_TARGETS = tuple(name for name, _, _ in BLOCK_SHAPES)


def lora_parameter_count(config: GPTConfig, rank: int,
                         targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Trainable parameters of LoRA adapters of ``rank`` on every block's ``targets`` linears.

    An adapter beside a frozen ``W`` (``out x in``) adds ``B @ A`` with ``A``
    ``(rank x in)`` and ``B`` ``(out x rank)``: ``rank x (in + out)`` parameters
    (Hu et al. 2021, section 4.1). Per block of the course GPT with all four linears:
    ``rank x (h + 3h + h + h + h + 4h + 4h + h)`` = ``16 h rank``.

    Args:
        config (GPTConfig): the model.
        rank (int): the adapters' rank r, an int from 1 to ``config.d_model`` (a larger rank is
            no low-rank adapter).
        targets (tuple of str): the block linears adapted, of :data:`LORA_TARGETS`.

    Returns:
        int: adapter parameters, all layers.

    Raises:
        ValueError: bad ``config``, ``rank`` or a target that is not one of :data:`LORA_TARGETS`.

    Example:
        >>> lora_parameter_count(GPTConfig(d_model=64, n_layers=2), 8)  # 2 * 16 * 64 * 8
        16384
    """
    check_config(config)
    rank = positive_int("rank", rank, maximum=config.d_model)
    if (not isinstance(targets, tuple | list) or not targets
            or any(not isinstance(t, str) or t not in LORA_TARGETS for t in targets)):
        raise ValueError(f"targets must be a non-empty tuple of {LORA_TARGETS}, got {targets!r}")
    h = config.d_model
    per_block = sum(rank * (i * h + o * h) for name, i, o in BLOCK_SHAPES if name in targets)
    return config.n_layers * per_block


def frozen_linear_flops(config: GPTConfig, n_tokens: int) -> int:
    """FLOPs a frozen model skips in its backward pass: the weight gradients of its matmuls.

    Each linear ``(in x out)`` computes ``2 N in out`` FLOPs for the weight gradient;
    per block ``2 N x 12 h^2``, and ``2 N h V`` for the tied LM head.

    Args:
        config (GPTConfig): the model.
        n_tokens (int): tokens N in the batch, from 1 to :data:`MAX_TOKENS`.

    Returns:
        int: FLOPs.

    Raises:
        ValueError: bad ``config`` or ``n_tokens``.
    """
    check_config(config)
    N, h = positive_int("n_tokens", n_tokens, maximum=MAX_TOKENS), config.d_model
    per_block = sum(i * o for _, i, o in BLOCK_SHAPES) * h * h  # 12 h^2
    return 2 * N * (config.n_layers * per_block + h * config.vocab_size)


__all__ = ["OptimizerInBackward", "optimizer_in_backward", "chunked_cross_entropy",
           "use_chunked_loss", "logits_bytes",
           "OffloadSavedTensors", "optimizer_state_bytes", "low_bit_state_bytes",
           "low_bit_adamw", "eager_compile", "LORA_TARGETS", "lora_parameter_count",
           "frozen_linear_flops"]
