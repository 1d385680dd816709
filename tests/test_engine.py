"""course_lib.prediction.engine: one step's peak bytes, against the live-tensor tracker on the CPU and the
CUDA allocator on a GPU, for every precision, checkpointing mode and target."""

import dataclasses
import itertools
import statistics

import pytest
import torch

from course_lib.device import GPUS, pick_dtype, resolve_gpu
from course_lib.measurement.memory import peak_memory, training_step
from course_lib.model import kernels
from course_lib.model.gpt import GPT, GPTConfig, param_numels, random_tokens
from course_lib.prediction import checkpointed, engine, step_setup
from course_lib.prediction.predict import Step, predict
from course_lib.training import checkpointing


def peak(config, b, K=1, **fields):
    """The peak moment of a step, through the one entry."""
    return predict(Step(config, b, K, **fields)).peak


def moments(config, b, K=1, **fields):
    return predict(Step(config, b, K, **fields)).moments

SMALL = dict(vocab_size=40, seq_len=32, d_model=32, n_heads=4, n_layers=3)

# Each shape makes a different moment the peak: the loss's logits, the MLP, explicit attention,
# AdamW's step, and SDPA's math kernel in the forward pass.
STEP_GRID = [
    GPTConfig(vocab_size=512, seq_len=16, d_model=32, n_heads=2, n_layers=2),
    GPTConfig(vocab_size=32, seq_len=64, d_model=64, n_heads=2, n_layers=1, dropout=0.1),
    GPTConfig(vocab_size=32, seq_len=128, d_model=32, n_heads=4, n_layers=1, attention="explicit"),
    GPTConfig(vocab_size=512, seq_len=16, d_model=128, n_heads=4, n_layers=2),
    GPTConfig(vocab_size=32, seq_len=128, d_model=32, n_heads=2, n_layers=1, dropout=0.1),
]


@pytest.mark.parametrize("cfg", STEP_GRID, ids=["loss", "mlp", "attention", "adamw", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_step_peak_matches_the_tracker(cfg, dtype):
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x, y = (t.clone() for t in random_tokens(cfg, 2))
    measured = peak_memory(lambda: training_step(model, opt, x, y), device="cpu")
    precision = "fp32" if dtype == torch.float32 else "bf16"
    pred = peak(cfg, 2, precision=precision, first_step=True)
    assert abs(pred.step_peak - measured) <= 0.03 * measured, (pred, measured)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert pred.parameters == params
    # the whole device's bytes against the measured ones: the parameters plus the step's peak
    assert abs(pred.total - (params + measured)) <= 0.03 * measured, (pred, measured)
    assert pred.step_peak == pred.total - pred.parameters          # fresh optimizer: only params


def test_first_step_is_exact_to_the_byte_where_the_cpu_kernels_allow():
    for cfg in STEP_GRID[:4]:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        x, y = (t.clone() for t in random_tokens(cfg, 2))
        measured = peak_memory(lambda m=model, o=opt, x=x, y=y: training_step(m, o, x, y))
        predicted = peak(cfg, 2, first_step=True).step_peak
        # the tracker misses only the 8-byte host scalar of explicit attention
        assert 0 <= predicted - measured <= 8 * cfg.n_layers, cfg


def test_the_peak_moves_from_activations_to_the_optimizer_step():
    small = peak(STEP_GRID[3], 1, seq_len=16, first_step=True)
    big = peak(STEP_GRID[3], 64, seq_len=16, first_step=True)
    assert small.moment == "AdamW step" and small.activations == 0
    assert small.optimizer_state == 2 * small.parameters + 4 * len(param_numels(STEP_GRID[3]))
    assert big.moment.startswith("backward") and big.activations > big.gradients


def _second_adamw_step(foreach: bool) -> tuple[int, list[int]]:
    """(bytes AdamW's second step allocates, bytes of each parameter) on a two-layer MLP."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 50))
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    for _ in range(2):
        model(torch.randn(4, 30)).sum().backward()
        if opt.state:
            measured = peak_memory(opt.step, device="cpu")
        else:
            opt.step()
    return measured, [p.numel() * 4 for p in model.parameters()]


def test_adamw_scratch_is_what_a_second_step_allocates():
    """Independent measurement: with m and v allocated, AdamW's step only allocates its scratch."""
    measured, sizes = _second_adamw_step(foreach=False)
    assert measured == engine.adamw_scratch_bytes(sizes) == sizes[1] + 2 * sizes[2]


def test_foreach_defaults_to_what_pytorch_runs_where_the_step_runs():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
    for gpu, foreach in ((None, False), ("T4", True), ("H100 80GB", True)):
        assert peak(cfg, 2, gpu=gpu) == peak(
            cfg, 2, gpu=gpu, foreach=foreach)
    assert peak(cfg, 2, gpu="T4") != peak(
        cfg, 2, gpu="T4", foreach=False)


def test_foreach_adamw_scratch_is_one_copy_of_v():
    measured, sizes = _second_adamw_step(foreach=True)
    assert sum(sizes) <= measured <= sum(sizes) + 64  # plus a few 0-d step/bias-correction tensors
    cfg = GPTConfig(**SMALL)
    per_tensor = moments(cfg, 1)["optimizer"].transient
    assert moments(cfg, 1, foreach=True)["optimizer"].transient > per_tensor



def test_foreach_master_weight_adamw_scratch_is_one_copy_of_the_fp32_v():
    """Mixed precision with foreach=True: the optimizer step's scratch is sqrt(v) of every fp32
    master weight at once; measured at batch 1, where that step is the peak."""
    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=2)
    totals = {}
    for foreach in (False, True):
        step = Step(cfg, 1, precision="bf16-mixed", foreach=foreach)
        predicted, measured = predict(step).peak, step_setup.measure_step_memory(step)
        assert abs(predicted.total - measured) <= 16, (foreach, predicted, measured)
        totals[foreach] = predicted
    assert totals[True].moment.startswith("optimizer")
    v = 4 * sum(param_numels(cfg))
    assert totals[True].transient - totals[False].transient >= v // 2

# --------------------------------------------------------------------------- every precision

PRECISION_CASES = [("explicit", 0.0, "none"), ("sdpa", 0.0, "none"), ("explicit", 0.1, "none"),
                   ("sdpa", 0.1, "none"), ("explicit", 0.1, "blocks"), ("sdpa", 0.0, "attention"),
                   ("sdpa", 0.1, "attention")]


@pytest.mark.parametrize("precision", engine.PRECISIONS)
def test_every_precision_against_measured_steady_steps(precision):
    """fp32 and the 16-bit models: exact without dropout (the GradScaler's 4-byte tensors
    aside), within 3.5 % with it; autocast within 5 % (the issue's bound), exact in places."""
    errors, exact = [], 0
    for attention, dropout, mode in PRECISION_CASES:
        cfg = GPTConfig(**SMALL, attention=attention, dropout=dropout)
        step = Step(cfg, 3, precision=precision, mode=mode)
        predicted, measured = predict(step).total, step_setup.measure_step_memory(step)
        errors.append((predicted - measured) / measured)
        exact += abs(predicted - measured) <= 16
        if dropout == 0 and mode == "none" and not precision.startswith("autocast"):
            assert abs(predicted - measured) <= 16, (attention, mode, predicted, measured)
    bound = 0.05 if precision.startswith("autocast") else 0.035
    assert max(abs(e) for e in errors) <= bound, errors
    assert exact >= 3, errors


def test_model_states_per_precision():
    cfg = GPTConfig(**SMALL)
    P = sum(param_numels(cfg))
    for precision in engine.PRECISIONS:
        m = peak(cfg, 1, precision=precision)
        states = m.parameters + m.master_weights + 2 * sum(param_numels(cfg)) * (
            2 if precision == "bf16" else 4)
        assert m.model_states == states + 4 * len(param_numels(cfg)), precision  # + step counters
    plain = peak(cfg, 1, precision="fp32", first_step=True)
    auto = moments(cfg, 1, precision="autocast-bf16")["backward"]
    mixed = moments(cfg, 1, precision="bf16-mixed")["backward"]
    assert auto.parameters == plain.parameters == 4 * P and mixed.parameters == 2 * P
    assert mixed.master_weights == 4 * P and auto.master_weights == 0


# --------------------------------------------------------------------------- GPUs

def test_gpu_predictions_are_allocator_blocks_and_differ_where_the_kernels_do():
    cfg = GPTConfig(vocab_size=1000, seq_len=512, d_model=256, n_heads=4, n_layers=4, dropout=0.1,
                    attention="sdpa")
    for name in GPUS:
        m = peak(cfg, 4, precision="bf16-mixed", gpu=name)
        assert all(v % 512 == 0 for v in m.as_dict().values()), name
    # A T4 has no bf16 attention kernel: bf16 keeps the s x s maps there, fp16 does not.
    t4_bf16 = peak(cfg, 4, precision="bf16-mixed", gpu="T4")
    t4_fp16 = peak(cfg, 4, precision="fp16-mixed", gpu="T4")
    a100 = peak(cfg, 4, precision="bf16-mixed", gpu="A100 80GB")
    maps = 4 * 4 * 512 * 512
    assert t4_bf16.total - t4_fp16.total > 2 * maps
    assert abs(t4_fp16.total - a100.total) < maps
    # CUDA's 1-byte masks and the step counters on the host make it smaller than the CPU's count
    assert a100.total < peak(cfg, 4, precision="bf16-mixed").total


def test_more_of_anything_never_needs_less():
    cfg = GPTConfig(**SMALL, attention="sdpa", dropout=0.1)
    for precision in engine.PRECISIONS:
        for gpu in (None, "T4", "H100 80GB"):
            base = peak(cfg, 2, precision=precision, gpu=gpu).total
            assert peak(cfg, 3, precision=precision, gpu=gpu).total > base
            deeper = dataclasses.replace(cfg, n_layers=4)
            assert peak(deeper, 2, precision=precision, gpu=gpu).total > base


CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2)


@pytest.mark.parametrize("kwargs,name", [
    (dict(config="gpt2"), "config"), (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(accumulation_steps=1.0), "accumulation_steps"), (dict(precision="fp8"), "precision"),
    (dict(precision="bf16-autocast"), "precision"), (dict(mode="full"), "mode"),
    (dict(every=0), "every"), (dict(seq_len=9), "seq_len"), (dict(gpu="V100"), "gpu"),
    (dict(segments=2), "segments"), (dict(first_step="yes"), "first_step"),
    (dict(foreach="yes"), "foreach"), (dict(loss_chunk=0), "loss_chunk"),
    (dict(loss_chunk=4, precision="autocast-bf16"), "loss_chunk"), (dict(state_bits=16), "state_bits"),
    (dict(state_bits=8.0), "state_bits"), (dict(in_backward=1), "in_backward"),
    (dict(in_backward=True, accumulation_steps=2), "in_backward"),
    (dict(offload_activations=None), "offload_activations"), (dict(lora_rank=17), "lora_rank"),
    (dict(zero_stage=4), "zero_stage"), (dict(world_size=0), "world_size"),
    (dict(mode="save-kernel"), "fused MLP")])
def test_a_bad_step_is_refused_where_it_is_made_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Step(**(dict(config=CFG, micro_batch_size=1) | kwargs))


# --------------------------------------------------------------------------- on a GPU

def _cuda_grid():
    """24+ configurations: shapes x attention x dropout x precision x checkpointing."""
    shapes = [dict(vocab_size=8192, seq_len=512, d_model=512, n_heads=8, n_layers=4),
              dict(vocab_size=8192, seq_len=1024, d_model=768, n_heads=12, n_layers=6)]
    modes = [("none", 1), ("blocks", 1), ("selective", 1)]
    return [(shape, attention, dropout, mode)
            for shape in shapes for attention in ("explicit", "sdpa") for dropout in (0.0, 0.1)
            for mode in modes]


@pytest.mark.gpu
def test_engine_against_the_cuda_allocator():
    """The goal on a GPU: median error 3 %, at most 5 %, against max_memory_allocated."""
    precisions = {"fp32", "autocast-bf16" if pick_dtype("cuda") == torch.bfloat16
                  else "autocast-fp16",
                  "bf16-mixed" if pick_dtype("cuda") == torch.bfloat16 else "fp16-mixed"}
    errors = {}
    for shape, attention, dropout, (mode, every) in _cuda_grid():
        cfg = GPTConfig(**shape, attention=attention, dropout=dropout)
        for precision in sorted(precisions):
            step = Step(cfg, 4, precision=precision, mode=mode, every=every, gpu="cuda")
            predicted = predict(step).total
            measured = step_setup.measure_step_memory(step, device="cuda")
            errors[(str(shape["d_model"]), attention, dropout, mode, precision)] = (
                predicted - measured) / measured
            torch.cuda.empty_cache()
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert len(errors) >= 24
    assert statistics.median(abs(e) for e in errors.values()) <= 0.03, errors
    assert abs(errors[worst]) <= 0.05, (worst, errors[worst])


def test_predictions_are_cached_by_the_config_itself():
    engine._moments.cache_clear()
    first = peak(GPTConfig(n_layers=3), 2, precision="bf16-mixed")
    again = peak(GPTConfig(n_layers=3), 2, precision="bf16-mixed")
    info = engine._moments.cache_info()  # an equal config, another object: the cached answer
    assert first == again and (info.hits, info.misses) == (1, 1)
    deeper = peak(GPTConfig(n_layers=4), 2, precision="bf16-mixed")
    assert deeper.total > first.total and engine._moments.cache_info().misses == 2


def test_parameter_sizes_from_two_blocks_equal_every_tensor_summed():
    """The engine sums one block's tensors times the depth; against every tensor, one by one."""
    for n_layers, bias, gpu in [(1, True, None), (2, False, "T4"), (7, True, "H100 80GB")]:
        cfg = GPTConfig(vocab_size=50, seq_len=16, d_model=24, n_heads=3, n_layers=n_layers,
                        bias=bias)
        for element_bytes in (2, 4):
            sizes = [engine.kernels.allocated(n * element_bytes, resolve_gpu(gpu))
                     for n in param_numels(cfg)]
            got = engine._param_sizes(cfg, element_bytes, resolve_gpu(gpu))
            assert (got.total, got.last, got.count) == (sum(sizes), sizes[-1], len(sizes))
            assert got.adamw_scratch == engine.adamw_scratch_bytes(sizes)


_FLOOR_CASES = [
    (GPTConfig(**{**SMALL, "n_layers": L}), b, K, precision, mode, every, gpu)
    for L, b, K, precision, (mode, every), gpu in itertools.product(
        (1, 4, 7), (1, 3), (1, 4), engine.PRECISIONS,
        (("none", 1), ("selective", 1), ("blocks", 2), ("blocks", 1), ("sqrt", 1), ("attention", 1)),
        (None, "T4", "H100 80GB"))]


def test_the_floor_is_the_backward_pass_first_moment_and_never_above_the_peak():
    """The floor against its definition, from the engine's own parts: the model states of the
    optimizer moment (which hold no activations), the accumulated gradient, the bytes
    checkpointing keeps (predict_kept_bytes) and the 4-byte loss; never above the peak."""
    for config, b, K, precision, mode, every, gpu in _FLOOR_CASES:
        floor = engine.floor(Step(config, b, K, precision=precision, mode=mode, every=every,
                                  gpu=gpu))
        at = moments(config, b, K, precision=precision, mode=mode, every=every, gpu=gpu)
        spec = engine.precision_of(precision)
        kept = checkpointed.predict_kept_bytes(config, b, mode, every, dtype=spec.compute,
                                                gpu=gpu, autocast=spec.autocast)
        loss = kernels.allocated(4, resolve_gpu(gpu))
        states = at["optimizer"].model_states
        grads = at["optimizer"].parameters if K > 1 else 0
        assert floor == states + grads + kept + loss, (config.n_layers, b, K, precision, mode, gpu)
        assert floor <= max(m.total for m in at.values())


# --------------------------------------------------------------------------- the fused kernel

FUSED_MODES = ["none", "blocks", "selective", "save-kernel", "recompute-kernel"]


@pytest.mark.parametrize("mode", FUSED_MODES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_model_is_predicted_to_the_byte(mode, precision):
    """GPTConfig(fused_mlp=True) through Triton's interpreter: kept bytes and the steady step's
    peak, predicted against measured, to the byte, under both kernel policies."""
    pytest.importorskip("triton")
    _predicted_to_the_byte(GPTConfig(**SMALL, fused_mlp=True), precision, mode)


def _predicted_to_the_byte(cfg: GPTConfig, precision: str, mode: str) -> None:
    """The steady step's peak and the kept bytes, predicted against measured."""
    step = Step(cfg, 3, precision=precision, mode=mode)
    predicted = predict(step).peak
    assert predicted.total == step_setup.measure_step_memory(step)
    model, _ = step_setup.build(cfg, precision=precision, mode=mode)
    kept = checkpointing.measure_kept_bytes(model, *random_tokens(cfg, 3))
    compute = engine.precision_of(precision).compute
    assert kept == checkpointed.predict_kept_bytes(cfg, 3, mode, dtype=compute)


def test_saving_the_kernel_costs_its_output_per_block_and_recomputing_it_nothing():
    cfg = GPTConfig(**SMALL, fused_mlp=True)
    kept = {mode: checkpointed.predict_kept_bytes(cfg, 3, mode) for mode in FUSED_MODES}
    assert kept["recompute-kernel"] == kept["selective"]
    out = 3 * cfg.seq_len * 4 * cfg.d_model * 4  # the kernel's (b, s, 4h) fp32 output
    assert kept["save-kernel"] - kept["selective"] == cfg.n_layers * out
    assert kept["blocks"] < kept["selective"] < kept["save-kernel"] < kept["none"]
    # the fused model keeps what the plain one keeps without checkpointing: the same tensors
    plain = GPTConfig(**SMALL)
    for mode in ("none", "blocks", "selective"):
        assert checkpointed.predict_kept_bytes(plain, 3, mode) == kept[mode]


@pytest.mark.parametrize("mode", ["none", "blocks", "selective"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_fused_residual_is_predicted_to_the_byte(dropout, precision, mode):
    """GPTConfig(fused_residual=True), bias-dropout-add through Triton's interpreter (or its
    PyTorch reference): kept bytes and the steady step's peak, predicted against measured."""
    _predicted_to_the_byte(GPTConfig(**SMALL, dropout=dropout, fused_residual=True), precision,
                           mode)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_fused_residual_keeps_no_dropout_mask(dropout):
    plain = GPTConfig(**SMALL, dropout=dropout)
    fused = dataclasses.replace(plain, fused_residual=True)
    masks = 2 * plain.n_layers * 3 * plain.seq_len * plain.d_model * 4 if dropout else 0
    assert (checkpointed.predict_kept_bytes(plain, 3, "none")
            - checkpointed.predict_kept_bytes(fused, 3, "none")) == masks


def test_the_kernel_modes_need_the_fused_model():
    for mode in ("save-kernel", "recompute-kernel"):
        with pytest.raises(ValueError, match="fused_mlp"):
            peak(GPTConfig(**SMALL), 1, mode=mode)
        assert mode not in engine.MODES  # the planners choose among every model's modes


EXPLICIT_DROPOUT = dict(vocab_size=64, seq_len=128, d_model=32, n_heads=4, n_layers=3,
                        attention="explicit", dropout=0.1)


@pytest.mark.parametrize("mode", checkpointing.MODES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_attention_with_dropout_is_exact_under_every_mode(attention, mode, precision):
    """The first step's peak, predicted against measured, to the byte: with a selective policy
    it falls in the forward pass (the cached scores beside the probabilities, dropout's mask and
    output, and the masked scores the core holds to its end); with whole blocks in the
    backward pass's rerun of a core (the QKV output, the masked scores and the core's output
    on top of what the rerun keeps). SDPA with dropout runs its math kernel on the CPU, whose
    rerun holds its fp32 copies. Predicted low by up to 6.5 % before these moments."""
    cfg = GPTConfig(**{**EXPLICIT_DROPOUT, "attention": attention})
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    model = checkpointing.enable_checkpointing(GPT(cfg).to(dtype), mode)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x, y = random_tokens(cfg, 4)
    measured = peak_memory(lambda: training_step(model, opt, x, y), device="cpu")
    pred = peak(cfg, 4, precision=precision, mode=mode, first_step=True)
    assert pred.step_peak == measured, (pred.moment, pred.step_peak, measured)
    if mode == "selective" and attention == "explicit":
        assert pred.moment.startswith("forward")
