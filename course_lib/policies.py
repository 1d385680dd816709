"""05: op-level checkpoint policies, and what a policy really keeps and recomputes.

Selective activation checkpointing (``torch.utils.checkpoint`` with
``context_fn=functools.partial(create_selective_checkpoint_contexts, policy)``)
decides op by op, at the ``aten`` level, whether the output of an op inside a
checkpointed region is saved during the forward pass or recomputed during the
backward pass. A policy is either a list of ops to save or a function
``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``. Two facts bite:

* ``op`` is an ``OpOverload`` (``torch.ops.aten.addmm.default``), never an
  ``OpOverloadPacket`` (``torch.ops.aten.addmm``): a list entry must be an
  overload (PyTorch rejects packets), and a policy function comparing ``op``
  with a packet never matches, silently;
* ``nn.Linear`` with a bias dispatches ``aten.addmm``, not ``aten.mm`` (without a
  bias, ``mm``; batched ``q @ k^T`` dispatches ``bmm``), so a policy that saves
  only ``aten.mm.default`` saves nothing in a model whose linears have biases.

:func:`dispatched_ops` shows what a piece of code dispatches; :func:`policy_cost`
measures what a policy keeps, its peak, and which ops run again in the backward.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)
from torch.utils.flop_counter import flop_registry

# The matmuls and the op check are checkpointing's (its selective mode keeps the matmuls).
from .checkpointing import MATMULS as MATMULS
from .checkpointing import check_ops
from .measure import LiveTensorTracker

_aten = torch.ops.aten
#: ``policy_cost`` policies given by name: no checkpoint, or a checkpoint that saves nothing.
NAMED_POLICIES = ("none", "full")


def save_ops_policy(ops: Sequence) -> Callable:
    """A policy function that saves the outputs of ``ops`` and prefers to recompute the rest.

    ``MUST_SAVE`` for them, ``PREFER_RECOMPUTE`` for every other op (pointwise ops, LayerNorm,
    softmax).

    Args:
        ops (sequence): ``OpOverload`` s such as :data:`MATMULS`.

    Returns:
        callable: ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``, with the saved ops
        in its ``ops`` attribute.

    Raises:
        ValueError: naming ``ops``, for a packet or anything but ``OpOverload`` s
            (:func:`course_lib.checkpointing.check_ops`).
    """
    saved = frozenset(check_ops(ops))

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    policy.ops = tuple(saved)
    return policy


def context_fn_for(policy) -> Callable:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for ``policy``.

    Args:
        policy: ``"full"``: plain checkpointing (nothing saved inside the region); a list of
            ``OpOverload`` s or a policy function: selective checkpointing.

    Returns:
        callable: ``noop_context_fn`` or a ``create_selective_checkpoint_contexts`` partial.

    Raises:
        ValueError: naming ``policy``, for a list holding anything but ``OpOverload`` s.
    """
    if isinstance(policy, str) and policy == "full":
        return noop_context_fn
    if not callable(policy):
        policy = list(check_ops(policy, "policy"))
    return functools.partial(create_selective_checkpoint_contexts, policy)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, and their FLOPs by ``FlopCounterMode``'s rules.

    (``FlopCounterMode`` itself cannot run during a selective-checkpoint backward: it
    breaks the op order the checkpoint replays. Its per-op formulas only read shapes.)
    """

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops[func] += 1
        count = flop_registry.get(func.overloadpacket)
        if count is not None:
            self.flops += count(*args, **kwargs, out_val=out)
        return out


def dispatched_ops(fn: Callable, *args, **kwargs) -> Counter:
    """``Counter`` of the ``OpOverload`` s that ``fn(*args, **kwargs)`` dispatches, in order seen.

    ``dispatched_ops(nn.Linear(8, 16), x)`` holds ``aten.addmm.default``:
    that is the name a policy must use.

    Args:
        fn (callable): the work.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        collections.Counter: ``OpOverload`` -> times dispatched.

    Raises:
        ValueError: naming ``fn``, if it is not callable.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r}")
    with _OpCounter() as counter:
        fn(*args, **kwargs)
    return counter.ops


def _is_bookkeeping(op) -> bool:
    # Views and detaches allocate nothing and compute nothing: leave them out of "recomputed".
    return op.is_view or op.overloadpacket in (_aten.detach, _aten.t, _aten.transpose)


@dataclass(frozen=True)
class PolicyCost:
    """What running ``fn`` under a checkpoint policy costs, measured (bytes, FLOPs, op counts).

    Attributes:
        policy (str): the policy's label (:func:`policy_name`).
        kept_bytes (int): held from the end of the forward pass until the backward pass,
            the output itself not counted (its activations, or under checkpointing the
            inputs and whatever the policy saves).
        peak_bytes (int): peak of forward plus backward above what was live before.
        recomputed (collections.Counter): the ops that run again in the backward pass (views
            left out), ``OpOverload`` -> count.
        recompute_flops (int): their FLOPs as ``FlopCounterMode`` counts them (matmuls and
            attention; pointwise ops count 0).
    """

    policy: str
    kept_bytes: int
    peak_bytes: int
    recomputed: Counter
    recompute_flops: int

    def recomputes(self, op) -> int:
        """How many times ``op`` (an OpOverload) runs again in the backward pass.

        Args:
            op (torch._ops.OpOverload): such as ``torch.ops.aten.mm.default``.

        Returns:
            int: the count (0 if it is not rerun).
        """
        return self.recomputed.get(op, 0)


def _run(fn, inputs, context_fn):
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(fn, nn.Module):
        wrt += [p for p in fn.parameters() if p.requires_grad]
    if not wrt:
        raise ValueError("inputs or fn's parameters must require grad: nothing to differentiate")
    with LiveTensorTracker() as tracker:
        if context_fn is None:
            out = fn(*inputs)
        else:
            out = checkpoint(fn, *inputs, use_reentrant=False, context_fn=context_fn)
        if not isinstance(out, torch.Tensor) or out.grad_fn is None:
            raise ValueError("fn must return a tensor that requires grad")
        kept = tracker.live - out.untyped_storage().nbytes()
        # Start from empty .grad so that every run allocates the same; restore the learner's after.
        before = [t.grad for t in wrt]
        for t in wrt:
            t.grad = None
        try:
            with _OpCounter() as counter:
                out.sum().backward()
        finally:
            for t, grad in zip(wrt, before):
                t.grad = grad
    return kept, tracker.peak, counter.ops, counter.flops


def policy_name(policy) -> str:
    """A short label: "none", "full", the saved ops' names, or the policy function's name.

    Args:
        policy: a str, a policy function or a list of ``OpOverload`` s.

    Returns:
        str: the label.

    Raises:
        ValueError: naming ``policy``, for a list holding anything but ``OpOverload`` s.
    """
    if isinstance(policy, str):
        return policy
    if callable(policy):
        return getattr(policy, "__name__", type(policy).__name__)
    return "save " + ", ".join(str(op) for op in check_ops(policy, "policy"))


def policy_cost(fn: Callable, *inputs, policy="none") -> PolicyCost:
    """Measure ``fn(*inputs)`` (forward, then backward of ``out.sum()``) under ``policy``.

    The recomputed ops and FLOPs are the backward pass's minus those of the same backward
    without a checkpoint, so ``fn`` runs twice. Bytes come from the live-tensor tracker
    (:class:`course_lib.measure.LiveTensorTracker`), exact on every device.

    Args:
        fn (callable): the region, ``fn(*inputs)`` returns a tensor.
        *inputs: its inputs.
        policy: ``"none"`` (no checkpoint), ``"full"`` (checkpoint, save nothing
            inside), a list of ``OpOverload`` s to save, or a policy function
            ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``.

    Returns:
        PolicyCost: kept and peak bytes, recomputed ops and their FLOPs.

    Raises:
        ValueError: naming ``fn`` (not callable) or ``policy`` (an unknown name, or a list of
            anything but ``OpOverload`` s).
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r}")
    if isinstance(policy, str) and policy not in NAMED_POLICIES:
        raise ValueError(f"policy must be one of {NAMED_POLICIES}, a list of OpOverloads "
                         f"or a policy function, got {policy!r}")
    plain = _run(fn, inputs, None)
    if isinstance(policy, str) and policy == "none":
        return PolicyCost("none", plain[0], plain[1], Counter(), 0)
    kept, peak, ops, flops = _run(fn, inputs, context_fn_for(policy))
    recomputed = Counter({op: n for op, n in (ops - plain[2]).items() if not _is_bookkeeping(op)})
    return PolicyCost(policy_name(policy), kept, peak, recomputed, flops - plain[3])
