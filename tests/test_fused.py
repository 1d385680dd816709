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

from course_lib.model import fused

pytest.importorskip("triton")
OP = torch.ops.course.bias_gelu.default


def _grads(fn, x, bias):
    out = fn(x, bias)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)
    return (out, *torch.autograd.grad((out * weights).sum(), (x, bias)))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_kernel_matches_its_reference_forward_and_backward(dtype, tol):
    assert fused.backend("cpu") == "interpreter"
    x, bias = fused.example("cpu", dtype)
    got = _grads(fused.bias_gelu, x, bias)
    want = _grads(fused.reference, x, bias)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)


def test_the_reference_backend_keeps_the_contract(monkeypatch):
    x, bias = fused.example()
    interpreted = _grads(fused.bias_gelu, x, bias)
    monkeypatch.setattr(fused, "backend", lambda device: "reference")
    plain = _grads(fused.bias_gelu, x, bias)
    for a, b in zip(interpreted, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_autograd_keeps_only_the_inputs():
    x, bias = fused.example()
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
    x, bias = fused.example()
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


def test_an_unregistered_function_hides_its_inside_from_a_policy():
    x, bias = fused.example()
    with _Calls() as registered:
        fused.bias_gelu(x, bias)
    with _Calls() as plain:
        fused.unregistered_bias_gelu(x, bias)
    assert OP in registered.calls
    assert OP not in plain.calls and torch.ops.aten.gelu.default in plain.calls


def test_ops_table_names_the_op_its_reference_and_inputs():
    op, reference, example = fused.OPS["bias_gelu"]
    assert op is OP and reference is fused.reference
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
        fused.unregistered_bias_gelu(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_compiled_kernel_matches_its_reference_on_a_gpu(dtype):
    assert fused.backend("cuda") == "triton"
    x, bias = fused.example("cuda", dtype)
    for g, w in zip(_grads(fused.bias_gelu, x, bias), _grads(fused.reference, x, bias),
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

    x, bias = (t.detach() for t in fused.example())
    out = fused.bias_gelu(x, bias)
    storage = weakref.ref(out.untyped_storage())
    del out
    assert storage() is None


def test_the_kernels_read_no_python_global_but_triton_language():
    """Triton's interpreter lets a kernel read a module's float; the compiler refuses it
    ("Cannot access global variable"), so a constant must be written out in the kernel."""
    import ast

    for kernel in ("forward", "backward"):
        tree = ast.parse(fused.source(kernel))
        function = tree.body[0]
        local = {a.arg for a in function.args.args} | {
            n.id for n in ast.walk(function) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Store)}
        read = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Load)}
        assert read - local == {"tl"}, (kernel, read - local)
