"""course_lib.training.levers: each lever against an independent derivation: the chunked loss against
``F.cross_entropy`` and its gradients, quantized state bytes against torchao's own tensors; the
memory engine's chunked-loss term against the tracker. The hooks lecture 08 writes (the optimizer
in backward, saved-tensor hooks that offload), written here too, against the ordinary step, the
saved tensors autograd reports and the engine's predictions."""

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import device
from course_lib.measurement.memory import peak_memory, saved_bytes
from course_lib.model.gpt import GPT, GPTConfig, param_numels, random_tokens
from course_lib.planning import fit_ladder
from course_lib.prediction import activations as act, step_setup, time_model
from course_lib.prediction.predict import Step, predict
from course_lib.training import levers
from course_lib.training.loop import _TrainLog, train

TINY = GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_layers=2)


# --------------------------------------------------------------------------- chunked loss

@pytest.mark.parametrize("chunk", [1, 3, 7, 10, 64])
def test_chunked_loss_and_gradients_equal_cross_entropy(chunk):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (2, 5), generator=g)
    t[0, 3] = t[1, 0] = -100
    got = levers.chunked_cross_entropy(h, w, t, chunk)
    want = F.cross_entropy((h @ w.T).reshape(-1, 50), t.reshape(-1))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_chunked_loss_in_bf16_matches_the_course_gpts_fp32_loss():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(12, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    t = torch.randint(0, 40, (12,), generator=g)
    got = levers.chunked_cross_entropy(h, w, t, 5)
    want = F.cross_entropy((h @ w.T).float(), t)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    gh, gw = torch.autograd.grad(got, (h, w))
    wh, ww = torch.autograd.grad(want, (h, w))
    assert gh.dtype == torch.bfloat16
    torch.testing.assert_close(gh.float(), wh.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw.float(), ww.float(), rtol=2e-2, atol=2e-3)


def test_chunked_loss_of_only_ignored_targets_is_nan_like_cross_entropy():
    h, w = torch.randn(3, 4), torch.randn(6, 4)
    t = torch.full((3,), -100)
    assert math.isnan(levers.chunked_cross_entropy(h, w, t, 2))
    assert math.isnan(F.cross_entropy(h @ w.T, t))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None, "8"])
def test_chunk_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        levers.chunked_cross_entropy(torch.randn(3, 4), torch.randn(6, 4), torch.zeros(3).long(),
                                     bad)


def test_chunked_loss_rejects_mismatched_inputs():
    h, w, t = torch.randn(3, 4), torch.randn(6, 4), torch.zeros(3).long()
    with pytest.raises(ValueError, match="weight"):
        levers.chunked_cross_entropy(h, torch.randn(6, 5), t, 2)
    with pytest.raises(ValueError, match="targets"):
        levers.chunked_cross_entropy(h, w, torch.zeros(4).long(), 2)
    with pytest.raises(ValueError, match="targets"):
        levers.chunked_cross_entropy(h, w, torch.zeros(3), 2)
    with pytest.raises(ValueError, match="hidden"):
        levers.chunked_cross_entropy(torch.zeros(3, 4).long(), w, t, 2)
    with pytest.raises(ValueError, match="dtype"):
        levers.chunked_cross_entropy(h, w.double(), t, 2)


def test_use_chunked_loss_gives_the_gpts_loss_and_switches_back():
    model = GPT(TINY)
    x, y = random_tokens(TINY, 3)
    plain = model(x, y)[1]
    assert levers.use_chunked_loss(model, 8) is model
    logits, chunked = model(x, y)
    assert logits is None and model.loss_chunk == 8
    torch.testing.assert_close(chunked, plain)
    assert model(x).shape == (3, TINY.seq_len, TINY.vocab_size)  # without targets: logits
    levers.use_chunked_loss(model, None)
    assert model(x, y)[0] is not None and model.loss_chunk is None
    with pytest.raises(ValueError, match="chunk_size"):
        levers.use_chunked_loss(model, 0)
    with pytest.raises(ValueError, match="model"):
        levers.use_chunked_loss(nn.Linear(2, 2), 4)


CHUNK_GRID = [
    (GPTConfig(vocab_size=4096, seq_len=32, d_model=32, n_heads=2, n_layers=2), 4, "fp32", 16),
    (GPTConfig(vocab_size=4096, seq_len=32, d_model=32, n_heads=2, n_layers=1), 2, "bf16", 64),
    (GPTConfig(vocab_size=8192, seq_len=16, d_model=32, n_heads=2, n_layers=1), 1, "fp32", 8),
    (GPTConfig(vocab_size=2048, seq_len=32, d_model=32, n_heads=2, n_layers=1, dropout=0.1),
     2, "bf16-mixed", 16),
]


@pytest.mark.parametrize("cfg,b,precision,chunk", CHUNK_GRID)
def test_engine_predicts_the_chunked_loss_step(cfg, b, precision, chunk):
    predicted = predict(Step(cfg, b, precision=precision, loss_chunk=chunk))
    measured = step_setup.measure_step_memory(predicted.step)
    assert abs(predicted.total - measured) <= 8, (predicted.peak, measured)
    assert predicted.total <= predict(Step(cfg, b, precision=precision)).total


def test_the_training_loop_trains_through_the_chunked_loss():
    """loop.train on a chunked-loss model: the plain model's loss and weights after a step of
    two micro-batches, without the (N, V) logits the plain loss holds."""
    cfg = CHUNK_GRID[0][0]  # a large vocabulary: the logits are the peak
    x, y = random_tokens(cfg, 4)
    y[0, :5] = -100  # micro-batches of different token counts: weighted by tokens
    weights, losses, peaks = [], [], []
    for chunk in (None, 8):
        model = levers.use_chunked_loss(step_setup.build(cfg)[0], chunk)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the weights move by the gradient
        log = _TrainLog()
        peaks.append(peak_memory(functools.partial(
            train, model, optimizer, [(x, y)], micro_batch_size=2, accumulation_steps=2, log=log),
            device="cpu"))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        losses.append(log.losses[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert torch.allclose(weights[1], weights[0], atol=1e-6), (weights[1] - weights[0]).abs().max()
    assert peaks[0] - peaks[1] >= 2 * cfg.seq_len * cfg.vocab_size * 4  # a micro-batch's fp32 logits


def test_measuring_a_step_refuses_the_levers_it_does_not_run():
    for field, value in [("in_backward", True), ("state_bits", 8), ("offload_activations", True),
                         ("offload_optimizer", True), ("lora_rank", 4), ("zero_stage", 1),
                         ("world_size", 2)]:
        with pytest.raises(ValueError, match=field):
            step_setup.measure_step_memory(Step(TINY, 2, **{field: value}))
    with pytest.raises(TypeError, match="step"):
        step_setup.measure_step_memory(TINY)


def test_a_step_rejects_a_bad_loss_chunk():
    with pytest.raises(ValueError, match="loss_chunk"):
        Step(TINY, 2, loss_chunk=0)
    with pytest.raises(ValueError, match="loss_chunk"):
        Step(TINY, 2, precision="autocast-bf16", loss_chunk=4)
    with pytest.raises(TypeError, match="loss_chunk"):
        Step(TINY, 2, loss_chunk="4")


# --------------------------------------------------------------------------- optimizer in backward

def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def _in_backward(model):
    """Lecture 08's optimizer in backward: an AdamW per parameter, stepped by its hook."""
    optimizers = {p: _adamw([p]) for p in model.parameters()}

    def step_now(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    return optimizers


def _steps(optimizers):
    return sum(int(opt.state[p]["step"]) for p, opt in optimizers.items())


def test_optimizer_in_backward_gives_the_ordinary_steps_weights():
    torch.manual_seed(0)
    ordinary, fused = GPT(TINY), GPT(TINY)
    fused.load_state_dict(ordinary.state_dict())
    optimizer = _adamw(ordinary.parameters())
    optimizers = _in_backward(fused)
    for step in range(4):
        x, y = random_tokens(TINY, 3, seed=step)
        ordinary(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        fused(x, y)[1].backward()
        assert all(p.grad is None for p in fused.parameters())
    assert _steps(optimizers) == 4 * len(param_numels(TINY))
    for a, b in zip(ordinary.parameters(), fused.parameters()):
        assert torch.equal(a, b)  # per-tensor AdamW: the same arithmetic, bit for bit


def test_optimizer_in_backward_lowers_the_measured_peak_by_about_the_gradients():
    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=128, n_heads=4, n_layers=2)
    torch.manual_seed(0)
    a, b = GPT(cfg), GPT(cfg)
    b.load_state_dict(a.state_dict())
    opt = _adamw(a.parameters())
    _in_backward(b)
    x, y = random_tokens(cfg, 1)

    def ordinary():
        a(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ordinary()
    b(x, y)[1].backward()  # both optimizers have their state now
    before, after = peak_memory(ordinary), peak_memory(lambda: b(x, y)[1].backward())
    grads = 4 * sum(param_numels(cfg))
    assert before - after >= 0.5 * grads
    assert before == predict(Step(cfg)).peak.step_peak - 4  # the engine's loss scalar


def test_accumulation_steps_every_micro_batch_under_optimizer_in_backward():
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizers = _in_backward(model)
    x, y = random_tokens(TINY, 4)
    for xk, yk in zip(x.split(2), y.split(2)):
        (model(xk, yk)[1] / 2).backward()
    assert _steps(optimizers) == 2 * len(param_numels(TINY))  # two steps, not one


# --------------------------------------------------------------------------- offloading

def test_offload_hooks_pack_exactly_what_autograd_saves_and_change_nothing():
    torch.manual_seed(0)
    model = GPT(TINY)
    x, y = random_tokens(TINY, 2)
    loss = model(x, y)[1]
    kept = saved_bytes(loss, model.parameters())
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    storages, weights = {}, []  # every storage stays alive while counted: addresses are unique

    def pack(t):  # lecture 08's hooks: parameters stay, the rest goes to the host
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            weights.append(t)
            return t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.device, t.cpu()

    def unpack(packed):
        return packed if isinstance(packed, torch.Tensor) else packed[1].to(packed[0])

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model(x, y)[1]
    loss.backward()
    assert sum(storages.values()) == kept == act.predict_saved_bytes(TINY, 2) and weights
    for g, p in zip(grads, model.parameters()):
        assert torch.equal(g, p.grad)


def test_transfer_seconds():
    assert time_model.transfer_seconds(63_000_000_000, device.PCIE_BYTES_PER_S["PCIe 5.0 x16"]) == 1.0
    with pytest.raises(ValueError, match="nbytes"):
        time_model.transfer_seconds(-1, 1e9)
    with pytest.raises(ValueError, match="bytes_per_second"):
        time_model.transfer_seconds(1, 0)


# --------------------------------------------------------------------------- optimizer states

def test_optimizer_state_bytes_of_adamw_and_of_master_weights():
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    assert levers.optimizer_state_bytes(opt) == 0
    model(*random_tokens(TINY, 2))[1].backward()
    opt.step()
    numels = param_numels(TINY)
    assert levers.optimizer_state_bytes(opt) == 8 * sum(numels) + 4 * len(numels)
    assert levers.low_bit_state_bytes(numels, 32) == levers.optimizer_state_bytes(opt)
    mixed, master = step_setup.build(TINY, precision="bf16-mixed")
    assert levers.optimizer_state_bytes(master) == 4 * sum(numels)  # master copies, no state yet
    with pytest.raises(ValueError, match="optimizer"):
        levers.optimizer_state_bytes(object())


@pytest.mark.parametrize("bits", [8, 4])
def test_low_bit_state_bytes_equal_torchaos_tensors(bits):
    pytest.importorskip("torchao")
    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=64, n_heads=4, n_layers=1)
    model = GPT(cfg)
    opt = levers.low_bit_adamw(bits)(model.parameters(), lr=1e-3)
    model(*random_tokens(cfg, 2))[1].backward()
    with torch.compiler.set_stance("force_eager"):  # torchao compiles its step
        opt.step()
    numels = param_numels(cfg)
    measured = levers.optimizer_state_bytes(opt)
    assert measured == levers.low_bit_state_bytes(numels, bits)
    assert measured < levers.low_bit_state_bytes(numels, 32) / (2.5 if bits == 8 else 4)


def test_low_bit_state_bytes_by_hand():
    # one 4096-element tensor: codes, 16 (8-bit) or 32 (4-bit) fp32 scales, the map; a 10-element one
    assert levers.low_bit_state_bytes([4096], 8) == 4 + 2 * (4096 + 4 * 16 + 4 * 256)
    assert levers.low_bit_state_bytes([4096], 4) == 4 + 2 * (2048 + 4 * 32 + 4 * 16)
    assert levers.low_bit_state_bytes([10], 8) == 4 + 80
    assert levers.low_bit_state_bytes([4100], 8) == 4 + 2 * 4 * 4100  # 256 does not divide it
    with pytest.raises(ValueError, match="bits"):
        levers.low_bit_state_bytes([4096], 16)
    with pytest.raises(ValueError, match="bits"):
        levers.low_bit_adamw(2)


# --------------------------------------------------------------------------- LoRA

def test_lora_parameter_count_against_built_adapters():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=48, n_heads=4, n_layers=3)
    model, r = GPT(cfg), 4
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and name.startswith("blocks.")]
    built = sum(r * (m.in_features + m.out_features) for m in linears)
    assert levers.lora_parameter_count(cfg, r) == built == 16 * cfg.d_model * r * cfg.n_layers
    assert levers.lora_parameter_count(cfg, r, ("attn.qkv",)) == 3 * r * (48 + 144)
    with pytest.raises(ValueError, match="targets"):
        levers.lora_parameter_count(cfg, r, ("q_proj",))
    with pytest.raises(ValueError, match="rank"):
        levers.lora_parameter_count(cfg, 0)


def test_frozen_linear_flops_count_every_weight_gradient_matmul():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=48, n_heads=4, n_layers=3)
    weights = [p.numel() for name, p in GPT(cfg).named_parameters()
               if p.dim() == 2 and name != "pos_emb.weight"]  # the head is tied to tok_emb
    assert levers.frozen_linear_flops(cfg, 10) == 2 * 10 * sum(weights)


# --------------------------------------------------------------------------- the fit ladder

GPT2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)


def test_ladder_ranks_every_lever_by_bytes_saved_per_time_paid_and_finds_a_fit():
    result = fit_ladder.ladder(GPT2, "T4", batch_size=32)
    groups = {r.group for r in result.rungs}
    assert groups == {"precision", "accumulation", "checkpointing", "chunked loss",
                      "optimizer in backward", "optimizer states", "offload activations",
                      "offload optimizer", "LoRA", "ZeRO"}
    ordinary = [r for r in result.rungs if r.group not in fit_ladder.JOB_CHANGING]
    assert all(r.group in fit_ladder.JOB_CHANGING for r in result.rungs[len(ordinary):])
    saving = [r for r in ordinary if r.bytes_saved > 0]
    assert ordinary[len(saving):] == [r for r in ordinary if r.bytes_saved <= 0]  # nothing: last
    free = [r for r in saving if r.time_paid <= 1e-6]
    paid = saving[len(free):]
    assert all(r.time_paid > 1e-6 for r in paid)
    # Each rung is the plain step with its lever's fields and nothing else, predicted again
    # here: free levers by time gained (most first), the others by bytes per time paid.
    plain = Step(GPT2, 32, gpu="T4")
    by = {r.lever: r.step for r in result.rungs}
    assert by["accumulation: 1 sequence per micro-batch"] == Step(GPT2, 1, 32, gpu="T4")
    assert by["checkpointing blocks/2"] == Step(GPT2, 32, mode="blocks", every=2, gpu="T4")
    assert by["8-bit AdamW states"] == dataclasses.replace(plain, state_bits=8)
    assert by["ZeRO-3 on 8 GPUs"] == Step(GPT2, 32, gpu="T4", zero_stage=3, world_size=8)
    base = predict(plain)

    def again(r):
        p = predict(r.step)
        return base.total - p.total, p.seconds / base.seconds - 1

    assert all(again(r)[0] > 0 and again(r)[1] <= 1e-6 for r in free)
    assert all(again(a)[1] <= again(b)[1] for a, b in zip(free, free[1:]))
    per_time = [saved / paid for saved, paid in map(again, paid)]
    assert all(a >= b for a, b in zip(per_time, per_time[1:])) and len(paid) >= 5
    # not cheapest first: the chunked loss (+8.2 %) saves more per time than offloading the
    # optimizer (+2.2 %) and comes before it
    names = [r.lever for r in result.rungs]
    assert names.index("chunked loss (1024 tokens)") < names.index("offload optimizer states")
    assert not result.baseline.total <= result.budget_bytes  # fp32, whole batch: it does not fit
    assert result.budget_bytes == device.GPUS["T4"].total_memory
    assert result.fits and result.memory.total <= result.budget_bytes
    assert [m.total for _, m, _ in result.climb] == sorted(
        (m.total for _, m, _ in result.climb), reverse=True)
    # T4: fp16
    assert result.step == Step(GPT2, 1, 32, precision="fp16-mixed", gpu="T4")
    assert result.memory.total == predict(result.step).total


def test_the_engines_rungs_hold_what_measured_steps_hold():
    """The rungs the engine predicts alone: their steps on a small model against its steps
    measured on the CPU (exact without dropout)."""
    result = fit_ladder.ladder(GPT2, "A100 80GB", batch_size=8)
    by = {r.lever: r for r in result.rungs}
    assert by["precision bf16-mixed"].time_paid < 0  # 16-bit tensor cores against fp32
    small = GPTConfig(vocab_size=2048, seq_len=32, d_model=32, n_heads=2, n_layers=2)
    for lever, change in [("precision bf16-mixed", {}), ("checkpointing blocks/1", {}),
                          ("chunked loss (1024 tokens)", {"loss_chunk": 16})]:
        rung = by[lever]
        step = dataclasses.replace(rung.step, config=small, micro_batch_size=4, seq_len=None,
                                   gpu=None, **change)
        assert rung.how == "engine" and rung.bytes_saved > 0, lever
        assert abs(predict(step).total - step_setup.measure_step_memory(step)) <= 8, lever


def _torchao_state_bytes(numel: int, bits: int) -> int:
    """torchao's block-wise AdamW states of one tensor, written out: ``m`` and ``v`` each hold
    codes, one fp32 scale per block (256 elements at 8 bits, 128 at 4) and a quantization map
    of 256 (16) fp32 values, for tensors of at least 4096 elements that the block divides;
    other tensors keep fp32 states. Plus AdamW's 4-byte step counter."""
    block, entries = {8: (256, 256), 4: (128, 16)}[bits]
    if numel >= 4096 and numel % block == 0:
        return 4 + 2 * (numel * bits // 8 + 4 * (numel // block) + 4 * entries)
    return 4 + 2 * 4 * numel


def test_lever_closed_forms():
    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=128, n_heads=4, n_layers=2)
    plain = predict(Step(cfg)).peak
    model = GPT(cfg)
    numels = [p.numel() for p in model.parameters()]
    eight = predict(Step(cfg, state_bits=8)).peak
    assert eight.optimizer_state == sum(_torchao_state_bytes(n, 8) for n in numels)
    zero3 = predict(Step(cfg, zero_stage=3, world_size=4)).peak
    assert zero3.total < plain.total
    r = 4
    adapters = sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and name.startswith("blocks."))
    lora = predict(Step(cfg, lora_rank=r)).peak
    assert 0 < lora.gradients <= 4 * adapters  # fp32 gradients of the adapters at most


@pytest.mark.parametrize("fields, error, name", [
    (dict(micro_batch_size=1, accumulation_steps=2, in_backward=True), ValueError, "in_backward"),
    (dict(state_bits=16), ValueError, "state_bits"),
    (dict(state_bits="8"), TypeError, "state_bits"),
    (dict(lora_rank=129), ValueError, "lora_rank"),  # beyond d_model: no low-rank adapter
    (dict(zero_stage=4), ValueError, "zero_stage"),
    (dict(world_size=0), ValueError, "world_size"),
    (dict(offload_optimizer=1), TypeError, "offload_optimizer"),
])
def test_a_bad_lever_field_is_refused_by_name(fields, error, name):
    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=128, n_heads=4, n_layers=2)
    with pytest.raises(error, match=name):
        Step(cfg, **fields)
    with pytest.raises(error, match=name):  # a search replacing a field is checked again
        dataclasses.replace(Step(cfg), **fields)


def test_zero3_rung_holds_the_units_of_zero3_memory():
    """The ladder's ZeRO-3 rung is lecture 07's model: the shards plus the gathered units."""
    from course_lib.prediction.formulas import zero3_memory

    cfg = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
    mixed = Step(cfg, 8, precision="bf16-mixed", gpu="T4")
    peak = predict(dataclasses.replace(mixed, zero_stage=3, world_size=8)).peak
    during = zero3_memory(cfg, precision="bf16-mixed", world_size=8)
    assert peak.moment.startswith("backward")
    assert peak.model_states == during.parameters + during.master_weights + during.optimizer_state
    sharded = zero3_memory(cfg, precision="bf16-mixed", world_size=8, during_step=False)
    plain = predict(mixed).moments["backward"]
    assert peak.gradients == -(-plain.gradients // 8) + during.gradients - sharded.gradients
    rung = next(r for r in fit_ladder.ladder(cfg, "T4", batch_size=8).rungs
                if r.lever == "ZeRO-3 on 8 GPUs")
    fp32 = zero3_memory(cfg, world_size=8)
    assert rung.memory.model_states == fp32.parameters + fp32.optimizer_state


def test_optimizer_in_backward_step_against_the_measured_step():
    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=128, n_heads=4, n_layers=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizers = _in_backward(model)
    x, y = random_tokens(cfg, 1)
    model(x, y)[1].backward()  # the states exist now
    states = sum(levers.optimizer_state_bytes(o) for o in optimizers.values())
    measured = 4 * sum(param_numels(cfg)) + states + peak_memory(lambda: model(x, y)[1].backward())
    predicted = predict(Step(cfg, in_backward=True)).total
    assert abs(predicted - measured) <= 0.05 * measured
    assert predicted < predict(Step(cfg)).total


def test_a_stated_utilization_reaches_the_time_of_every_rung():
    """At one utilisation for every dtype, 16-bit tensor cores speed a T4's step by their
    datasheet rate over fp32's (65 / 8.1 TFLOPS) on the matmuls, less on the rest."""
    default = fit_ladder.ladder(GPT2, "T4", batch_size=8)
    stated = fit_ladder.ladder(GPT2, "T4", batch_size=8, utilization=0.5)
    speed = dataclasses.replace(time_model.device_speed("T4"), utilisation=0.5)
    for r in stated.rungs:
        p, base = predict(r.step, speed), predict(Step(GPT2, 8, gpu="T4"), speed)
        assert r.time_paid == pytest.approx(p.seconds / base.seconds - 1), r.lever
    half = next(r for r in stated.rungs if r.lever == "precision fp16-mixed")
    assert -1 + 8.1 / 65 < half.time_paid < 0
    assert half.time_paid != next(r for r in default.rungs if r.lever == half.lever).time_paid


def test_ladder_validates():
    with pytest.raises(ValueError, match="gpu"):
        fit_ladder.ladder(GPT2, "V100")
    with pytest.raises(ValueError, match="batch_size"):
        fit_ladder.ladder(GPT2, "T4", batch_size=0)
    with pytest.raises(TypeError, match="batch_size"):
        fit_ladder.ladder(GPT2, "T4", batch_size=2.0)
    with pytest.raises(ValueError, match="seq_len"):
        fit_ladder.ladder(GPT2, "T4", seq_len=4096)
    with pytest.raises(ValueError, match="utilization"):
        fit_ladder.ladder(GPT2, "T4", utilization=0)
    with pytest.raises(ValueError, match="lora_rank"):
        fit_ladder.ladder(GPT2, "T4", lora_rank=GPT2.d_model + 1)


def test_the_chunked_loss_reads_nothing_off_the_device():
    """On the meta device any read of a value (int(), .item(), a boolean mask) raises: the
    forward and backward passes run through, so a GPU step never waits for the device here."""
    h = torch.empty(6, 4, device="meta", requires_grad=True)
    w = torch.empty(10, 4, device="meta", requires_grad=True)
    t = torch.empty(6, dtype=torch.long, device="meta")
    levers.chunked_cross_entropy(h, w, t, 4).backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape
