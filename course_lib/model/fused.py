"""The course's own GPU kernel: the MLP's bias add and GELU fused into one Triton kernel.

In the course GPT's MLP, ``gelu(x @ W.T + b)`` runs three kernels (a matmul, a bias add, the
GELU), and autograd keeps the GELU's input for backward. Fused, the bias add and the GELU are
one kernel that reads ``x`` and ``b`` once and writes the activation once; its backward
*recomputes* ``gelu'(x + b)`` from the same two inputs instead of keeping an intermediate. This
is the pattern of FlashAttention and of Megatron-LM's fused bias-GELU, small enough to read.

Each Triton program handles :data:`BLOCK` elements. Registered as one PyTorch operator,
``torch.ops.course.bias_gelu`` (its backward another, :func:`bias_gelu_backward`; with
:func:`torch.library.custom_op` and a Triton launch inside), the kernel is a single op to
autograd and to a selective-checkpointing policy: a policy can save its output (the kernel does
not run again in backward) or recompute it (it runs once more). A plain
:class:`torch.autograd.Function` would not be one op: the policy would see the ``aten`` ops of
its body, one by one (:func:`unregistered_bias_gelu` shows it).

Where it runs:

* CUDA with Triton (Colab's T4 included): the compiled kernel.
* CPU with Triton installed: the same kernel through Triton's interpreter (what
  ``TRITON_INTERPRET=1`` selects), which executes it block by block with NumPy. It is slow:
  keep sizes small. The op, its saved tensors and its gradients are those of the GPU.
* Elsewhere (MPS, Windows, no Triton): the same function in plain PyTorch inside the same op,
  with the same saved-tensor contract, so that policies and byte counts do not change.

:data:`OPS` maps a name to ``(op, reference, example)``: the ``OpOverload``, the same function
in plain PyTorch, and ``example(device, dtype)``, a list of inputs.

References: Hendrycks & Gimpel 2016 (GELU, ``x * Phi(x)``); Dao et al. 2022 (FlashAttention:
recompute inside a kernel); Megatron-LM's ``fused_bias_gelu``; Triton's "fused softmax"
tutorial for the launch pattern.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import inspect
import math
import textwrap
from collections.abc import Callable

import torch
from torch import Tensor

from course_lib.units import as_dtype
from course_lib.validation import available_device as as_device

# Triton is imported on the first launch only (:func:`_kernels`): importing it costs a lecture
# that never runs the kernel a fifth of a second, and the learner's runtime may lack it.
triton = tl = None
_KERNELS: dict | None = None


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


#: Elements each Triton program handles: a power of two, so that one block is one vector.
BLOCK = 1024
_SQRT_HALF = 1 / math.sqrt(2)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)


def backend(device: torch.device | str) -> str:
    """How :func:`bias_gelu` runs on ``device``.

    Args:
        device (torch.device or str): where the tensors live.

    Returns:
        str: ``"triton"`` (compiled, CUDA), ``"interpreter"`` (Triton's interpreter on the CPU)
        or ``"reference"`` (plain PyTorch inside the same op: MPS, or no Triton).

    Raises:
        ValueError: naming ``device``, for a device this machine does not have.
    """
    kind = as_device("device", device).type
    if not _triton_installed():
        return "reference"
    if kind == "cuda":
        return "triton"
    return "interpreter" if kind == "cpu" else "reference"


def _forward(x_ptr, b_ptr, out_ptr, n_elements, n_cols, BLOCK: tl.constexpr):
    """``out = gelu(x + b)``, ``b`` broadcast over the rows; computed in fp32."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets % n_cols, mask=mask).to(tl.float32)
    y = x + b
    # The constants are written out: a compiled kernel reads no Python global but a constexpr.
    out = 0.5 * y * (1 + tl.math.erf(y * 0.7071067811865476))  # 1 / sqrt(2)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _backward(grad_ptr, x_ptr, b_ptr, out_ptr, n_elements, n_cols, BLOCK: tl.constexpr):
    """``out = grad * gelu'(x + b)``, recomputed from the inputs:
    ``gelu'(y) = Phi(y) + y * phi(y)``."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offsets % n_cols, mask=mask).to(tl.float32)
    y = x + b
    cdf = 0.5 * (1 + tl.math.erf(y * 0.7071067811865476))  # 1 / sqrt(2)
    pdf = tl.exp(-0.5 * y * y) * 0.3989422804014327  # 1 / sqrt(2 pi)
    tl.store(out_ptr + offsets, (grad * (cdf + y * pdf)).to(out_ptr.dtype.element_ty),
             mask=mask)


def _kernels() -> dict:
    """The two kernels per backend, made on the first launch (Triton imported then)."""
    global triton, tl, _KERNELS
    if _KERNELS is None:
        try:
            import triton
            import triton.language as tl
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError as exc:  # found by find_spec, yet broken (a CUDA-only wheel, say)
            raise RuntimeError(f"Triton is installed but does not import ({exc}); uninstall it "
                               "to run the kernel's reference in plain PyTorch") from exc

        _KERNELS = {"triton": {"forward": triton.jit(_forward), "backward": triton.jit(_backward)},
                    "interpreter": {"forward": InterpretedFunction(_forward),
                                    "backward": InterpretedFunction(_backward)}}
    return _KERNELS


def _launch(name: str, out: Tensor, *tensors: Tensor) -> Tensor:
    where = backend(out.device)
    kernel = _kernels()[where][name]
    n = out.numel()
    if where == "triton":
        kernel[(triton.cdiv(n, BLOCK),)](*tensors, out, n, tensors[-1].numel(), BLOCK=BLOCK)
        return out
    # The interpreter wraps its arguments in closures that refer to themselves: a reference cycle
    # that would keep the tensors' storages alive until Python's garbage collector runs. With the
    # collector paused, the cycle stays in the youngest generation, which a cheap pass frees now,
    # so that memory measured around the kernel is what the compiled kernel would hold.
    collecting = gc.isenabled()
    gc.disable()
    try:
        kernel[(triton.cdiv(n, BLOCK),)](*tensors, out, n, tensors[-1].numel(), BLOCK=BLOCK)
    finally:
        if collecting:
            gc.enable()
        gc.collect(0)
    return out


def source(kernel: str = "forward") -> str:
    """The Triton source of one of the two kernels, as a lecture prints it.

    Args:
        kernel (str): ``"forward"`` (``gelu(x + b)``) or ``"backward"`` (``grad * gelu'(x + b)``).

    Returns:
        str: the kernel's Python source.

    Raises:
        ValueError: naming ``kernel``, for another name; or where Triton is not installed.
    """
    if kernel not in ("forward", "backward"):
        raise ValueError(f"kernel must be one of ('forward', 'backward'), got {kernel!r}")
    if not _triton_installed():
        raise ValueError("the kernels' source needs Triton installed (pip install triton)")
    return textwrap.dedent(inspect.getsource(_forward if kernel == "forward" else _backward))


def _check(x: Tensor, bias: Tensor, what: str = "x") -> None:
    if not isinstance(x, Tensor) or not isinstance(bias, Tensor):
        raise ValueError(f"{what} and bias must be tensors, got {type(x).__name__} and "
                         f"{type(bias).__name__}")
    if bias.dim() != 1 or x.dim() < 1 or x.shape[-1] != bias.shape[0]:
        raise ValueError(f"bias must be 1-D with {what}'s last dimension, got {what} "
                         f"{tuple(x.shape)} and bias {tuple(bias.shape)}")
    if x.device != bias.device or not x.is_floating_point() or x.dtype != bias.dtype:
        raise ValueError(f"{what} and bias must be floating tensors of one dtype on one device, "
                         f"got {x.dtype} on {x.device} and {bias.dtype} on {bias.device}")


@torch.library.custom_op("course::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    """``gelu(x + bias)`` in one kernel (exact GELU, ``erf``), computed in fp32.

    Autograd keeps the op's two inputs (``x`` and ``bias``, which is a parameter), never an
    intermediate: its backward recomputes ``gelu'(x + bias)`` (see :data:`OPS`).

    Args:
        x (Tensor): the matmul's output, any shape ``(..., n)``, floating point.
        bias (Tensor): ``(n,)``, same dtype and device.

    Returns:
        Tensor: ``gelu(x + bias)``, ``x``'s shape and dtype.

    Raises:
        ValueError: for tensors of other shapes, dtypes or devices.

    Example::

        y = bias_gelu(torch.randn(2, 8, 64), torch.zeros(64))
    """
    _check(x, bias)
    if backend(x.device) == "reference":
        return reference(x, bias)
    return _launch("forward", torch.empty_like(x, memory_format=torch.contiguous_format),
                   x.contiguous(), bias.contiguous())


@bias_gelu.register_fake
def _(x, bias):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("course::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    """``grad * gelu'(x + bias)``: the gradient of :func:`bias_gelu` for ``x``, recomputed from
    the inputs in one kernel (the bias's gradient is its sum over the rows).

    Args:
        grad (Tensor): the gradient of the output, ``x``'s shape.
        x (Tensor): the forward's input.
        bias (Tensor): the forward's bias.

    Returns:
        Tensor: the gradient for ``x``.

    Raises:
        ValueError: for tensors of other shapes, dtypes or devices.
    """
    _check(x, bias)
    if grad.shape != x.shape:
        raise ValueError(f"grad must have x's shape {tuple(x.shape)}, got {tuple(grad.shape)}")
    if backend(x.device) == "reference":
        y = x.float() + bias.float()
        derivative = 0.5 * (1 + torch.erf(y * _SQRT_HALF)) + y * torch.exp(-0.5 * y * y) * (
            _INV_SQRT_2PI)
        return (grad.float() * derivative).to(x.dtype)
    return _launch("backward", torch.empty_like(x, memory_format=torch.contiguous_format),
                   grad.contiguous(), x.contiguous(), bias.contiguous())


@bias_gelu_backward.register_fake
def _(grad, x, bias):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _bias_grad(grad_x: Tensor, bias: Tensor) -> Tensor:
    # the bias's gradient: grad_x summed over the rows, accumulated in fp32
    return grad_x.reshape(-1, bias.shape[0]).sum(0, dtype=torch.float32).to(bias.dtype)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x and bias: nothing computed inside the kernel is kept


def _backward_rule(ctx, grad):
    x, bias = ctx.saved_tensors
    grad_x = bias_gelu_backward(grad, x, bias)
    return grad_x, _bias_grad(grad_x, bias)


bias_gelu.register_autograd(_backward_rule, setup_context=_setup_context)


def reference(x: Tensor, bias: Tensor) -> Tensor:
    """:func:`bias_gelu` in plain PyTorch: ``gelu(x + bias)`` in fp32, cast back to ``x``'s dtype.

    Args:
        x (Tensor): ``(..., n)``.
        bias (Tensor): ``(n,)``.

    Returns:
        Tensor: ``gelu(x + bias)``.

    Raises:
        ValueError: naming ``x`` or ``bias``, for tensors the op does not take.
    """
    _check(x, bias)
    return torch.nn.functional.gelu(x.float() + bias.float()).to(x.dtype)


class _UnregisteredBiasGelu(torch.autograd.Function):
    """The same function as a plain ``autograd.Function``: correct, but not one op."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return reference(x, bias)

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        grad_x = bias_gelu_backward(grad, x, bias)
        return grad_x, _bias_grad(grad_x, bias)


def unregistered_bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    """:func:`bias_gelu` as a plain :class:`torch.autograd.Function`, not a registered op.

    It computes the same values and gradients, but a dispatch mode, and so a
    selective-checkpointing policy, sees the ``aten`` ops of its body (an add, a GELU, the
    casts) instead of one operator it could name: the reason the course's kernel is registered.

    Args:
        x (Tensor): ``(..., n)``.
        bias (Tensor): ``(n,)``.

    Returns:
        Tensor: ``gelu(x + bias)``.
    """
    _check(x, bias)
    return _UnregisteredBiasGelu.apply(x, bias)


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list:
    """Inputs of :func:`bias_gelu`: ``x`` of shape ``(2, 8, 64)`` and a bias of 64, both
    requiring grad, seeded.

    Args:
        device (torch.device or str): where to make them.
        dtype (torch.dtype): their dtype.

    Returns:
        list[Tensor]: ``[x, bias]``.

    Raises:
        ValueError: naming ``device`` (one this machine does not have) or ``dtype`` (not a
            floating-point dtype).
    """
    device = as_device("device", device)
    dtype = as_dtype(dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 64, generator=generator).to(device=device, dtype=dtype)
    bias = (0.1 * torch.randn(64, generator=generator)).to(device=device, dtype=dtype)
    return [x.requires_grad_(), bias.requires_grad_()]


#: The course's fused ops: ``name -> (op, reference, example)``.
OPS: dict[str, tuple[torch._ops.OpOverload, Callable, Callable]] = {
    "bias_gelu": (torch.ops.course.bias_gelu.default, reference, example),
}

__all__ = ["BLOCK", "OPS", "backend", "bias_gelu", "bias_gelu_backward", "example", "reference",
           "source", "unregistered_bias_gelu"]
