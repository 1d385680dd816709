"""The training loop the lectures share: micro-batches, accumulation, mixed precision, DDP.

:func:`train` takes one optimizer step per batch of ``micro_batch_size * accumulation_steps``
samples: the micro-batches run forward and backward one after the other, weighted by
:func:`course_lib.training.accumulation.micro_batch_loss`. With fp16 a ``GradScaler`` scales every
micro-batch's loss and unscales, steps and updates once per effective batch (Micikevicius et al.
2018; PyTorch's AMP examples, "Gradient accumulation"); ``no_sync`` all-reduces once per step.

An epoch's last partial window (:func:`batches_of` with ``drop_last=False``) is weighted by what
it holds: dividing by ``K`` there scales its gradient by ``k / K``, a bug reported against PyTorch
Lightning (#19987) and fixed in Hugging Face's Trainer (#39659, 2025).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from course_lib.model.gpt import check_batch
from course_lib.training.accumulation import INT64, NORMALIZATIONS, micro_batch_loss
from course_lib.validation import MAX_COUNT, WrongTypeError, choice, integer, number, positive_int

#: The autocast dtypes :func:`train` takes (None: no autocast).
AMP_DTYPES = (None, torch.float16, torch.bfloat16)
_END = object()  # after the last batch: train looks one batch ahead, to know the last one


def make_grad_scaler(device_type: str = "cuda", **kwargs):
    """``torch.amp.GradScaler(device_type, **kwargs)``, ``device_type`` ``"cuda"`` or ``"cpu"``.
    Args:
        device_type (str): ``"cuda"`` or ``"cpu"``.
        **kwargs: ``torch.amp.GradScaler``'s other arguments.
    Returns:
        torch.amp.GradScaler: the scaler.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    return torch.amp.GradScaler(device_type, **kwargs)


@dataclass
class _TrainLog:
    """What :func:`train` did: one entry per optimizer step (losses are Python floats)."""

    losses: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)  # K, or fewer in a last window
    skipped: list[bool] = field(default_factory=list)  # the GradScaler found an inf or NaN
    scales: list[float] = field(default_factory=list)  # the GradScaler's scale after each step
    micro_steps: int = 0
    seconds: float = 0.0  # wall-clock, summed over calls

    @property
    def steps(self) -> int:
        """Optimizer steps taken or skipped: one per effective batch."""
        return len(self.losses)


def train(model: nn.Module, optimizer: torch.optim.Optimizer,
          batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, micro_batch_size: int,
          accumulation_steps: int = 1, normalize: str = "tokens", ignore_index: int = -100,
          amp_dtype: torch.dtype | None = None, grad_scaler="auto", no_sync: bool = False,
          max_grad_norm: float | None = None, progress: bool = False,
          on_step: Callable[[int, float], None] | None = None,
          log: _TrainLog | None = None) -> _TrainLog:
    """One optimizer step per ``(inputs, targets)`` batch of ``micro_batch_size * accumulation_steps``.

    Only the last batch may hold fewer samples: it is cut into ``ceil(n / micro_batch_size)``
    micro-batches and gets the mean gradient of its own samples. With ``"tokens"`` each batch
    divides by its own token count (under DDP, each rank by its own).

    Args:
        model (torch.nn.Module): gives logits, or a tuple of them first.
        optimizer (torch.optim.Optimizer): a ``MasterWeightAdamW`` gets its ``prepare_grads``
            called before clipping and unscaling.
        batches (iterable): ``(inputs, targets)`` pairs, such as :func:`batches_of` gives.
        micro_batch_size (int): samples per micro-batch.
        accumulation_steps (int): micro-batches per optimizer step.
        normalize (str): one of :data:`course_lib.training.accumulation.NORMALIZATIONS`.
        ignore_index (int): the target value that is not a token.
        amp_dtype (torch.dtype, optional): ``torch.autocast`` in ``float16`` or ``bfloat16``.
        grad_scaler: ``"auto"`` (one for fp16, :func:`make_grad_scaler`), your own ``GradScaler``,
            or ``None`` (none, even in fp16). A step is skipped when the scaler lowers its scale.
        no_sync (bool): skip DDP's all-reduce on all micro-batches but the last.
        max_grad_norm (float, optional): clip the true (unscaled, fp32) gradients' norm to it.
        progress (bool): show a progress bar with the loss.
        on_step (callable, optional): ``on_step(step, loss)`` after each optimizer step.
        log (optional): the log of an earlier call, to continue a run.

    Returns:
        The log: ``losses``, ``tokens``, ``micro_batches``, ``skipped``, ``scales`` (per step),
        ``steps``, ``micro_steps`` and ``seconds``.

    Raises:
        ValueError: naming the parameter, for a bad value.
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
    ignore_index = integer("ignore_index", ignore_index, minimum=INT64[0], maximum=INT64[1])
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
    log = _TrainLog() if log is None else log
    batch_size = micro_batch_size * accumulation_steps
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="optimizer steps", unit="step")
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    pending: list = []  # (loss, tokens) of each step, read after the run: no wait per step
    try:
        for batch, following in itertools.pairwise(itertools.chain(batches, [_END])):
            last = following is _END
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
            if max_grad_norm is not None:
                if grad_scaler is not None:
                    grad_scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            if grad_scaler is not None:
                # step() reads found_inf on the host anyway (to skip or not): reading the scale
                # around it adds no wait for the device
                scale = grad_scaler.get_scale()
                grad_scaler.step(optimizer)  # unscales (if not done), skips on inf/nan
                grad_scaler.update()
                skipped = grad_scaler.get_scale() < scale
                log.scales.append(grad_scaler.get_scale())
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append((step_loss, total))
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


def batches_of(inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, *,
               drop_last: bool = True):
    """``[(inputs_i, targets_i), ...]``: the consecutive batches of ``batch_size`` along dim 0 (views).

    ``drop_last`` drops a shorter remainder (as ``DataLoader(drop_last=True)``); with False it is
    the last partial window that :func:`train` weights by what it holds.
    Args:
        inputs, targets (torch.Tensor): ``(B, ...)`` token ids and target ids.
        batch_size (int): samples per batch.
        drop_last (bool): drop a shorter remainder.
    Returns:
        list: ``(inputs, targets)`` pairs.
    Raises:
        ValueError: naming the parameter, for a bad value.
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
