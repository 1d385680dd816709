"""The training loop the lectures share: micro-batches, accumulation, mixed precision, DDP.

:func:`train` runs one optimizer step per batch it is given. Each batch of
``micro_batch_size * accumulation_steps`` samples is cut into micro-batches
that run forward and backward one after the other (their gradients add up in
``.grad``), then the optimizer steps once. The loss of each micro-batch is
weighted by :func:`course_lib.training.accumulation.micro_batch_loss` (``normalize``:
``"tokens"`` is correct with padding, see that module). Options:

* ``amp_dtype``: run the forward passes under ``torch.autocast`` in bf16 or
  fp16 (:func:`course_lib.device.pick_dtype` chooses). With fp16 a
  ``torch.amp.GradScaler`` multiplies every micro-batch's loss by the same
  scale; ``unscale_``, ``step`` and ``update`` run once per *effective* batch,
  so an overflow in any micro-batch skips the whole step and halves the scale
  (Micikevicius et al. 2018, "Mixed Precision Training"; PyTorch's AMP
  examples, "Gradient accumulation").
* ``no_sync``: for a ``DistributedDataParallel`` model, all micro-batches but
  the last run inside ``model.no_sync()``, so the gradients are all-reduced
  once per step instead of once per micro-batch (PyTorch DDP docs).
* ``max_grad_norm``: clip the accumulated gradient (after unscaling).
* ``progress``: a ``tqdm.auto`` bar over optimizer steps showing the loss.

The last partial window. When an epoch's micro-batches are not a multiple of
``K``, its last batch holds fewer than ``micro_batch_size * K`` samples
(:func:`batches_of` with ``drop_last=False``). That step is weighted by what it
holds: the token normalisation divides by the tokens of that batch, and
``"mean-of-means"`` divides each micro-batch's mean by the number of
micro-batches actually in the window, not by ``K``. Dividing by ``K`` there
scales the last step's gradient by ``k / K`` for a window of ``k`` micro-batches,
a bug reported against PyTorch Lightning (issue #19987, 2024) and fixed in
Hugging Face ``transformers``' Trainer in 2025 (pull request #39659,
``current_gradient_accumulation_steps``) and in trainers built on it in 2026
(ms-swift #10084, LlamaFactory #10705).

The data the lectures train on, a toy language with a known loss floor, is
:mod:`course_lib.model.toy_data`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from course_lib.model.gpt import check_batch
from course_lib.training.accumulation import NORMALIZATIONS, micro_batch_loss
from course_lib.validation import MAX_COUNT, WrongTypeError, choice, integer, number, positive_int

#: The autocast dtypes :func:`train` takes (None: no autocast).
AMP_DTYPES = (None, torch.float16, torch.bfloat16)


def make_grad_scaler(device_type: str = "cuda", **kwargs):
    """A ``GradScaler`` for ``device_type`` ("cuda" or "cpu"), on any torch >= 2.4.

    ``torch.amp.GradScaler(device)`` is the current spelling; older releases
    only have ``torch.cuda.amp.GradScaler`` (CUDA) and ``torch.cpu.amp.GradScaler``.

    Args:
        device_type (str): ``"cuda"`` or ``"cpu"``.
        **kwargs: passed on to the scaler (``init_scale``, ``growth_interval``, ...).

    Returns:
        The ``GradScaler``.

    Raises:
        ValueError: naming ``device_type``, for another value, or when this torch has no
            GradScaler for it.
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    try:
        return torch.amp.GradScaler(device_type, **kwargs)
    except (AttributeError, TypeError, RuntimeError):
        legacy = torch.cuda.amp if device_type == "cuda" else getattr(torch.cpu, "amp", None)
        if legacy is None or not hasattr(legacy, "GradScaler"):
            raise ValueError(f"this torch ({torch.__version__}) has no GradScaler for "
                             f"{device_type}") from None
        return legacy.GradScaler(**kwargs)


@dataclass
class TrainLog:
    """What :func:`train` did: one entry per optimizer step (losses are Python floats).

    Attributes:
        losses (list of float): the loss of each effective batch.
        tokens (list of int): non-ignored targets per step.
        micro_batches (list of int): micro-batches per step (K, or fewer in a last partial
            window).
        skipped (list of bool): True where the GradScaler skipped the step (inf or NaN found).
        scales (list of float): the GradScaler's scale after each step (empty without one).
        micro_steps (int): forward and backward passes in total.
        seconds (float): wall-clock seconds spent in :func:`train`, summed over calls.
    """

    losses: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    micro_steps: int = 0
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        """Optimizer steps taken or skipped: one per effective batch."""
        return len(self.losses)


def train(model: nn.Module, optimizer: torch.optim.Optimizer,
          batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, micro_batch_size: int,
          accumulation_steps: int = 1, normalize: str = "tokens", ignore_index: int = -100,
          amp_dtype: torch.dtype | None = None, grad_scaler="auto", no_sync: bool = False,
          max_grad_norm: float | None = None, progress: bool = False,
          on_step: Callable[[int, float], None] | None = None, log: TrainLog | None = None) -> TrainLog:
    """One optimizer step per ``(inputs, targets)`` batch of ``micro_batch_size * accumulation_steps``.

    The last batch may hold fewer samples (an epoch's last partial window): it is
    cut into ``k = ceil(n / micro_batch_size)`` micro-batches and weighted by what
    it holds (see the module doc), so its step gets the mean gradient of its own
    samples, as one batch of ``n`` would. Every other batch must hold exactly
    ``micro_batch_size * accumulation_steps`` samples.

    With ``normalize="tokens"``, ``N`` is the batch's own token count. Under DDP
    each rank divides by its own ``N`` and DDP averages the ranks' gradients:
    the global token mean only when every rank holds the same number of tokens.
    A micro-batch of padding only still runs (its loss is 0), so that with
    ``no_sync`` the last micro-batch always triggers the all-reduce.

    Args:
        model (torch.nn.Module): returns logits (or a tuple whose first item is the logits)
            from ``model(inputs)``.
        optimizer (torch.optim.Optimizer): steps the parameters; a
            :class:`~course_lib.training.mixed_precision.MasterWeightAdamW` gets its ``prepare_grads``
            called before clipping and unscaling.
        batches (iterable of tuple): ``(inputs, targets)`` batches (:func:`batches_of`).
        micro_batch_size (int): samples per forward and backward pass, a positive int.
        accumulation_steps (int): micro-batches K per optimizer step, a positive int.
        normalize (str): one of :data:`course_lib.training.accumulation.NORMALIZATIONS` (see
            :func:`course_lib.training.accumulation.micro_batch_loss`); ``"tokens"`` is correct.
        ignore_index (int): the target value that is not a token (an int64).
        amp_dtype (torch.dtype, optional): None, ``torch.float16`` or ``torch.bfloat16``: the
            forward pass under ``torch.autocast`` in it.
        grad_scaler: ``"auto"`` makes one (:func:`make_grad_scaler`) when ``amp_dtype`` is
            fp16 and uses none otherwise; pass a ``GradScaler`` to use (and inspect) your own.
            A step counts as skipped when the scaler lowered its scale (it found an inf or
            NaN). ``None`` uses none, even in fp16 (to show what loss scaling prevents).
        no_sync (bool): skip DDP's all-reduce on every micro-batch but the last (the model
            must have ``no_sync()``, as ``DistributedDataParallel``).
        max_grad_norm (float, optional): clip the gradients' total norm to it (> 0), on the
            true (unscaled, fp32 master) gradients.
        progress (bool): show a tqdm progress bar.
        on_step (callable, optional): ``on_step(step, loss)``, called after each optimizer step.
        log (TrainLog, optional): a log to append to (to continue a run).

    Returns:
        TrainLog: ``log`` (or a new one), with one entry per optimizer step.

    Raises:
        ValueError: naming the parameter, for a bad value; ``no_sync=True`` for a model
            without ``no_sync()``; a batch of the wrong size.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))  # logits over 16 tokens
        >>> x, y = torch.randint(16, (8, 4)), torch.randint(16, (8, 4))
        >>> log = train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches_of(x, y, 8),
        ...             micro_batch_size=2, accumulation_steps=4)
        >>> log.steps, log.micro_steps, log.tokens  # one step of 4 micro-batches, 8 * 4 tokens
        (1, 4, [32])
    """
    if not isinstance(model, torch.nn.Module):
        raise WrongTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise WrongTypeError(f"optimizer must be a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    micro_batch_size = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_COUNT)
    accumulation_steps = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_COUNT)
    choice("normalize", normalize, NORMALIZATIONS)
    ignore_index = integer("ignore_index", ignore_index, minimum=-(2**63), maximum=2**63 - 1)
    if amp_dtype not in AMP_DTYPES:
        raise ValueError(f"amp_dtype must be one of {AMP_DTYPES}, got {amp_dtype!r}")
    if no_sync and not callable(getattr(model, "no_sync", None)):
        raise ValueError("no_sync=True needs a model with a no_sync() context manager "
                         "(torch.nn.parallel.DistributedDataParallel)")
    if max_grad_norm is not None:
        number("max_grad_norm", max_grad_norm, above=0.0)
    if on_step is not None and not callable(on_step):  # refused before any step changes weights
        raise ValueError(f"on_step must be None or callable as on_step(step, loss), got "
                         f"{on_step!r}")
    auto_scaler = isinstance(grad_scaler, str) and grad_scaler == "auto"
    if auto_scaler:
        auto_scaler, grad_scaler = amp_dtype == torch.float16, None
    elif grad_scaler is not None and not all(
            hasattr(grad_scaler, m) for m in ("scale", "unscale_", "step", "update")):
        raise ValueError(f"grad_scaler must be 'auto', None or a GradScaler, got {grad_scaler!r}")
    log = TrainLog() if log is None else log
    batch_size = micro_batch_size * accumulation_steps
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="optimizer steps", unit="step")
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    pending: list = []  # (loss, tokens) of each step, read after the run: no wait per step
    try:
        for batch, last in _with_last(batches):
            if not isinstance(batch, tuple | list) or len(batch) != 2:
                raise ValueError(f"batches must yield (inputs, targets) pairs, got "
                                 f"{type(batch).__name__}")
            inputs, targets = batch
            check_batch(model, inputs, targets, names=("batches' inputs", "batches' targets"),
                        ignore_index=ignore_index)
            n = inputs.size(0)
            if targets.size(0) != n or n > batch_size or (n < batch_size and not last) or n == 0:
                raise ValueError(f"each batch must hold micro_batch_size * accumulation_steps = "
                                 f"{batch_size} samples (the last one of the run may hold fewer), "
                                 f"got {n}")
            device_type = inputs.device.type
            if auto_scaler:
                grad_scaler, auto_scaler = make_grad_scaler(device_type), False
            pieces = list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))
            window = len(pieces)  # K, or fewer in a last partial window: each piece weighs 1/window
            total = (targets != ignore_index).sum()
            if total.device.type == "cpu":  # free to read here; on a GPU it would wait for the device
                total = int(total)
                if total == 0 and normalize == "tokens":  # refused before this batch changes anything
                    raise ValueError(f"batches must hold at least one target token per batch (a "
                                     f"target other than ignore_index={ignore_index}), got one with none")
            else:  # a batch without tokens adds zero gradients instead of NaN
                total = total.clamp_min(1)
            step_loss = 0.0
            for k, (x, y) in enumerate(pieces):
                # DDP: forward and backward of all micro-batches but the last skip the all-reduce.
                sync = model.no_sync() if no_sync and k < window - 1 else contextlib.nullcontext()
                with sync:
                    with (torch.autocast(device_type, dtype=amp_dtype) if amp_dtype
                          else contextlib.nullcontext()):
                        loss = micro_batch_loss(model, x, y, normalize=normalize, total_tokens=total,
                                                accumulation_steps=window, ignore_index=ignore_index)
                    (grad_scaler.scale(loss) if grad_scaler else loss).backward()
                step_loss = step_loss + loss.detach()
                log.micro_steps += 1
            skipped = False
            prepare = getattr(optimizer, "prepare_grads", None)
            if callable(prepare):  # mixed precision: fp32 master gradients, for clipping and unscaling
                prepare()
            if grad_scaler is not None:
                if max_grad_norm is not None:
                    grad_scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                # step() reads found_inf on the host anyway (to skip or not): reading the scale
                # around it adds no wait for the device
                scale = grad_scaler.get_scale()
                grad_scaler.step(optimizer)  # unscales (if not done), skips on inf/nan
                grad_scaler.update()
                skipped = grad_scaler.get_scale() < scale
                log.scales.append(grad_scaler.get_scale())
            else:
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append((step_loss, total))  # read once, after the run: no wait per step
            log.micro_batches.append(window)
            log.skipped.append(skipped)
            if progress or on_step is not None:  # asked for the loss now: the host waits for it
                value = float(step_loss)
                if progress:
                    batches.set_postfix(loss=f"{value:.4f}")
                if on_step is not None:
                    on_step(len(log.micro_batches), value)
    finally:  # steps taken before an error are logged too
        if pending:
            losses, tokens = zip(*pending)
            log.losses += torch.stack(losses).tolist()
            log.tokens += [int(t) for t in tokens]
    log.seconds += time.perf_counter() - start
    return log


def _with_last(items: Iterable):
    """``(item, is_last)`` for each item, looking one ahead (works on generators too)."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def batches_of(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, *,
               drop_last: bool = True):
    """The consecutive ``(inputs, targets)`` batches of ``batch_size``.

    Args:
        inputs (torch.Tensor): the samples along dimension 0.
        targets (torch.Tensor): their targets, along dimension 0.
        batch_size (int): samples per batch.
        drop_last (bool): drop a remainder of fewer than ``batch_size`` samples (the default, as
            ``torch.utils.data.DataLoader(drop_last=True)``); with False it is a last, shorter
            batch: the last partial window that :func:`train` weights by what it holds.

    Returns:
        list of tuple: ``[(inputs_i, targets_i), ...]``, slices (views) of the tensors.

    Raises:
        ValueError: if ``inputs`` or ``targets`` is not a tensor, they hold different numbers
            of samples, ``batch_size`` is not a positive int, ``drop_last`` not a bool, or no
            whole batch fits while ``drop_last`` is True.
    """
    batch_size = positive_int("batch_size", batch_size)
    if not isinstance(drop_last, bool):
        raise WrongTypeError(f"drop_last must be True or False, got {drop_last!r}")
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ValueError(f"{name} must be a tensor of samples along dimension 0, got "
                             f"{type(value).__name__}")
    if targets.size(0) != inputs.size(0):
        raise ValueError(f"targets must hold one target per sample: {inputs.size(0)} inputs, "
                         f"{targets.size(0)} targets")
    total = inputs.size(0)
    n = total // batch_size if drop_last else -(-total // batch_size)
    if n == 0:
        raise ValueError(f"batch_size must be at most the {total} samples, got {batch_size}")
    return [(inputs[i * batch_size:(i + 1) * batch_size], targets[i * batch_size:(i + 1) * batch_size])
            for i in range(n)]
