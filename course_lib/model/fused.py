"""05: the course's own Triton kernels, whose backward recomputes what the PyTorch ops store.

:func:`bias_dropout_add` (Megatron-LM's, ``GPTConfig(fused_residual=True)``) keeps a seed where
the unfused ops keep the dropout mask; :func:`bias_gelu` (``fused_mlp=True``) keeps its input, as
``gelu(addmm(...))`` does, and recomputes ``gelu'``. Registered with
:func:`torch.library.custom_op`, each is one op to a selective-checkpointing policy. They run
compiled on CUDA, through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``: slow, the same
ops and saved tensors), elsewhere (MPS, no Triton) as plain PyTorch inside the same ops.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import math
import textwrap
from collections.abc import Callable

import torch
from torch import Tensor

from course_lib.validation import available_device as as_device, choice

# Triton is imported on the first launch only (:func:`_kernels`): importing it costs a lecture
# that never runs the kernel a fifth of a second, and the learner's runtime may lack it.
triton = tl = None
_KERNELS: dict | None = None


@functools.cache
def _triton_installed() -> bool:
    """Whether Triton imports here (a wheel built for another platform may be installed and fail)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    except Exception:  # any failure to import means: no Triton here
        return False
    return True


_BLOCK = 1024  # elements per Triton program: a power of two, so one block is one vector
_SQRT_HALF = 1 / math.sqrt(2)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)


def _backend(device: torch.device | str) -> str:
    """How the kernels run on ``device``: "triton", "interpreter" (the CPU) or "reference"."""
    kind = as_device("device", device).type
    if not _triton_installed() or kind not in ("cuda", "cpu"):
        return "reference"
    return "triton" if kind == "cuda" else "interpreter"


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
    """The kernels per backend, made on the first launch (Triton imported then)."""
    global triton, tl, _KERNELS
    if _KERNELS is None:
        try:  # _triton_installed() said it imports
            import triton
            import triton.language as tl
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError as exc:
            raise RuntimeError(f"Triton stopped importing: {exc}") from exc
        kernels = _KERNEL_FUNCTIONS
        # the seed changes every call: one compiled kernel for all seeds
        _KERNELS = {"triton": {name: triton.jit(fn, do_not_specialize=["seed"] if "dropout" in name
                                                else None) for name, fn in kernels.items()},
                    "interpreter": {name: InterpretedFunction(fn) for name, fn in kernels.items()}}
    return _KERNELS


def _launch(name: str, out: Tensor, *tensors: Tensor) -> Tensor:
    return _run(name, out, *tensors, out, out.numel(), tensors[-1].numel())


def _run(name: str, out: Tensor, *args) -> Tensor:
    """Launch kernel ``name`` over ``out``'s elements with ``args``; returns ``out``."""
    where = _backend(out.device)
    kernel = _kernels()[where][name]
    grid = (triton.cdiv(out.numel(), _BLOCK),)
    if where == "triton":
        kernel[grid](*args, BLOCK=_BLOCK)
        return out
    # The interpreter wraps its arguments in closures that refer to themselves: a reference cycle
    # that would keep the tensors' storages alive until Python's garbage collector runs. With the
    # collector paused, the cycle stays in the youngest generation, which a cheap pass frees now,
    # so that memory measured around the kernel is what the compiled kernel would hold.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _interpretable_random():
            kernel[grid](*args, BLOCK=_BLOCK)
    finally:
        if collecting:
            gc.enable()
        gc.collect(0)
    return out


@contextlib.contextmanager
def _interpretable_random():
    """Triton's ``tl.rand`` and the functions it calls, as the interpreter can call them."""
    try:
        import triton.language.random as random
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # a Triton without the interpreter's pieces: nothing to swap
        yield
        return
    jitted = {name: f for name, f in vars(random).items() if isinstance(f, JITFunction)}
    swapped = [(module, name, f) for module in (random, tl) for name, f in jitted.items()
               if getattr(module, name, None) is f]
    for module, name, f in swapped:
        setattr(module, name, InterpretedFunction(f.fn))
    try:
        yield
    finally:
        for module, name, f in swapped:
            setattr(module, name, f)


_SOURCES = ("forward", "backward", "dropout_add", "dropout_backward", "registration")


def source(kernel: str = "forward") -> str:
    """The source of a kernel, or of the op's registration, as text (it reads the same where
    Triton is not installed): ``"forward"`` (``gelu(x + b)``), ``"backward"``, ``"dropout_add"``,
    ``"dropout_backward"`` (the two kernels of :func:`bias_dropout_add`) or ``"registration"``.
    Args:
        kernel (str): one of the names above.
    Returns:
        str: the source, dedented.
    Raises:
        ValueError: for another ``kernel``.
    """
    choice("kernel", kernel, _SOURCES)
    if kernel == "registration":
        text = inspect.getsource(inspect.getmodule(source))
        start = text.index('\n@torch.library.custom_op("course::bias_dropout_add"') + 1
        return text[start:text.index("\n# end of the registration", start)] + "\n"
    return textwrap.dedent(inspect.getsource(_KERNEL_FUNCTIONS[kernel]))


def _check(x: Tensor, bias: Tensor) -> None:
    """Refuse ``x`` and ``bias`` unless floating tensors of one dtype and device, ``bias`` 1-D."""
    if not isinstance(x, Tensor) or not isinstance(bias, Tensor):
        raise ValueError(f"x and bias must be tensors, got {type(x).__name__} and "
                         f"{type(bias).__name__}")
    if bias.dim() != 1 or x.dim() < 1 or x.shape[-1] != bias.shape[0]:
        raise ValueError(f"bias must be 1-D with x's last dimension, got x {tuple(x.shape)} and "
                         f"bias {tuple(bias.shape)}")
    if x.device != bias.device or not x.is_floating_point() or x.dtype != bias.dtype:
        raise ValueError(f"x and bias must be floating tensors of one dtype on one device, "
                         f"got {x.dtype} on {x.device} and {bias.dtype} on {bias.device}")


@torch.library.custom_op("course::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    """``gelu(x + bias)`` in one kernel (exact GELU, ``erf``, in fp32); autograd keeps only ``x``
    and ``bias``, the backward recomputes ``gelu'(x + bias)``."""
    _check(x, bias)
    if _backend(x.device) == "reference":
        return _reference(x, bias)
    return _launch("forward", torch.empty_like(x, memory_format=torch.contiguous_format),
                   x.contiguous(), bias.contiguous())


bias_gelu.register_fake(lambda x, bias: torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.custom_op("course::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    """``grad * gelu'(x + bias)``, recomputed from the inputs in one kernel."""
    if _backend(x.device) == "reference":
        y = x.float() + bias.float()
        derivative = 0.5 * (1 + torch.erf(y * _SQRT_HALF)) + y * torch.exp(-0.5 * y * y) * (
            _INV_SQRT_2PI)
        return (grad.float() * derivative).to(x.dtype)
    return _launch("backward", torch.empty_like(x, memory_format=torch.contiguous_format),
                   grad.contiguous(), x.contiguous(), bias.contiguous())


_bias_gelu_backward.register_fake(
    lambda grad, x, bias: torch.empty_like(x, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x and bias: nothing computed inside the kernel is kept


def _backward_rule(ctx, grad):
    x, bias = ctx.saved_tensors
    grad_x = _bias_gelu_backward(grad, x, bias)
    # the bias's gradient: grad_x summed over the rows, accumulated in fp32
    return grad_x, grad_x.reshape(-1, bias.shape[0]).sum(0, dtype=torch.float32).to(bias.dtype)


bias_gelu.register_autograd(_backward_rule, setup_context=_setup_context)


def _reference(x: Tensor, bias: Tensor) -> Tensor:
    """:func:`bias_gelu` in plain PyTorch: ``gelu(x + bias)`` in fp32, cast back to ``x``'s dtype."""
    _check(x, bias)
    return torch.nn.functional.gelu(x.float() + bias.float()).to(x.dtype)


def _example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list:
    """Seeded inputs of :func:`bias_gelu` requiring grad: ``x`` ``(2, 8, 64)`` and a bias of 64."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 64, generator=generator).to(device=device, dtype=dtype)
    bias = (0.1 * torch.randn(64, generator=generator)).to(device=device, dtype=dtype)
    return [x.requires_grad_(), bias.requires_grad_()]


# ------------------------------------------------------------------------- bias-dropout-add


def _dropout_add(x_ptr, bias_ptr, residual_ptr, out_ptr, n_elements, n_cols, p, scale, seed,
                 BLOCK: tl.constexpr):
    """``out = residual + dropout(x + bias, p)``; the mask is drawn from ``(seed, offset)``."""
    # int64: int32 offsets would overflow past 2**31 elements
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=inside).to(tl.float32)
    bias = tl.load(bias_ptr + offsets % n_cols, mask=inside).to(tl.float32)
    residual = tl.load(residual_ptr + offsets, mask=inside).to(tl.float32)
    keep = tl.rand(seed, offsets) >= p  # the same numbers for the same seed and offsets
    out = residual + tl.where(keep, (x + bias) * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


def _dropout_backward(grad_ptr, out_ptr, n_elements, p, scale, seed, BLOCK: tl.constexpr):
    """``out = grad * keep * scale``: the forward's mask, drawn again from its seed."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n_elements
    grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32)
    keep = tl.rand(seed, offsets) >= p
    out = tl.where(keep, grad * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


#: Seeds are drawn below this bound, so that Triton passes every seed as one int32 type.
_SEED_LIMIT = 2**31


def _dropout_launch(name: str, out: Tensor, p: float, seed: int, *tensors: Tensor) -> Tensor:
    """Run a dropout kernel (or its reference) into ``out``."""
    scale = 1 / (1 - p) if p < 1 else 0.0  # p = 1 drops everything
    if _backend(out.device) == "reference":
        # Without Triton: the mask from a torch.Generator seeded the same way (other numbers than
        # Triton's Philox stream, the same contract: a seed kept, a mask redrawn).
        generator = torch.Generator(out.device).manual_seed(seed)
        keep = torch.rand(out.shape, generator=generator, device=out.device) >= p
        if name == "dropout_backward":
            return torch.where(keep, tensors[0].float() * scale, 0.0).to(out.dtype)
        x, bias, residual = (t.float() for t in tensors)
        return (residual + torch.where(keep, (x + bias) * scale, 0.0)).to(out.dtype)
    tensors = tuple(t.contiguous() for t in tensors)
    if name == "dropout_add":
        return _run(name, out, *tensors, out, out.numel(), tensors[1].numel(), p, scale, seed)
    return _run(name, out, *tensors, out, out.numel(), p, scale, seed)


@torch.library.custom_op("course::bias_dropout_add", mutates_args=())
def _bias_dropout_add(x: Tensor, bias: Tensor, residual: Tensor, p: float, seed: int) -> Tensor:
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return _dropout_launch("dropout_add", out, p, seed, x, bias, residual)  # or its reference


@_bias_dropout_add.register_fake
def _(x, bias, residual, p, seed):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@torch.library.custom_op("course::dropout_backward", mutates_args=())
def _dropout_grad(grad: Tensor, p: float, seed: int) -> Tensor:
    out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    return _dropout_launch("dropout_backward", out, p, seed, grad)


@_dropout_grad.register_fake
def _(grad, p, seed):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _keep_the_seed(ctx, inputs, output):
    ctx.p, ctx.seed = inputs[3], inputs[4]  # two numbers: no tensor is saved


def _dropout_add_grads(ctx, grad):
    grad_x = torch.ops.course.dropout_backward(grad, ctx.p, ctx.seed)  # the mask, redrawn
    grad_bias = grad_x.reshape(-1, grad_x.shape[-1]).sum(0, dtype=torch.float32)
    return grad_x, grad_bias.to(grad.dtype), grad, None, None


_bias_dropout_add.register_autograd(_dropout_add_grads, setup_context=_keep_the_seed)
# end of the registration


def _check_dropout(x, bias, residual, p, seed) -> None:
    """Refuse what :func:`bias_dropout_add` cannot take, naming the parameter."""
    for name, value in (("x", x), ("bias", bias), ("residual", residual)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if isinstance(p, bool) or not isinstance(p, int | float):
        raise TypeError(f"p must be a float, got {type(p).__name__}")
    if not 0 <= p <= 1:
        raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**31), got {seed!r}")
    _check(x, bias)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual must have x's shape, dtype and device, got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device} for x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")


def bias_dropout_add(x: Tensor, bias: Tensor, residual: Tensor, p: float,
                     seed: int | None = None) -> Tensor:
    """``residual + dropout(x + bias, p)`` in one kernel: Megatron-LM's bias-dropout-add.

    The unfused ops, ``F.dropout(x + bias, p) + residual``, keep the ``b x s x h`` mask for the
    backward pass; this op keeps ``p`` and ``seed``: its forward kernel draws the mask from
    ``tl.rand(seed, offsets)``, its backward draws it again (Triton's "low-memory dropout"
    tutorial; Korthikanti et al. 2022). ``x`` is ``(..., n)`` (a matmul without its bias),
    ``bias`` ``(n,)``, ``residual`` ``x``'s shape, dtype and device; ``p`` in ``[0, 1]``. The
    ``seed``, in ``[0, 2**31)``, defaults to one drawn from PyTorch's CPU generator
    (``torch.manual_seed`` makes it repeatable, and checkpointing's recomputation draws the same).
    Args:
        x, bias, residual (Tensor): ``(..., n)``, ``(n,)`` and ``x``'s shape, dtype and device.
        p (float): the drop probability, in ``[0, 1]``.
        seed (int, optional): in ``[0, 2**31)``; default: drawn from PyTorch's CPU generator.
    Returns:
        Tensor: ``residual + dropout(x + bias, p)``, ``x``'s shape and dtype.

    Example:
        >>> bias_dropout_add(torch.ones(2, 4), torch.zeros(4), torch.zeros(2, 4), 0.5, seed=0)
        tensor([[2., 0., 0., 0.],
                [0., 2., 2., 2.]])
    """
    if seed is None:
        seed = int(torch.randint(_SEED_LIMIT, ()))
    _check_dropout(x, bias, residual, p, seed)
    return torch.ops.course.bias_dropout_add(x, bias, residual, float(p), seed)


#: The course's fused ops: ``name -> (op, reference, example)``.
OPS: dict[str, tuple[torch._ops.OpOverload, Callable, Callable]] = {
    "bias_gelu": (torch.ops.course.bias_gelu.default, _reference, _example),
}
_KERNEL_FUNCTIONS = {"forward": _forward, "backward": _backward, "dropout_add": _dropout_add,
                     "dropout_backward": _dropout_backward}

__all__ = ["OPS", "bias_dropout_add", "bias_gelu", "source"]
