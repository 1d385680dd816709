"""course_lib.training.checkpointing and course_lib.measurement.timeline: modes, equivalence, predictions."""

import copy
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

from course_lib.measurement.memory import peak_memory, saved_bytes
from course_lib.measurement.timeline import _timeline_from_snapshot, record_timeline, track_timeline
from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.prediction import checkpointed
from course_lib.prediction.predict import Step, predict
from course_lib.training import checkpointing as ckpt

SMALL = dict(vocab_size=50, seq_len=16, d_model=32, n_heads=4, n_layers=5)
MODE_ARGS = [("none", 1), ("blocks", 1), ("blocks", 2), ("sqrt", 1), ("selective", 2),
             ("attention", 2)]
KINDS = [("explicit", 0.0), ("explicit", 0.1), ("sdpa", 0.0), ("sdpa", 0.1)]


def _grads(model, x, y, seed=1):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attention,dropout", KINDS)
@pytest.mark.parametrize("mode,every", MODE_ARGS)
def test_mode_keeps_gradients_and_matches_predicted_bytes_and_flops(mode, every, attention, dropout):
    config = GPTConfig(**SMALL, dropout=dropout, attention=attention)
    base = GPT(config)
    x, y = random_tokens(config, 2)
    loss0, g0 = _grads(base, x, y)
    model = ckpt.enable_checkpointing(copy.deepcopy(base), mode, every)
    loss1, g1 = _grads(model, x, y)
    assert torch.equal(loss0, loss1)
    # The RNG state is restored for the recomputation, so the same kernels see the same inputs.
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for batch in (1, 3):
        x, y = random_tokens(config, batch)
        assert ckpt.measure_kept_bytes(model, x, y) == checkpointed.predict_kept_bytes(
            config, batch, mode, every)
    with FlopCounterMode(display=False) as counter:
        model(x, y)[1].backward()
    assert counter.get_total_flops() == checkpointed.step_flops(config, 3, mode, every)[0]


def test_per_block_checkpointing_keeps_one_input_per_block():
    # Independent: a checkpointed block keeps its (b, s, h) fp32 input instead of all it saves,
    # which autograd reports for one real block.
    config = GPTConfig(**SMALL)
    b, s, h, L = 3, 16, 32, 5
    torch.manual_seed(0)
    one = GPT(config).blocks[0]
    x = torch.randn(b, s, h, requires_grad=True)
    block = saved_bytes(one(x), one.parameters())
    none = checkpointed.predict_kept_bytes(config, b, "none")
    assert none - checkpointed.predict_kept_bytes(config, b, "blocks") == L * (block - b * s * h * 4)
    every2 = checkpointed.predict_kept_bytes(config, b, "blocks", 2)  # blocks 0, 2, 4 wrapped
    assert none - every2 == 3 * (block - b * s * h * 4)


def test_regions_and_labels_of_each_policy():
    assert ckpt.checkpointed_regions(10, "none") == []
    assert ckpt.checkpointed_regions(10, "blocks", 3) == ckpt.checkpointed_regions(10, "selective", 3) == [[0], [3], [6], [9]]
    # sqrt: the segments checkpoint_sequential checkpoints (its last one runs plainly)
    assert ckpt.checkpointed_regions(10, "sqrt") == ckpt.checkpointed_regions(10, "sqrt", segments=3) == [
        [0, 1, 2], [3, 4, 5]]
    assert ckpt.checkpointed_regions(10, "sqrt", segments=2) == [[0, 1, 2, 3, 4]]
    assert [ckpt.policy_label(m, e) for m, e in (("none", 1), ("sqrt", 1), ("blocks", 2),
                                                 ("selective", 1), ("attention", 4))] == [
        "none", "sqrt", "blocks/2", "selective/1", "attention/4"]
    with pytest.raises(ValueError, match="mode must be one of"):
        ckpt.policy_label("every", 2)
    with pytest.raises(ValueError, match="every must be a positive int"):
        ckpt.policy_label("blocks", 0)


def test_sqrt_segments_follow_checkpoint_sequential():
    assert [ckpt.sqrt_segments(n) for n in (1, 4, 9, 10, 16, 64)] == [1, 2, 3, 3, 4, 8]
    assert ckpt._sequential_segments(10, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    # Count block calls: checkpointed segments run twice, the last segment once.
    config = GPTConfig(**{**SMALL, "n_layers": 10})
    model = GPT(config)
    calls = [0] * 10
    for i, block in enumerate(model.blocks):  # a pre-hook: the recomputation may stop mid-block
        block.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    x = torch.randn(2, 16, 32, requires_grad=True)
    checkpoint_sequential(list(model.blocks), 3, x, use_reentrant=False).sum().backward()
    assert calls == [2] * 6 + [1] * 4


def test_sqrt_memory_grows_as_sqrt_of_depth():
    kept = {}
    for L in (16, 64, 256):
        config = GPTConfig(**{**SMALL, "n_layers": L, "vocab_size": 8})
        kept[L] = (checkpointed.predict_kept_bytes(config, 2, "none"),
                   checkpointed.predict_kept_bytes(config, 2, "sqrt"))
    slope = [math.log(kept[256][i] / kept[16][i]) / math.log(16) for i in (0, 1)]
    assert 0.97 < slope[0] <= 1.0 and 0.45 < slope[1] < 0.55


def test_enable_is_idempotent_and_reversible():
    config = GPTConfig(**SMALL)
    model = GPT(config)
    for mode in ("blocks", "blocks", "attention", "sqrt", "selective"):
        ckpt.enable_checkpointing(model, mode)
        assert model.checkpointing.mode == mode
        wrapped_cores = sum("core" in b.attn.__dict__ for b in model.blocks)
        assert wrapped_cores == (5 if mode == "attention" else 0)
        assert ("run_blocks" in model.__dict__) == (mode != "attention")
    ckpt.enable_checkpointing(model, "none")
    assert "run_blocks" not in model.__dict__
    assert not any("core" in b.attn.__dict__ for b in model.blocks)
    x, y = random_tokens(config, 2)
    assert ckpt.measure_kept_bytes(model, x, y) == checkpointed.predict_kept_bytes(config, 2, "none")


def test_deepcopy_of_a_checkpointed_model_uses_its_own_blocks():
    config = GPTConfig(**SMALL)
    model = ckpt.enable_checkpointing(GPT(config), "blocks")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.add_(0.1)
    x, _ = random_tokens(config, 2)
    assert not torch.allclose(model(x), twin(x))
    twin(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_selective_policy_validation_and_the_mm_pitfall():
    config = GPTConfig(**SMALL)
    model = GPT(config)
    with pytest.raises(ValueError, match="policy.*default"):
        ckpt.enable_checkpointing(model, "selective", policy=[torch.ops.aten.mm])
    with pytest.raises(ValueError, match="policy"):
        ckpt.enable_checkpointing(model, "selective", policy=["mm"])
    # nn.Linear with a bias dispatches addmm: saving only mm keeps no more than full checkpointing.
    x, y = random_tokens(config, 2)
    only_mm = ckpt.enable_checkpointing(model, "selective", policy=[torch.ops.aten.mm.default])
    assert ckpt.measure_kept_bytes(only_mm, x, y) == checkpointed.predict_kept_bytes(config, 2, "blocks")


@pytest.mark.parametrize("kwargs,name", [
    (dict(mode="full"), "mode"), (dict(mode=None), "mode"), (dict(every=0), "every"),
    (dict(every=1.5), "every"), (dict(every=True), "every"),
    (dict(mode="sqrt", segments=0), "segments"), (dict(mode="sqrt", segments=6), "segments"),
    (dict(mode="blocks", segments=2), "segments"), (dict(mode="blocks", policy=[]), "policy"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match=name):
        ckpt.enable_checkpointing(model, **kwargs)
    if "policy" not in kwargs:
        args = {"mode": "blocks", **kwargs}
        with pytest.raises(ValueError, match=name):
            checkpointed.predict_kept_bytes(model.config, 2, args.pop("mode"), **args)


def test_other_bad_inputs():
    with pytest.raises(ValueError, match="model"):
        ckpt.enable_checkpointing(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="n_layers"):
        ckpt.sqrt_segments(0)
    with pytest.raises(ValueError, match="batch_size"):
        checkpointed.checkpoint_cost(GPTConfig(**SMALL), 0, "blocks")
    with pytest.raises(ValueError, match="config"):
        checkpointed.step_flops({"n_layers": 2}, 2)
    with pytest.raises(ValueError, match="model"):
        ckpt.measure_kept_bytes("gpt", None, None)


def test_full_checkpointing_costs_about_one_extra_forward():
    # Closed form for explicit attention with dropout (no early stop): forward F, backward 2F.
    config = GPTConfig(vocab_size=64, seq_len=128, d_model=256, n_heads=4, n_layers=24,
                       dropout=0.1, attention="explicit")
    b, s, h, V, L = 2, 128, 256, 64, 24
    block = 24 * b * s * h * h + 4 * b * s * s * h
    F = L * block + 2 * b * s * h * V
    cost = checkpointed.checkpoint_cost(config, b, "blocks")
    assert cost.flops_plain == 3 * F and cost.flops == 3 * F + L * block
    assert 1.3 < cost.flop_ratio < 4 / 3
    assert checkpointed.checkpoint_cost(config, b, "selective").flop_ratio == 1.0
    assert cost.kept_bytes < checkpointed.checkpoint_cost(config, b, "none").kept_bytes / 4


@pytest.mark.parametrize("mode", ["none", "blocks", "sqrt", "selective", "attention"])
def test_engine_predicts_a_later_micro_batch_and_the_timeline_sees_its_peak(mode):
    config = GPTConfig(**{**SMALL, "n_layers": 9})
    model = ckpt.enable_checkpointing(GPT(config), mode)
    x, y = random_tokens(config, 2)
    model(x, y)[1].backward()  # .grad exists: the pass below accumulates in place

    def step():
        model(x, y)[1].backward()

    measured = peak_memory(step)
    # The engine's second micro-batch: the whole gradient already there, each new weight
    # gradient added into it and freed.
    later = predict(Step(config, 2, 2, mode=mode, first_step=True)).moments["backward 2+"]
    predicted = later.activations + later.transient
    timeline = track_timeline(step)
    assert timeline.peak == measured and timeline.allocated[0] > 0 and timeline.unit == "event"
    assert abs(predicted - measured) <= 64, (predicted, measured)


def test_timeline_from_a_synthetic_snapshot():
    trace = [{"action": "segment_alloc", "size": 2 << 20, "time_us": 1},
             {"action": "alloc", "size": 512, "time_us": 2},
             {"action": "alloc", "size": 1024, "time_us": 3},
             {"action": "free_requested", "size": 512, "time_us": 4},
             {"action": "free_completed", "size": 512, "time_us": 5},
             {"action": "alloc", "size": 4, "time_us": 6}]  # a scalar takes a whole block
    timeline = _timeline_from_snapshot({"device_traces": [trace]}, baseline=100)
    assert timeline.clock == [2, 3, 5, 6] and timeline.unit == "µs"
    assert timeline.allocated == [612, 1636, 1124, 1636] and timeline.peak == 1636


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_record_timeline_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        record_timeline(lambda: None)


@pytest.mark.gpu
def test_cuda_gradients_unchanged_and_memory_lower():
    config = GPTConfig(vocab_size=256, seq_len=256, d_model=256, n_heads=4, n_layers=8,
                       dropout=0.1)
    base = GPT(config).cuda()
    x, y = random_tokens(config, 8, device="cuda")
    loss0, g0 = _grads(base, x, y)
    model = ckpt.enable_checkpointing(copy.deepcopy(base), "blocks")
    loss1, g1 = _grads(model, x, y)
    assert torch.equal(loss0, loss1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b)
    kept = {m: ckpt.measure_kept_bytes(ckpt.enable_checkpointing(model, m), x, y)
            for m in ("none", "blocks")}
    assert kept["blocks"] < kept["none"] / 4


@pytest.mark.gpu
def test_cuda_timeline_peak_is_the_allocator_peak():
    config = GPTConfig(vocab_size=256, seq_len=256, d_model=256, n_heads=4, n_layers=4)
    model = GPT(config).cuda()
    x, y = random_tokens(config, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    timeline = record_timeline(lambda: model(x, y)[1].backward())
    assert timeline.peak == torch.cuda.max_memory_allocated()
    assert timeline.clock[0] == 0 and len(timeline.allocated) > 10


def test_segments_memory_counts_checkpoint_sequentials_cut():
    # (k - 1) kept inputs + the last segment's blocks whole, in block inputs.
    assert ckpt._segments_memory(64, 32, 16.0) == 31 + 2 * 16.0
    assert ckpt._segments_memory(36, 24, 1.0) == 23 + 13  # the remainder lands in the last segment
    assert ckpt._segments_memory(10, 1, 2.0) == 20.0  # one segment: nothing checkpointed
    for n, ratio in ((64, 16.0), (100, 9.0), (1000, 9.0), (25, 1.0)):
        best = ckpt.best_segments(n, ratio)
        costs = [ckpt._segments_memory(n, k, ratio) for k in range(1, n + 1)]
        assert ckpt._segments_memory(n, best, ratio) == min(costs)
        assert best == costs.index(min(costs)) + 1  # the fewer segments on a tie
    assert ckpt.best_segments(64, 16.0) == 32 and ckpt.best_segments(36, 16.375) == 18
    # With A = X the best count is about sqrt(n); with A = 16 X about sqrt(16 n).
    assert abs(ckpt.best_segments(100, 1.0) - 10) <= 1
    assert abs(ckpt.best_segments(1024, 16.0) - 128) <= 16


def test_best_segments_is_the_engines_best():
    config = GPTConfig(vocab_size=32, seq_len=64, d_model=16, n_heads=2, n_layers=1)
    ratio = checkpointed.block_ratio(config, 16)
    assert ratio == pytest.approx(16.375)
    for n in (4, 9, 16, 36, 64):
        c = GPTConfig(**{**config.__dict__, "n_layers": n})

        def peak(k, c=c):
            step = Step(c, 16, mode="sqrt", segments=k, first_step=True)
            return predict(step).moments["backward"].step_peak
        assert peak(ckpt.best_segments(n, ratio)) == min(peak(k) for k in range(1, n + 1))


def test_n_segments_are_not_per_block_checkpointing():
    # checkpoint_sequential leaves its last block unchecked, alive beside the head and the loss at
    # the start of the backward pass: measured, k = n segments peak above per-block checkpointing
    # by the same bytes at every depth, as the engine predicts (lecture 04, section 3).
    sweep = dict(vocab_size=32, seq_len=64, d_model=16, n_heads=2)
    gaps = []
    for n in (4, 16):
        config = GPTConfig(**sweep, n_layers=n)
        model = GPT(config)
        x, y = random_tokens(config, 16)
        peaks = {}
        for mode, k in (("blocks", None), ("sqrt", n)):
            ckpt.enable_checkpointing(model, mode, segments=k)
            peaks[mode] = peak_memory(lambda m=model, a=x, b=y: m(a, b)[1].backward(), device="cpu")
            model.zero_grad(set_to_none=True)
            step = Step(config, 16, mode=mode, segments=k, first_step=True)
            assert peaks[mode] == predict(step).moments["backward"].step_peak
        gaps.append(peaks["sqrt"] - peaks["blocks"])
    assert gaps[0] == gaps[1] > 0


def test_block_ratio_is_what_a_block_keeps_over_its_input():
    config = GPTConfig(**SMALL)
    items = checkpointed.kept_by_block(config, 2)[0]
    assert checkpointed.block_ratio(config, 2) == sum(i.nbytes for i in items) / (2 * 16 * 32 * 4)
    # Under autocast the input stays fp32 while the activations are 16-bit: a smaller ratio.
    assert checkpointed.block_ratio(config, 2, dtype=torch.float16, gpu="T4", autocast=True) < \
        checkpointed.block_ratio(config, 2)


@pytest.mark.parametrize("call,name", [
    (lambda: ckpt.best_segments(4, -1.0), "block_ratio"),
    (lambda: ckpt.best_segments(2000, 1.0), "n_layers"),
    (lambda: checkpointed.block_ratio({"n_layers": 2}, 2), "config"),
    (lambda: checkpointed.block_ratio(GPTConfig(**SMALL), 0), "batch_size"),
])
def test_segment_counts_name_a_bad_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_saves_the_attention_output_and_the_mlp_output_only_under_dropout(dropout):
    config = GPTConfig(**SMALL, dropout=dropout)  # sdpa: one fused attention op
    model = ckpt.enable_checkpointing(GPT(config), "selective")
    assert model.checkpointing.policy == ckpt.SAVE_OPS
    assert model.checkpointing.recompute_linear == ckpt.BLOCK_LINEARS
    items = checkpointed.kept_by_block(config, 2, "selective")[0]
    # On the CPU, sdpa runs its flash kernel without dropout, its math kernel (bmm) with it.
    assert any(i.op.startswith("sdpa/") and i.what == "logsumexp" for i in items) == (not dropout)
    assert any(i.op.startswith("mlp proj") for i in items) == (dropout > 0)
    # What the rerun computes: no matmul and no attention kernel, with or without dropout.
    x, y = random_tokens(config, 2)
    with FlopCounterMode(display=False) as counter:
        model(x, y)[1].backward()
    assert counter.get_total_flops() == checkpointed.step_flops(config, 2)[0]
    # A policy of one's own is used as given: a list keeps the MLP output too.
    mine = ckpt.enable_checkpointing(GPT(config), "selective", policy=list(ckpt.SAVE_OPS))
    assert mine.checkpointing.recompute_linear is None
    own = ckpt.measure_kept_bytes(mine, x, y) - ckpt.measure_kept_bytes(model, x, y)
    assert own == (0 if dropout > 0 else 5 * 2 * 16 * 32 * 4)  # one (b, s, h) fp32 per block


def test_selective_context_counts_linears_apart_in_forward_and_recomputation():
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    context = ckpt.SelectiveContext(ckpt.SAVE_OPS, recompute_linear=2)
    policy = context.policy()
    forward, rerun = (SelectiveCheckpointContext(is_recompute=r) for r in (False, True))
    addmm = torch.ops.aten.addmm.default
    assert [policy(forward, addmm) for _ in range(3)] == [
        CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE]
    assert policy(rerun, addmm) == CheckpointPolicy.MUST_SAVE  # its own count starts at 1
    assert policy(forward, torch.ops.aten.gelu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert repr(context).startswith("save mm, addmm, bmm") and "linear 2" in repr(context)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="recompute_linear"):
            ckpt.SelectiveContext(ckpt.SAVE_OPS, bad)
    with pytest.raises(ValueError, match="ops"):
        ckpt.SelectiveContext([torch.ops.aten.mm])


def test_the_kernel_modes_keep_the_gradients_and_name_their_policy():
    pytest.importorskip("triton")
    config = GPTConfig(**{**SMALL, "n_layers": 2}, fused_mlp=True)
    x, y = random_tokens(config, 2)
    torch.manual_seed(0)
    plain = GPT(config)
    want = _grads(plain, x, y)
    for mode in ckpt.KERNEL_MODES:
        model = ckpt.enable_checkpointing(copy.deepcopy(plain), mode)
        assert model.checkpointing.policy == ckpt.KERNEL_POLICIES[mode]
        assert model.checkpointing.recompute_linear == ckpt.BLOCK_LINEARS
        assert ckpt.policy_label(mode, 2) == f"{mode}/2"
        got = _grads(model, x, y)
        torch.testing.assert_close(got[0], want[0])
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w)
        assert checkpointed.step_flops(config, 2, mode) == checkpointed.step_flops(config, 2, "selective")
    items = checkpointed.kept_by_block(config, 2, "save-kernel")[0]
    assert [i.op for i in items][-1] == "bias_gelu (course kernel)"
    with pytest.raises(ValueError, match="fused_mlp"):
        ckpt.enable_checkpointing(GPT(GPTConfig(**SMALL)), "save-kernel")
    with pytest.raises(ValueError, match="fused_mlp"):
        checkpointed.kept_by_block(GPTConfig(**SMALL), 2, "recompute-kernel")
    with pytest.raises(ValueError, match="policy"):
        ckpt.enable_checkpointing(GPT(config), "save-kernel", policy=list(ckpt.SAVE_OPS))
