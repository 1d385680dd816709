"""05: op-level checkpoint policies, and what a policy really keeps and recomputes.

A selective-checkpointing policy decides op by op, at the ``aten`` level, whether an output inside
a checkpointed region is saved or recomputed. Two facts bite: ``op`` is an ``OpOverload``
(``aten.addmm.default``), never a packet (``aten.addmm``), so a policy comparing with a packet
never matches; ``nn.Linear`` with a bias dispatches ``addmm``, not ``mm``. :func:`policy_cost`
measures what a policy keeps and reruns. The saved ops, :data:`KERNEL_POLICIES` and
:class:`SelectiveContext` are :mod:`course_lib.training.checkpointing`'s.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)
from torch.utils.flop_counter import flop_registry

from course_lib.measurement.memory import LiveTensorTracker
from course_lib.training.checkpointing import (
    ATTENTION_OPS as ATTENTION_OPS,
    BLOCK_LINEARS as BLOCK_LINEARS,
    KERNEL_OPS as KERNEL_OPS,
    KERNEL_POLICIES as KERNEL_POLICIES,
    LINEAR_OPS as LINEAR_OPS,
    MATMULS as MATMULS,
    SAVE_OPS as SAVE_OPS,
    SelectiveContext as SelectiveContext,
    check_policy,
)
from course_lib.validation import WrongTypeError

_aten = torch.ops.aten
#: ``policy_cost`` policies given by name: no checkpoint, or a checkpoint that saves nothing.
NAMED_POLICIES = ("none", "full")


def _context_fn_for(policy) -> Callable:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for a checked ``policy``."""
    if isinstance(policy, str):  # "full"
        return noop_context_fn
    if isinstance(policy, SelectiveContext):
        return policy
    return functools.partial(create_selective_checkpoint_contexts,
                             policy if callable(policy) else list(policy))


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active and their FLOPs by ``FlopCounterMode``'s rules
    (which cannot run in a selective-checkpoint backward: it breaks the replayed op order)."""

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


@dataclass(frozen=True)
class _PolicyCost:
    """What running ``fn`` under a checkpoint policy costs, measured (bytes, FLOPs, op counts)."""

    policy: str
    kept_bytes: int
    peak_bytes: int
    recomputed: Counter
    recompute_flops: int

    def recomputes(self, op) -> int:
        """How many times ``op`` (an OpOverload) runs again in the backward pass."""
        return self.recomputed.get(op, 0)

    def reruns(self) -> str:
        """What runs again in the backward pass, in words: matmuls, attention kernel, the rest."""
        matmuls = sum(self.recomputes(op) for op in MATMULS)
        parts = [f"{matmuls} matmul{'s' * (matmuls != 1)}"] if matmuls else []
        parts += ["attention"] if any(self.recomputes(op) for op in ATTENTION_OPS) else []
        parts += sorted({str(op).split(".")[1].removeprefix("native_").removeprefix("_")
                         for op in self.recomputed if op not in MATMULS + ATTENTION_OPS})
        return ", ".join(parts) or "nothing"


def _run(fn, inputs, context_fn):
    """Kept bytes, peak bytes, backward ops and FLOPs of ``fn(*inputs)`` and ``out.sum()``'s
    backward, under ``context_fn`` (None: no checkpoint)."""
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(fn, nn.Module):
        wrt += [p for p in fn.parameters() if p.requires_grad]
    if not wrt:
        raise ValueError("inputs or fn's parameters must require grad: nothing to differentiate")
    with LiveTensorTracker() as tracker:
        out = (fn(*inputs) if context_fn is None
               else checkpoint(fn, *inputs, use_reentrant=False, context_fn=context_fn))
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


def _policy_name(policy) -> str:
    """A short label: "none", "full", the saved ops' names, or the policy function's name."""
    if isinstance(policy, str | SelectiveContext):
        return str(policy)
    policy = check_policy(policy)
    if callable(policy):
        return getattr(policy, "__name__", type(policy).__name__)
    return "save " + ", ".join(str(op) for op in policy)


def policy_cost(fn: Callable, *inputs, policy="none") -> _PolicyCost:
    """Measure ``fn(*inputs)`` (forward, then backward of ``out.sum()``) under ``policy``.

    The recomputed ops and FLOPs are the backward pass's minus those of the same backward without a
    checkpoint (``fn`` runs twice); bytes come from the live-tensor tracker, exact on every device.

    Args:
        fn (callable): what to measure, on ``inputs``.
        policy: ``"none"`` (no checkpoint), ``"full"`` (save nothing inside), a list of
            ``OpOverload`` s to save, a policy function, or a :class:`SelectiveContext`.
    Returns:
        the cost: ``kept_bytes``, ``peak_bytes``, ``recomputed`` (a ``Counter`` of ops),
        ``recompute_flops``, ``recomputes(op)`` and ``reruns()`` (in words).
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    if not callable(fn):
        raise WrongTypeError(f"fn must be callable, got {fn!r}")
    if isinstance(policy, str) and policy not in NAMED_POLICIES:
        raise ValueError(f"policy must be one of {NAMED_POLICIES}, a list of OpOverloads "
                         f"or a policy function, got {policy!r}")
    label = _policy_name(policy)  # checks a list, or one op alone, before fn runs
    plain = _run(fn, inputs, None)
    if isinstance(policy, str) and policy == "none":
        return _PolicyCost("none", plain[0], plain[1], Counter(), 0)
    kept, peak, ops, flops = _run(fn, inputs, _context_fn_for(policy))
    recomputed = Counter({op: n for op, n in (ops - plain[2]).items() if _moves_bytes(op)})
    return _PolicyCost(label, kept, peak, recomputed, flops - plain[3])


# Ops that relabel or allocate a storage without reading or writing its bytes, although PyTorch
# does not mark them as views (``_unsafe_view`` is the reshape of a matmul's output).
_METADATA_OPS = tuple(getattr(_aten, name).default for name in (
    "_unsafe_view", "_reshape_alias", "alias", "lift_fresh", "empty_like", "new_empty",
    "new_empty_strided") if hasattr(_aten, name)) + (_aten.empty.memory_format,
                                                    _aten.empty_strided.default)


def _moves_bytes(op) -> bool:
    """Whether ``op`` (an ``OpOverload``) reads or writes tensor bytes: not a view or a relabel."""
    return not op.is_view and op not in _METADATA_OPS
