"""Gradient accumulation: one batch's gradient, computed micro-batch by micro-batch.

A batch of ``B`` samples is cut into ``K = B / b`` micro-batches whose gradients add up before one
optimizer step, so activation memory follows ``b``, not ``B``. The sum is the full batch's
gradient only if each micro-batch's loss carries the right weight (``normalize``):

* ``"tokens"`` (correct): each micro-batch's summed token loss over ``N``, the batch's tokens;
* ``"mean-of-means"``: each micro-batch's mean over ``K``: with padding it over-weights short
  micro-batches (Hugging Face ``transformers``' Trainer until v4.46, pull request #34191);
* ``"sum-of-means"``: the means summed, the division by ``K`` forgotten: ``K`` times too large.

The losses are cross-entropy over ``model(inputs)`` logits (a tuple's first item); a course GPT on
the chunked loss (:func:`course_lib.training.levers.use_chunked_loss`) gives its own mean.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.gpt import check_batch
from course_lib.validation import WrongTypeError, choice, integer, positive_int, tensor

#: How a loss over micro-batches is normalised: by tokens (right), or two of the bugs.
NORMALIZATIONS = ("tokens", "mean-of-means", "sum-of-means")
#: Token ids and ``ignore_index`` are int64 values.
INT64 = (-(2**63), 2**63 - 1)


def _token_id(name: str, value) -> int:
    """An int64 token id or ``ignore_index`` (a bool, a float or 2**63 is refused)."""
    return integer(name, value, minimum=INT64[0], maximum=INT64[1])


def _check_model(model) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable ``(name, parameter)`` pairs (a tied weight once)."""
    if not isinstance(model, nn.Module):
        raise WrongTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """``model(inputs)``, or its first item."""
    out = model(inputs)
    return out[0] if isinstance(out, tuple | list) else out


def token_counts(targets: torch.Tensor, micro_batch_size: int, ignore_index: int = -100) -> list[int]:
    """``[n_0, ..., n_{K-1}]``: the non-ignored targets of each micro-batch (one device sync).

    Args:
        targets (torch.Tensor): ``(B, ...)`` integer targets.
        micro_batch_size (int): samples per micro-batch; must divide ``B``.
        ignore_index (int): the target value that is not a token.
    Returns:
        list: the tokens of each micro-batch.
    Raises:
        ValueError: naming the parameter, for a bad value.
    Example:
        >>> token_counts(torch.tensor([[1, -100], [2, 3]]), 1)
        [1, 2]
    """
    tensor("targets", targets, integral=True)
    if targets.dim() == 0:
        raise ValueError("targets must have a batch dimension, got a 0-d tensor")
    micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
    ignore_index = _token_id("ignore_index", ignore_index)
    if targets.size(0) % micro_batch_size:
        raise ValueError(f"micro_batch_size must divide the batch size {targets.size(0)}, "
                         f"got {micro_batch_size}")
    kept = (targets != ignore_index).reshape(targets.size(0) // micro_batch_size, -1)
    return kept.sum(dim=1).tolist()


def micro_batch_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                     normalize: str = "tokens", total_tokens: int | None = None,
                     accumulation_steps: int = 1, ignore_index: int = -100) -> torch.Tensor:
    """The share of checked arguments whose ``backward()`` adds this micro-batch's gradient:
    ``S_k / N`` (``"tokens"``), ``(S_k / n_k) / K`` (``"mean-of-means"``) or ``S_k / n_k``."""
    if getattr(model, "loss_chunk", None) is not None:  # no (N, V) logits: the model's own mean
        mean = model(inputs, targets, ignore_index=ignore_index)[1]
        summed = mean * (targets != ignore_index).sum()
    else:
        logits = _logits(model, inputs)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        summed = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                 ignore_index=ignore_index, reduction="sum")
    if normalize == "tokens":
        return summed / total_tokens
    n_k = int((targets != ignore_index).sum())
    if n_k == 0:
        raise ValueError(f"a micro-batch holds no target tokens: its mean loss is 0/0 "
                         f"(normalize={normalize!r}); use normalize='tokens'")
    mean = summed / n_k
    return mean / accumulation_steps if normalize == "mean-of-means" else mean


def accumulated_gradients(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                          micro_batch_size: int, *, normalize: str = "tokens",
                          ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """``{parameter name: gradient}`` of the whole batch's loss, computed micro-batch by micro-batch.

    ``K = B / micro_batch_size`` forward and backward passes, each weighted as ``normalize`` (one of
    :data:`NORMALIZATIONS`) says; with ``"tokens"`` the result is the full batch's gradient (to
    float rounding). ``model(inputs)`` returns logits (or a tuple of them first); ``.grad`` is
    untouched; unused parameters get zeros, frozen ones are left out, a tied weight appears once.
    Args:
        model (torch.nn.Module): gives logits, or a tuple of them first, from ``model(inputs)``.
        inputs, targets (torch.Tensor): ``(B, ...)`` token ids and target ids.
        micro_batch_size (int): samples per micro-batch; must divide ``B``.
        normalize (str): one of :data:`NORMALIZATIONS`.
        ignore_index (int): the target value that is not a token.
    Returns:
        dict: parameter name -> gradient.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    named = _check_model(model)
    choice("normalize", normalize, NORMALIZATIONS)
    ignore_index = _token_id("ignore_index", ignore_index)
    check_batch(model, inputs, targets, ignore_index=ignore_index)
    micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
    total = sum(token_counts(targets, micro_batch_size, ignore_index))
    micro_batches = list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))
    if total == 0:
        raise ValueError("targets must hold at least one token that is not ignore_index")
    grads = {name: torch.zeros_like(p) for name, p in named}
    for x, y in micro_batches:
        loss = micro_batch_loss(model, x, y, normalize=normalize, total_tokens=total,
                                accumulation_steps=len(micro_batches), ignore_index=ignore_index)
        parts = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (name, _), g in zip(named, parts):
            if g is not None:
                grads[name] += g
    return grads


def full_batch_gradients(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """The reference: ``{name: gradient}`` of the mean token loss of one forward pass over the batch.

    Written independently of :func:`micro_batch_loss` (``F.cross_entropy``'s mean); ``.grad`` is
    untouched, parameters that take no part get zeros.
    Args:
        model (torch.nn.Module): gives logits, or a tuple of them first, from ``model(inputs)``.
        inputs, targets (torch.Tensor): ``(B, ...)`` token ids and target ids.
        ignore_index (int): the target value that is not a token.
    Returns:
        dict: parameter name -> gradient.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    named = _check_model(model)
    ignore_index = _token_id("ignore_index", ignore_index)
    check_batch(model, inputs, targets, ignore_index=ignore_index)
    if not bool((targets != ignore_index).any()):  # the mean over no token is NaN, not 0
        raise ValueError(f"targets must hold at least one token that is not ignore_index "
                         f"({ignore_index})")
    logits = _logits(model, inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).to(torch.promote_types(
        logits.dtype, torch.float32)), targets.reshape(-1), ignore_index=ignore_index)
    parts = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(named, parts)}


def _same_names(a: dict, b: dict) -> None:
    """Two non-empty ``{name: tensor}`` dicts with the same names and shapes."""
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, dict) or not all(isinstance(t, torch.Tensor)
                                                  for t in value.values()):
            raise ValueError(f"{name} must be a dict of tensors, got {type(value).__name__}")
        if not value:
            raise ValueError(f"{name} must hold at least one tensor, got an empty dict")
    if set(a) != set(b):
        raise ValueError(f"a and b must have the same names, differ in {sorted(set(a) ^ set(b))}")
    mismatched = [k for k in a if a[k].shape != b[k].shape]
    if mismatched:  # broadcasting would compare other numbers than the ones named
        k = mismatched[0]
        raise ValueError(f"a and b must hold tensors of the same shape, differ at {k!r}: "
                         f"{tuple(a[k].shape)} and {tuple(b[k].shape)}")


def _max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max |a - b|`` over two ``{name: tensor}`` dicts, in fp64; NaN if any difference is NaN."""
    _same_names(a, b)
    # Python's max() would drop a NaN that does not come first (NaN > x is False): NaN wins here
    gaps = [(a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel()]
    return math.nan if any(math.isnan(g) for g in gaps) else max(gaps, default=0.0)


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over two ``{name: tensor}`` dicts of the same names and shapes, as
    one flattened vector each, in fp64 (``b`` is the reference).
    Args:
        a, b (dict): parameter name -> tensor; ``b`` is the reference.
    Returns:
        float: the relative difference.
    """
    _same_names(a, b)
    diff = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a) ** 0.5
    norm = sum((b[k].double() ** 2).sum() for k in b) ** 0.5
    return float(diff / norm)


def pad_to_lengths(inputs: torch.Tensor, targets: torch.Tensor, lengths, *, pad_token: int = 0,
                   ignore_index: int = -100):
    """Padded copies of ``(B, T)`` ``(inputs, targets)``: row ``i`` keeps its first ``lengths[i]``.

    The rest gets ``pad_token`` as input and ``ignore_index`` as target, as a data collator pads
    documents of different lengths (``lengths``: ``B`` ints in ``[0, T]``, a list or a tensor).

    Args:
        inputs, targets (torch.Tensor): ``(B, T)`` token ids and target ids.
        lengths (list or torch.Tensor): ``B`` ints in ``[0, T]``, the tokens each row keeps.
        pad_token (int): the input id of a padded position.
        ignore_index (int): the target of a padded position.
    Returns:
        tuple: the padded ``(inputs, targets)``, new tensors.
    Raises:
        ValueError: naming the parameter, for a bad value.
    Example:
        >>> inputs, targets = torch.arange(8).reshape(2, 4), torch.arange(1, 9).reshape(2, 4)
        >>> x, y = pad_to_lengths(inputs, targets, [4, 2])
        >>> x
        tensor([[0, 1, 2, 3],
                [4, 5, 0, 0]])
        >>> y
        tensor([[   1,    2,    3,    4],
                [   5,    6, -100, -100]])
    """
    tensor("inputs", inputs, integral=True)
    tensor("targets", targets, integral=True)
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise ValueError(f"inputs and targets must be (B, T) of the same shape, got "
                         f"{tuple(inputs.shape)} and {tuple(targets.shape)}")
    pad_token = _token_id("pad_token", pad_token)
    ignore_index = _token_id("ignore_index", ignore_index)
    B, T = inputs.shape
    if isinstance(lengths, torch.Tensor):
        tensor("lengths", lengths, integral=True, dim=1)
        lengths = lengths.tolist()
    if isinstance(lengths, str | bytes) or not hasattr(lengths, "__len__") or len(lengths) != B:
        raise ValueError(f"lengths must hold {B} ints in [0, {T}], got {lengths!r}")
    lengths = [integer("lengths", n, minimum=0, maximum=T) for n in lengths]
    lengths = torch.tensor(lengths, device=inputs.device, dtype=torch.long)
    pad = torch.arange(T, device=inputs.device)[None, :] >= lengths[:, None]
    return inputs.masked_fill(pad, pad_token), targets.masked_fill(pad, ignore_index)


def weight_gap(a: nn.Module, b: nn.Module) -> float:
    """``max |w_a - w_b|`` over the parameters of two models of the same names and shapes, in fp64
    (NaN if a difference is NaN): how far apart two runs from the same weights ended.
    Args:
        a, b (torch.nn.Module): two models with parameters of the same names and shapes.
    Returns:
        float: the largest absolute difference of any weight.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    named = {}
    for name, model in (("a", a), ("b", b)):
        if not isinstance(model, nn.Module):
            raise WrongTypeError(f"{name} must be a torch.nn.Module, got {type(model).__name__}")
        named[name] = {n: p.detach() for n, p in model.named_parameters()}
        if not named[name]:
            raise ValueError(f"{name} must have parameters, got none")
    shapes = [{n: tuple(p.shape) for n, p in named[k].items()} for k in ("a", "b")]
    if shapes[0] != shapes[1]:
        raise ValueError("a and b must have parameters of the same names and shapes")
    return _max_abs_difference(named["a"], named["b"])


#: The ``GradScaler`` methods :func:`count_scaler_calls` counts.
SCALER_METHODS = ("scale", "unscale_", "step", "update")


def count_scaler_calls(scaler) -> dict[str, int]:
    """Count, from now on, how often a training loop calls ``scaler``'s methods.

    Wraps :data:`SCALER_METHODS` of this one ``GradScaler`` in place; returns ``{method: calls}``,
    updated as the loop runs. With accumulation a right loop scales every micro-batch's loss and
    unscales, steps and updates once per effective batch (PyTorch's AMP examples).

    Args:
        scaler (torch.amp.GradScaler): the scaler the loop uses (anything with the four methods).
    Returns:
        dict: method name -> calls so far.
    Raises:
        ValueError: naming the parameter, for a bad value.
    Example:
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> calls = count_scaler_calls(scaler)
        >>> loss = scaler.scale(torch.ones(()))
        >>> calls
        {'scale': 1, 'unscale_': 0, 'step': 0, 'update': 0}
    """
    missing = [m for m in SCALER_METHODS if not callable(getattr(scaler, m, None))]
    if missing:
        raise ValueError(f"scaler must be a GradScaler (with {', '.join(SCALER_METHODS)}), "
                         f"got {type(scaler).__name__} without {', '.join(missing)}")
    calls = dict.fromkeys(SCALER_METHODS, 0)
    for name in SCALER_METHODS:
        method = getattr(scaler, name)

        def counted(*args, _name=name, _method=method, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)

        setattr(scaler, name, counted)
    return calls
