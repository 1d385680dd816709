"""course_lib.training.policies: op-level checkpoint policies, the mm/addmm pitfall, measured costs."""

from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.prediction import step_setup
from course_lib.prediction.checkpointed import predict_kept_bytes
from course_lib.prediction.formulas import PRECISION
from course_lib.training import checkpointing, policies

aten = torch.ops.aten


class _Ops(TorchDispatchMode):
    """The aten ops dispatched while active, counted: the recorder lecture 05 writes."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.ops[op] += 1
        return op(*args, **(kwargs or {}))


def _dispatched(fn, *args):
    with _Ops() as seen:
        fn(*args)
    return seen.ops


def _block_and_input(attention="explicit", b=2, s=16, h=32, a=4):
    config = GPTConfig(vocab_size=32, seq_len=s, d_model=h, n_heads=a, n_layers=1,
                       attention=attention)
    model = GPT(config)
    x = torch.randn(b, s, h, requires_grad=True)
    return model.blocks[0], x


def test_linear_with_bias_dispatches_addmm_and_without_bias_mm():
    x = torch.randn(2, 3, 8)
    with_bias = _dispatched(nn.Linear(8, 4), x)
    without = _dispatched(nn.Linear(8, 4, bias=False), x)
    assert with_bias[aten.addmm.default] == 1 and aten.mm.default not in with_bias
    assert without[aten.mm.default] == 1 and aten.addmm.default not in without
    q = torch.randn(2, 4, 8, 16)
    assert _dispatched(torch.matmul, q, q.transpose(-2, -1))[aten.bmm.default] == 1


def test_ops_must_be_overloads_not_packets():
    assert checkpointing._check_ops(policies.MATMULS) == policies.MATMULS
    with pytest.raises(ValueError, match=r"ops.*aten\.mm\.default"):
        checkpointing._check_ops([aten.mm])
    for bad in (["mm"], "aten.mm.default", None, [len]):
        with pytest.raises(ValueError, match="ops"):
            checkpointing._check_ops(bad)
    # The pitfall PyTorch cannot catch: a policy function comparing with a packet never matches.
    assert aten.mm.default != aten.mm and aten.mm.default.overloadpacket is aten.mm


def test_a_selective_context_policy_answers():
    policy = policies.SelectiveContext(policies.MATMULS).policy()
    ctx = SelectiveCheckpointContext(is_recompute=False)
    for op in policies.MATMULS:
        assert policy(ctx, op) == CheckpointPolicy.MUST_SAVE
    for op in (aten.gelu.default, aten._softmax.default, aten.native_layer_norm.default):
        assert policy(ctx, op) == CheckpointPolicy.PREFER_RECOMPUTE
    with pytest.raises(ValueError, match="ops"):
        policies.SelectiveContext([aten.addmm])


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_saving_only_mm_saves_nothing_in_linears_with_bias(attention):
    block, x = _block_and_input(attention)
    full = policies.policy_cost(block, x, policy="full")
    only_mm = policies.policy_cost(block, x, policy=[aten.mm.default])
    assert only_mm.kept_bytes == full.kept_bytes == 0  # the input is the caller's, not counted
    assert only_mm.recomputes(aten.addmm.default) == full.recomputes(aten.addmm.default) == 3
    assert only_mm.recompute_flops == full.recompute_flops > 0


def test_saving_matmuls_keeps_their_outputs_and_recomputes_no_matmul():
    b, s, h, a = 2, 16, 32, 4
    block, x = _block_and_input("explicit", b, s, h, a)
    cost = policies.policy_cost(block, x, policy=policies.MATMULS)
    # Independent count (fp32): qkv 3bsh, q k^T scores a*s*s*b, probs @ v bsh, proj bsh,
    # fc 4bsh, mlp proj bsh.
    assert cost.kept_bytes == 4 * (10 * b * s * h + a * s * s * b)
    assert cost.recompute_flops == 0
    assert not any(cost.recomputes(op) for op in policies.MATMULS)
    for op in (aten.gelu.default, aten._softmax.default, aten.native_layer_norm.default):
        assert cost.recomputes(op) >= 1
    as_function = policies.policy_cost(block, x, policy=policies.SelectiveContext(policies.MATMULS).policy())
    assert (as_function.kept_bytes, as_function.recomputed) == (cost.kept_bytes, cost.recomputed)


def test_full_checkpoint_recomputes_the_forward_up_to_what_backward_needs():
    b, s, h = 2, 16, 32
    block, x = _block_and_input("explicit", b, s, h)
    none = policies.policy_cost(block, x, policy="none")
    full = policies.policy_cost(block, x, policy="full")
    assert none.recompute_flops == 0 and not none.recomputed and none.kept_bytes > 0
    # Forward FLOPs 24bsh^2 + 4bs^2h, less the MLP's output projection (8bsh^2) that the
    # early-stopping recomputation never reaches (its output is saved by nothing).
    assert full.recompute_flops == 16 * b * s * h * h + 4 * b * s * s * h
    assert full.recomputes(aten.addmm.default) == 3


def test_learners_grad_is_left_alone():
    block, x = _block_and_input()
    x.grad = torch.ones_like(x)
    policies.policy_cost(block, x, policy="full")
    assert torch.equal(x.grad, torch.ones_like(x))
    assert all(p.grad is None for p in block.parameters())


def test_bad_arguments():
    block, x = _block_and_input()
    with pytest.raises(ValueError, match="policy"):
        policies.policy_cost(block, x, policy="some")
    with pytest.raises(ValueError, match="fn"):
        policies.policy_cost("block", x)
    with pytest.raises(ValueError, match="grad"):
        policies.policy_cost(lambda t: t.detach() * 2, torch.randn(3))
    with pytest.raises(ValueError, match="policy must hold OpOverloads"):
        policies.policy_cost(block, x, policy=[aten.addmm])


def test_policy_names():
    assert policies._policy_name("full") == "full"
    assert policies._policy_name([aten.mm.default]) == "save aten.mm.default"
    assert policies._policy_name(policies.SelectiveContext([aten.mm.default]).policy()) == "policy"


def test_gpt_tokens_helper_still_runs_under_the_recorder():
    config = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    model = GPT(config)
    idx, _ = random_tokens(config, 2)
    ops = _dispatched(model, idx)
    assert ops[aten.embedding.default] == 2 and ops[aten.mm.default] == 1  # the tied LM head


def test_saving_the_attention_kernel_stops_its_rerun_and_the_mlp_output_is_waste():
    b, s, h = 2, 16, 32
    block, x = _block_and_input("sdpa", b, s, h)
    matmuls = policies.policy_cost(block, x, policy=policies.MATMULS)
    saved = policies.policy_cost(block, x, policy=policies.SAVE_OPS)
    course = policies.policy_cost(block, x, policy=policies.SelectiveContext(
        policies.SAVE_OPS, policies.BLOCK_LINEARS))
    kernel = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert kernel in policies.ATTENTION_OPS and matmuls.recomputes(kernel) == 1
    assert saved.recomputes(kernel) == course.recomputes(kernel) == 0
    # Saving the kernel keeps its output (b, s, h) and its log-sum-exp (b, a, s) in fp32.
    assert saved.kept_bytes - matmuls.kept_bytes == 4 * (b * s * h + b * 4 * s)
    # The MLP output (b, s, h) is never read by a backward formula: the same rerun without it.
    assert saved.kept_bytes - course.kept_bytes == 4 * b * s * h
    assert saved.recomputed == course.recomputed
    assert course.reruns() == "add, gelu, layer_norm" and "attention" in matmuls.reruns()
    assert policies._policy_name(policies.SelectiveContext([aten.mm.default], 4)) == \
        "save mm; linear 4 recomputed"


def test_only_ops_that_move_bytes_are_counted():
    assert not policies._moves_bytes(aten._unsafe_view.default)
    assert not policies._moves_bytes(aten.view.default) and policies._moves_bytes(aten.gelu.default)


def test_a_block_dispatches_no_unsafe_view_in_the_recomputed_list():
    block, x = _block_and_input("explicit")
    full = policies.policy_cost(block, x, policy="full")
    assert aten._unsafe_view.default not in full.recomputed


@pytest.mark.parametrize("mode, runs", [("none", 0), ("blocks", 2), ("selective", 2),
                                        ("save-kernel", 0), ("recompute-kernel", 2)])
def test_the_kernel_runs_in_backward_only_where_a_policy_recomputes_it(mode, runs):
    pytest.importorskip("triton")
    from course_lib.training.checkpointing import enable_checkpointing

    config = GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_heads=4, n_layers=2,
                       fused_mlp=True)
    torch.manual_seed(0)
    model = enable_checkpointing(GPT(config), mode)
    ran = _dispatched(model(*random_tokens(config, 2))[1].backward)
    kernel, = policies.KERNEL_OPS
    assert kernel is torch.ops.course.bias_gelu.default
    assert ran[kernel] == runs  # once per checkpointed block that recomputes it
    assert ran[torch.ops.course.bias_gelu_backward.default] == 2  # its backward, once per block
    assert policies.KERNEL_POLICIES["save-kernel"] == (*policies.SAVE_OPS, kernel)


def test_kernel_policies_measure_and_predict_both_side_by_side():
    pytest.importorskip("triton")
    config = GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_heads=4, n_layers=2,
                       fused_mlp=True)
    kernel, = checkpointing.KERNEL_OPS
    # Under autocast too (a GPU's lecture runs there): autocast's cast cache would hold the
    # checkpointed blocks' 16-bit weights, which the blocks do not keep; measured without it
    for precision in ("fp32", "autocast-bf16"):
        spec, kept, runs = PRECISION[precision], {}, {}
        for mode in checkpointing.KERNEL_MODES:
            model, _ = step_setup.build(config, precision=precision, mode=mode)
            x, y = random_tokens(config, 2)
            with torch.autocast("cpu", dtype=spec.compute, enabled=spec.autocast,
                                cache_enabled=False):
                kept[mode] = checkpointing.measure_kept_bytes(model, x, y)
                runs[mode] = _dispatched(model(x, y)[1].backward)[kernel]
            assert kept[mode] == predict_kept_bytes(config, 2, mode, dtype=spec.compute,
                                                    autocast=spec.autocast)
        assert (runs["save-kernel"], runs["recompute-kernel"]) == (0, 2)
        if precision == "fp32":  # the kernel's fp32 output, kept by each of the two blocks
            assert kept["save-kernel"] - kept["recompute-kernel"] == 2 * (2 * 16 * 4 * 32) * 4
