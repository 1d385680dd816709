"""course_lib.model.fused: the course's Triton kernel against its reference, forward and gradients,
as one op under a selective-checkpointing policy, and the same contract without Triton."""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from course_lib.measurement.memory import saved_bytes, saved_tensors
from course_lib.model import fused

pytest.importorskip("triton")
OP = torch.ops.course.bias_gelu.default


def _grads(fn, x, bias):
    out = fn(x, bias)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)
    return (out, *torch.autograd.grad((out * weights).sum(), (x, bias)))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_kernel_matches_its_reference_forward_and_backward(dtype, tol):
    assert fused._backend("cpu") == "interpreter"
    x, bias = fused._example("cpu", dtype)
    got = _grads(fused.bias_gelu, x, bias)
    want = _grads(fused._reference, x, bias)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)


def test_the_reference_backend_keeps_the_contract(monkeypatch):
    x, bias = fused._example()
    interpreted = _grads(fused.bias_gelu, x, bias)
    monkeypatch.setattr(fused, "_backend", lambda device: "reference")
    plain = _grads(fused.bias_gelu, x, bias)
    for a, b in zip(interpreted, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_autograd_keeps_only_the_inputs():
    x, bias = fused._example()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        fused.bias_gelu(x, bias)
    assert len(packed) == 2 and packed[0] is x and packed[1] is bias  # no intermediate kept


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _policy(decision):
    def policy(ctx, op, *args, **kwargs):
        return decision if op is OP else CheckpointPolicy.PREFER_RECOMPUTE
    return functools.partial(create_selective_checkpoint_contexts, policy)


@pytest.mark.parametrize("decision, reruns", [(CheckpointPolicy.MUST_SAVE, 0),
                                              (CheckpointPolicy.PREFER_RECOMPUTE, 1)])
def test_a_policy_saves_or_recomputes_the_kernel_as_one_op(decision, reruns):
    x, bias = fused._example()
    weight = torch.randn(64, 64, requires_grad=True)

    def block(x):
        return fused.bias_gelu(x @ weight, bias) @ weight

    out = checkpoint(block, x, use_reentrant=False, context_fn=_policy(decision))
    with _Calls() as mode:
        out.sum().backward()
    assert mode.calls.count(OP) == reruns
    assert mode.calls.count(torch.ops.course.bias_gelu_backward.default) == 1
    reference_grad = torch.autograd.grad(block(x.detach().requires_grad_()).sum(), weight)[0]
    torch.testing.assert_close(weight.grad, reference_grad, atol=1e-5, rtol=1e-5)


class _Unregistered(torch.autograd.Function):
    """bias_gelu as a plain autograd.Function: correct, but not one op to a policy."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return fused._reference(x, bias)

    @staticmethod
    def backward(ctx, grad):
        return fused._backward_rule(ctx, grad)


def test_an_unregistered_function_hides_its_inside_from_a_policy():
    x, bias = fused._example()
    with _Calls() as registered:
        fused.bias_gelu(x, bias)
    with _Calls() as plain:
        _Unregistered.apply(x, bias)
    assert OP in registered.calls
    assert OP not in plain.calls and torch.ops.aten.gelu.default in plain.calls


def test_ops_table_names_the_op_its_reference_and_inputs():
    op, reference, example = fused.OPS["bias_gelu"]
    assert op is OP and reference is fused._reference
    inputs = example("cpu", torch.float32)
    torch.testing.assert_close(op(*inputs), reference(*inputs), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 3), torch.randn(4)), "last dimension"),
    ((torch.randn(2, 3), torch.randn(3, 1)), "1-D"),
    ((torch.randn(2, 3), torch.randn(3, dtype=torch.float64)), "one dtype"),
    ((torch.ones(2, 3, dtype=torch.int64), torch.ones(3, dtype=torch.int64)), "floating"),
    (([1.0], torch.randn(1)), "tensors"),
])
def test_bad_inputs_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        fused._reference(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_compiled_kernel_matches_its_reference_on_a_gpu(dtype):
    assert fused._backend("cuda") == "triton"
    x, bias = fused._example("cuda", dtype)
    for g, w in zip(_grads(fused.bias_gelu, x, bias), _grads(fused._reference, x, bias),
                    strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-3, rtol=2e-3)


def test_the_source_is_the_kernels_own():
    for kernel in ("forward", "backward"):
        text = fused.source(kernel)
        assert text.startswith(f"def _{kernel}(") and "tl.store" in text
    with pytest.raises(ValueError, match="kernel"):
        fused.source("both")


def test_interpreted_launches_leave_no_tensor_alive():
    """Triton's interpreter wraps its arguments in self-referring closures; the launch frees them
    at once, so that a kernel's inputs die when the model lets go of them."""
    import weakref

    x, bias = (t.detach() for t in fused._example())
    out = fused.bias_gelu(x, bias)
    storage = weakref.ref(out.untyped_storage())
    del out
    assert storage() is None


def test_the_kernels_read_no_python_global_but_triton_language():
    """Triton's interpreter lets a kernel read a module's float; the compiler refuses it
    ("Cannot access global variable"), so a constant must be written out in the kernel."""
    import ast

    for kernel in ("forward", "backward", "dropout_add", "dropout_backward"):
        tree = ast.parse(fused.source(kernel))
        function = tree.body[0]
        local = {a.arg for a in function.args.args} | {
            n.id for n in ast.walk(function) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Store)}
        read = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Load)}
        assert read - local == {"tl"}, (kernel, read - local)


# --------------------------------------------------------------------------- bias-dropout-add
DROPOUT = torch.ops.course.bias_dropout_add.default


def _dropout_example(device="cpu", dtype=torch.float32):
    x, bias = fused._example(device, dtype)
    generator = torch.Generator().manual_seed(1)
    residual = torch.randn(x.shape, generator=generator).to(device=x.device, dtype=dtype)
    return [x, bias, residual.requires_grad_(), 0.25, 1234]


def _mask(x, p, seed):
    """The mask the kernel draws for ``x``'s shape, ``p`` and ``seed`` (True: kept): the kernel run
    on ones with nothing added, so that the reference drops exactly what the kernel drops."""
    ones = torch.ones_like(x, memory_format=torch.contiguous_format)
    zeros = torch.zeros_like(ones)
    return fused.bias_dropout_add(ones, zeros[(0,) * (x.dim() - 1)], zeros, p, seed) != 0


def _unfused(x, bias, residual, p, seed=None):
    """``F.dropout(x + bias, p) + residual``, the ops the kernel replaces; with ``seed``, applied
    with the kernel's own mask."""
    if seed is None:
        return torch.nn.functional.dropout(x + bias, p) + residual
    scale = 1 / (1 - p) if p < 1 else 0.0
    return (x + bias) * (_mask(x, p, seed) * scale).to(x.dtype) + residual


def _dropout_grads(fn, x, bias, residual, p, seed):
    out = fn(x, bias, residual, p, seed)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    return (out, *torch.autograd.grad((out * weights).sum(), (x, bias, residual)))


# bf16: the kernel scales in fp32, the unfused ops by a scale rounded to bf16
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
def test_bias_dropout_add_matches_the_unfused_ops_with_its_mask(dtype, tol):
    x, bias, residual, p, seed = _dropout_example("cpu", dtype)
    got = _dropout_grads(fused.bias_dropout_add, x, bias, residual, p, seed)
    want = _dropout_grads(_unfused, x, bias, residual, p, seed)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)
    keep = _mask(x, p, seed)
    assert 0.6 < keep.float().mean() < 0.9  # p = 0.25
    assert torch.equal(got[1] == 0, ~keep)  # x's gradient is zero exactly where it is dropped


def test_the_mask_is_the_seeds_own():
    x = torch.empty(4, 300)
    assert torch.equal(_mask(x, 0.5, 7), _mask(x, 0.5, 7))
    assert not torch.equal(_mask(x, 0.5, 7), _mask(x, 0.5, 8))


def test_the_kernel_keeps_no_tensor_where_the_unfused_ops_keep_the_mask():
    x, bias, residual, p, seed = _dropout_example()
    kept = fused.bias_dropout_add(x, bias, residual, p, seed)
    unfused = _unfused(x, bias, residual, p)  # F.dropout's own mask
    mask_bytes = x.numel() * x.element_size()  # on the CPU the mask has x's dtype
    assert saved_tensors(kept) == []
    assert saved_bytes(kept) == 0 == saved_bytes(unfused) - mask_bytes
    assert [(row.node, row.shape) for row in saved_tensors(unfused)] == [
        ("MulBackward0", tuple(x.shape))]


@pytest.mark.parametrize("op", ["bias_dropout_add", "dropout_backward"])
def test_opcheck_passes(op):
    x, bias, residual, p, seed = _dropout_example()
    args = (x, bias, residual, p, seed) if op == "bias_dropout_add" else (x.detach(), p, seed)
    results = torch.library.opcheck(getattr(torch.ops.course, op).default, args)
    assert set(results.values()) == {"SUCCESS"}, results


def test_offsets_are_int64_so_no_tensor_size_overflows():
    import ast

    for kernel in ("dropout_add", "dropout_backward"):
        text = fused.source(kernel)
        offsets = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Assign)
                       and n.targets[0].id == "offsets")
        assert ast.unparse(offsets.value).startswith("tl.program_id(0).to(tl.int64) * BLOCK")


def test_without_triton_the_op_draws_its_mask_from_a_seeded_generator(monkeypatch):
    x, bias, residual, p, seed = _dropout_example()
    monkeypatch.setattr(fused, "_backend", lambda device: "reference")
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) >= p
    assert torch.equal(_mask(x, p, seed), keep)
    out = fused.bias_dropout_add(x, bias, residual, p, seed)
    assert saved_bytes(out) == 0  # the same contract: a seed kept, a mask redrawn
    got = _dropout_grads(fused.bias_dropout_add, x, bias, residual, p, seed)
    want = _dropout_grads(_unfused, x, bias, residual, p, seed)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_p_0_keeps_everything_and_p_1_drops_everything():
    x, bias, residual, _, seed = _dropout_example()
    out, gx, gb, gr = _dropout_grads(fused.bias_dropout_add, x, bias, residual, 0.0, seed)
    torch.testing.assert_close(out, residual + x + bias)
    torch.testing.assert_close(gx, gr)
    out, gx, gb, gr = _dropout_grads(fused.bias_dropout_add, x, bias, residual, 1.0, seed)
    assert torch.equal(out, residual) and not gx.any() and not gb.any() and gr.any()


@pytest.mark.parametrize("decision, reruns", [(CheckpointPolicy.MUST_SAVE, 0),
                                              (CheckpointPolicy.PREFER_RECOMPUTE, 1)])
def test_a_policy_saves_or_reruns_bias_dropout_add_with_the_same_mask(decision, reruns):
    x, bias, residual, p, _ = _dropout_example()
    weight = torch.randn(64, 64, requires_grad=True)

    def block(x):  # the seed is drawn inside: the rerun must draw the same one
        return torch.layer_norm(fused.bias_dropout_add(x, bias, residual, p), (64,)) @ weight

    def policy(ctx, op, *args, **kwargs):
        return decision if op is DROPOUT else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(3)
    out = checkpoint(block, x, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    with _Calls() as mode:
        out.sum().backward()
    assert mode.calls.count(DROPOUT) == reruns
    torch.manual_seed(3)
    want = torch.autograd.grad(block(x).sum(), weight)[0]
    torch.testing.assert_close(weight.grad, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args, error, match", [
    (([1.0], torch.zeros(1), torch.zeros(1), 0.1), TypeError, "^x must be a tensor"),
    ((torch.zeros(1), torch.zeros(1), 3, 0.1), TypeError, "^residual must be a tensor"),
    ((torch.zeros(1), torch.zeros(1), torch.zeros(1), "0.1"), TypeError, "^p must be a float"),
    ((torch.zeros(1), torch.zeros(1), torch.zeros(1), 1.5), ValueError, r"^p must be .* \[0, 1\]"),
    ((torch.zeros(1), torch.zeros(1), torch.zeros(1), -0.1), ValueError, "^p must be"),
    ((torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.1, 2**31), ValueError, "^seed must be"),
    ((torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.1, 1.0), TypeError, "^seed must be an int"),
    ((torch.zeros(2, 3), torch.zeros(3), torch.zeros(3, 2), 0.1), ValueError, "^residual must"),
    ((torch.zeros(2, 3), torch.zeros(4), torch.zeros(2, 3), 0.1), ValueError, "last dimension"),
])
def test_bad_dropout_inputs_are_refused(args, error, match):
    with pytest.raises(error, match=match):
        fused.bias_dropout_add(*args)


def test_the_registration_is_shown_whole():
    text = fused.source("registration")
    assert text.startswith('@torch.library.custom_op("course::bias_dropout_add"')
    assert "register_fake" in text and text.rstrip().endswith("setup_context=_keep_the_seed)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_dropout_kernel_matches_the_unfused_ops_on_a_gpu(dtype):
    x, bias, residual, p, seed = (t.detach().cuda().requires_grad_() if isinstance(t, torch.Tensor)
                                  else t for t in _dropout_example("cpu", dtype))
    got = _dropout_grads(fused.bias_dropout_add, x, bias, residual, p, seed)
    want = _dropout_grads(_unfused, x, bias, residual, p, seed)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)
