"""Typical wrong answers to the exercises of lecture 05 (see tests/wrong_answers/__init__.py)."""

import torch
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten
_KERNELS = tuple(getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math_for_mps", "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(aten, name))


def _matmuls_only(ctx, op, *args, **kwargs):
    # The fused attention kernel is no matmul: the backward pass reruns it.
    save = op in (aten.mm.default, aten.addmm.default, aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _only_mm(ctx, op, *args, **kwargs):
    save = op == aten.mm.default
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _packets(ctx, op, *args, **kwargs):
    # An OpOverload never equals its packet: this saves nothing, silently.
    save = op in (aten.mm, aten.addmm, aten.bmm) or op in _KERNELS
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _save_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def _inverted(ctx, op, *args, **kwargs):
    save = op not in (aten.mm.default, aten.addmm.default, aten.bmm.default, *_KERNELS)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


_KERNEL = torch.ops.course.bias_dropout_add


def _kernel_packet(ctx, op, *args, **kwargs):
    # The packet torch.ops.course.bias_dropout_add never equals the OpOverload a policy sees.
    return CheckpointPolicy.MUST_SAVE if op == _KERNEL else CheckpointPolicy.PREFER_RECOMPUTE


def _kernel_and_matmuls(ctx, op, *args, **kwargs):
    # The lecture's save-the-kernel policy: keeps the matmuls too, so they are not recomputed.
    save = op in (_KERNEL.default, aten.mm.default, aten.addmm.default, aten.bmm.default, *_KERNELS)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _unfused_dropout(ctx, op, *args, **kwargs):
    # The dropout PyTorch would dispatch without the kernel: inside the kernel, nothing sees it.
    save = op in (aten.native_dropout.default, aten.bernoulli_.float, aten.mul.Tensor)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _kernel_as_bool(ctx, op, *args, **kwargs):
    return op == _KERNEL.default


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _peak(n, k, block, inp, fixed, *, wrapped=None, rebuilt="last"):
    # rebuilt: "last" (the rebuild adds only when the last block is checkpointed), "always", "never"
    wrapped = len(range(0, n, k)) if wrapped is None else wrapped
    on_top = rebuilt == "always" or (rebuilt == "last" and (n - 1) % k == 0)
    return fixed + (n - wrapped) * block + wrapped * inp + (block - inp if on_top else 0)


def _floor_count(n, block, inp, fixed, budget):
    fits = [k for k in range(1, n + 1) if _peak(n, k, block, inp, fixed, wrapped=n // k) <= budget]
    return max(fits) if fits else None


def _no_rebuilt_block(n, block, inp, fixed, budget):
    fits = [k for k in range(1, n + 1) if _peak(n, k, block, inp, fixed, rebuilt="never") <= budget]
    return max(fits) if fits else None


def _rebuilt_whatever_k(n, block, inp, fixed, budget):
    # The rebuilt block is paid only if nothing after it was freed: the last block's rebuild.
    fits = [k for k in range(1, n + 1) if _peak(n, k, block, inp, fixed, rebuilt="always") <= budget]
    return max(fits) if fits else None


def _smallest_every(n, block, inp, fixed, budget):
    fits = [k for k in range(1, n + 1) if _peak(n, k, block, inp, fixed) <= budget]
    return min(fits) if fits else None


def _one_when_nothing_fits(n, block, inp, fixed, budget):
    fits = [k for k in range(1, n + 1) if _peak(n, k, block, inp, fixed) <= budget]
    return max(fits) if fits else 1


def _strict_dominance(points):
    # Drops a point only if another is strictly better on both axes: keeps ties that lose.
    return sorted((p for p in points if not any(q[0] < p[0] and q[1] < p[1] for q in points)),
                  key=lambda p: (p[0], p[1]))


def _unsorted(points):
    front = [p for p in points if not any(
        q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)]
    return sorted(front, key=lambda p: -p[0])


def _extremes_only(points):
    if not points:
        return []
    low_memory = min(points, key=lambda p: (p[0], p[1]))
    fastest = min(points, key=lambda p: (p[1], p[0]))
    return sorted({low_memory, fastest}, key=lambda p: (p[0], p[1]))


WRONG = {
    "check_selective_policy": [
        ("saves aten.mm only: nn.Linear with bias dispatches addmm", {"selective_policy": _only_mm}),
        ("compares the matmuls with OpOverloadPackets", {"selective_policy": _packets}),
        ("saves the matmuls only: reruns the fused attention", {"selective_policy": _matmuls_only}),
        ("saves everything", {"selective_policy": _save_everything}),
        ("saves the pointwise ops and recomputes the matmuls", {"selective_policy": _inverted}),
    ],
    "check_kernel_policy": [
        ("compares with the OpOverloadPacket", {"kernel_policy": _kernel_packet}),
        ("saves the matmuls and the attention too", {"kernel_policy": _kernel_and_matmuls}),
        ("returns a bool, not a CheckpointPolicy", {"kernel_policy": _kernel_as_bool}),
        ("saves the unfused dropout's ops", {"kernel_policy": _unfused_dropout}),
        ("saves nothing", {"kernel_policy": _recompute_everything}),
        ("saves everything", {"kernel_policy": _save_everything}),
    ],
    "check_choose_every": [
        ("counts n // every checkpointed blocks instead of ceil(n / every)",
         {"choose_every": _floor_count}),
        ("forgets the block rebuilt during backward", {"choose_every": _no_rebuilt_block}),
        ("adds the rebuilt block whatever k", {"choose_every": _rebuilt_whatever_k}),
        ("picks the smallest every (the most recompute)", {"choose_every": _smallest_every}),
        ("returns 1 when nothing fits", {"choose_every": _one_when_nothing_fits}),
    ],
    "check_pareto_front": [
        ("keeps points that tie on one axis and lose on the other",
         {"pareto_front": _strict_dominance}),
        ("sorted by decreasing memory", {"pareto_front": _unsorted}),
        ("keeps only the two extremes", {"pareto_front": _extremes_only}),
    ],
}
