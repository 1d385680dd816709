"""course_lib.prediction.formulas against published figures, independent derivations and real optimizer steps."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.model.zoo import PRESETS, build_model
from course_lib.prediction.formulas import (
    OPTIMIZERS,
    PRECISION,
    PRECISIONS,
    ZERO_STAGES,
    TrainingMemory,
    bytes_per_param,
    mixed_precision_for,
    model_state_bytes,
    precision_of,
    training_memory,
    transformer_activation_bytes,
    zero3_memory,
)
from course_lib.training.mixed_precision import MasterWeightAdamW
from course_lib.units import storage_bytes

GB = 10**9
SMALL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


# --- published figures ------------------------------------------------------------------

@pytest.mark.parametrize("optimizer,precision,extra,expected", [
    ("adam", "fp16-mixed", False, 16),   # ZeRO paper: 2 + 2 + K, K = 12
    ("adamw", "bf16-mixed", False, 16),
    ("adamw", "bf16-mixed", True, 18),   # Megatron-LM: bf16 grads added into fp32 main_grad
    ("adam", "fp16-mixed", True, 20),    # Megatron-LM: fp16 grads and fp32 main grads
    ("adamw", "autocast-bf16", False, 16),  # autocast: an fp32 model
    ("adamw", "autocast-fp16", True, 16),   # fp32 gradients are their own buffer
    ("adam", "fp32", False, 16),         # 4 + 4 + 8
    ("sgd", "fp32", False, 8),
    ("sgd-momentum", "fp32", False, 12),
    ("adamw", "bf16", False, 8),         # 2 + 2 + 2 + 2
    ("sgd", "fp32", True, 8),            # fp32 gradients are their own buffer
])
def test_bytes_per_param_published(optimizer, precision, extra, expected):
    assert bytes_per_param(optimizer, precision, fp32_grad_buffer=extra) == expected


def test_mixed_adam_breakdown_is_2_2_4_4_4():
    m = training_memory(1000, optimizer="adam", precision="bf16-mixed")
    assert (m.parameters, m.gradients, m.master_weights, m.optimizer_state) == (2000, 2000, 4000, 8000)
    assert m.total == 16_000


@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_75b_on_64_gpus(stage, gb):
    """ZeRO paper, Figure 1 / section 5: Psi = 7.5B, N_d = 64, K = 12."""
    m = training_memory(7_500_000_000, optimizer="adam", precision="fp16-mixed",
                        zero_stage=stage, world_size=64)
    assert round(m.total / GB, 1) == gb


@pytest.mark.parametrize("P", [7_500_000_000, 6_738_415_616, 1_048_576])
@pytest.mark.parametrize("N", [1, 2, 8, 64, 1024])
def test_zero_formulas(P, N):
    """Stage 1: 4P + KP/N, stage 2: 2P + (2+K)P/N, stage 3: (2+2+K)P/N, K = 12 (P divisible by N)."""
    P -= P % N
    K = 12
    expected = {0: 16 * P, 1: 4 * P + K * P // N, 2: 2 * P + (2 + K) * P // N,
                3: (2 + 2 + K) * P // N}
    for stage, value in expected.items():
        got = training_memory(P, optimizer="adamw", precision="bf16-mixed", zero_stage=stage,
                              world_size=N)
        assert got.total == value


def test_zero_pads_shards_to_whole_elements():
    # 10 parameters over 4 ranks: 3 elements each (2 of padding in all), as DeepSpeed and FSDP pad.
    m = training_memory(10, precision="bf16-mixed", zero_stage=3, world_size=4)
    assert m.as_dict() == {"parameters": 6, "gradients": 6, "optimizer_state": 24, "master_weights": 12,
                           "total": 48}


def test_zero3_between_and_during_a_step_written_out():
    """GPTConfig(vocab 100, seq 16, d_model 8, 3 layers, biases), 4 ranks, bf16-mixed AdamW.

    Root unit: token 100*8 + position 16*8 embeddings + final norm 8+8 = 944 (head tied).
    A block: norm 16 + qkv 8*24+24 + proj 8*8+8 + norm 16 + fc 8*32+32 + proj 32*8+8 = 872.
    P = 944 + 3*872 = 3560, 890 per rank: between steps 2+2+4+8 bytes each; during a step
    the root and two blocks gathered; the root's gradients, and a block's with their copy in
    the reduce-scatter buffer (2 * 872 > 944).
    """
    cfg = GPTConfig(vocab_size=100, seq_len=16, d_model=8, n_heads=2, n_layers=3)
    between = zero3_memory(cfg, precision="bf16-mixed", world_size=4, during_step=False)
    assert between.as_dict() == {"parameters": 1780, "gradients": 1780, "master_weights": 3560,
                                 "optimizer_state": 7120, "total": 14240}
    during = zero3_memory(cfg, precision="bf16-mixed", world_size=4)
    assert during.parameters == 1780 + 2 * (944 + 2 * 872)
    assert during.gradients == 1780 + 2 * (944 + 2 * 872)
    assert (during.master_weights, during.optimizer_state) == (3560, 7120)
    assert during.total == 24992 > between.total
    # fp32: 4-byte weights and gradients, no master copy
    fp32 = zero3_memory(cfg, world_size=4)
    assert fp32.total == 16 * 890 + 4 * (944 + 2 * 872) * 2
    # a root larger than two blocks: its own reduce-scatter holds two copies of its gradients
    wide = GPTConfig(vocab_size=1000, seq_len=16, d_model=8, n_heads=2, n_layers=3)
    root = 1000 * 8 + 16 * 8 + 16
    assert zero3_memory(wide, world_size=4).gradients == 4 * (-(-(root + 3 * 872) // 4)) + 4 * 2 * root
    with pytest.raises(TypeError, match="during_step"):
        zero3_memory(cfg, world_size=4, during_step=1)
    with pytest.raises(TypeError, match="config"):
        zero3_memory("gpt2", world_size=4)
    with pytest.raises(ValueError, match="world_size"):
        zero3_memory(cfg, world_size=0)


def test_seven_b_claim_forgets_master_weights():
    m = training_memory(7e9, optimizer="adamw", precision="bf16-mixed")
    claimed = 14 * GB + 14 * GB + 56 * GB
    assert (m.parameters, m.gradients, m.optimizer_state) == (14 * GB, 14 * GB, 56 * GB)
    assert m.total - claimed == m.master_weights == 28 * GB
    assert m.total == 112 * GB


# --- measured against analytic ---------------------------------------------------------

def _step(model, optimizer):
    x, y = random_tokens(model.config, 2)
    model(x, y)[1].backward()
    optimizer.step()


@pytest.mark.parametrize("name,make", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd-momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("adam", lambda p: torch.optim.Adam(p)),
    ("adamw", lambda p: torch.optim.AdamW(p)),
])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_measured_step_equals_analytic(name, make, dtype, precision, count_parameters):
    model = GPT(SMALL).to(dtype)
    optimizer = make(model.parameters())
    _step(model, optimizer)
    P = count_parameters(model)
    assert model_state_bytes(model, optimizer, include_step=False) == training_memory(
        P, optimizer=name, precision=precision)
    # Adam's step counters: one 4-byte fp32 scalar per parameter tensor.
    extra = model_state_bytes(model, optimizer).total - training_memory(
        P, optimizer=name, precision=precision).total
    assert extra == (4 * len(list(model.parameters())) if name.startswith("adam") else 0)


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, "bf16-mixed"),
                                             (torch.float16, "fp16-mixed")])
def test_master_weight_recipe_measured(dtype, precision, count_parameters):
    model16 = GPT(SMALL).to(dtype)
    optimizer = MasterWeightAdamW(model16.parameters())
    P = count_parameters(model16)
    _step(model16, optimizer)  # AdamW's m and v now exist; the step freed every gradient
    assert model_state_bytes(model16, optimizer, include_step=False).total == (
        2 * P + 4 * P + 8 * P)  # 16-bit weights, fp32 master, m and v
    x, y = random_tokens(SMALL, 2)
    model16(x, y)[1].backward()  # the next step's 16-bit gradients: the model states of training
    measured = model_state_bytes(model16, optimizer, include_step=False)
    assert measured == training_memory(P, precision=precision)
    # Megatron-LM's fp16 path keeps its fp16 gradients beside fp32 copies: 20 bytes per parameter.
    fp32_copies = [p.grad.float() for p in model16.parameters()]
    assert measured.total + storage_bytes(fp32_copies) == training_memory(
        P, precision="fp16-mixed", fp32_grad_buffer=True).total
    # The optimizer step's own gradients: fp32 on the master weights, the 16-bit ones freed, as
    # Megatron-LM's bf16 main_grad buffer keeps them (18 bytes per parameter).
    optimizer.prepare_grads()
    assert model_state_bytes(model16, optimizer, include_step=False) == training_memory(
        P, precision="bf16-mixed", fp32_grad_buffer=True)


def test_autocast_keeps_fp32_model_states(count_parameters):
    model = GPT(SMALL)
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = random_tokens(SMALL, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)[1]
    loss.backward()
    optimizer.step()
    assert model_state_bytes(model, optimizer, include_step=False) == training_memory(
        count_parameters(model), precision="fp32")


def test_meta_device_step_measures_a_billion_parameter_model():
    preset = PRESETS["Llama 3.2 1B"]
    model = build_model(preset.config, dtype=torch.bfloat16)
    optimizer = MasterWeightAdamW(model.parameters())

    def backward():  # what backward leaves: a 16-bit gradient per weight (shapes only, on meta)
        for p in model.parameters():
            p.grad = torch.empty_like(p)

    backward()
    optimizer.step()  # AdamW makes m and v
    backward()  # the next step's gradients
    measured = model_state_bytes(model, optimizer, include_step=False)
    assert measured == training_memory(preset.published_params, precision="bf16-mixed")
    assert measured.total == 16 * 1_235_814_400


def test_each_device_has_its_mixed_precision():
    assert mixed_precision_for("T4") == "fp16-mixed"  # no bf16 tensor cores: fp16 and a GradScaler
    assert mixed_precision_for("A100 80GB") == mixed_precision_for(None) == "bf16-mixed"
    with pytest.raises(ValueError, match="gpu must be"):
        mixed_precision_for("TPU v5")


def test_precision_table_gives_the_bytes_of_each_model_state():
    assert PRECISIONS == tuple(PRECISION)
    assert {name: p.element_bytes for name, p in PRECISION.items()} == {
        "fp32": (4, 4, 0, 4), "fp16-mixed": (2, 2, 4, 4), "bf16-mixed": (2, 2, 4, 4),
        "bf16": (2, 2, 0, 2), "autocast-fp16": (4, 4, 0, 4), "autocast-bf16": (4, 4, 0, 4)}
    with pytest.raises(ValueError, match="precisions must be one of"):
        precision_of("fp16", name="precisions")


def test_tied_weights_and_views_count_once(count_parameters):
    model = GPT(SMALL)  # lm_head is tied to the token embedding
    assert model_state_bytes(model).parameters == 4 * count_parameters(model)
    base = torch.zeros(100)
    layer = torch.nn.Linear(1, 1)
    layer.weight = torch.nn.Parameter(base[:10].view(10, 1))  # a view of a bigger storage
    assert model_state_bytes(layer).parameters == 400 + 4  # the whole storage, plus the bias


@pytest.mark.gpu
def test_cuda_allocator_holds_at_least_the_analytic_bytes(count_parameters):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = GPT(SMALL).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = random_tokens(SMALL, 2, device="cuda")
    model(x, y)[1].backward()
    optimizer.step()
    del x, y
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    analytic = training_memory(count_parameters(model), precision="fp32").total
    assert model_state_bytes(model, optimizer, include_step=False).total == analytic
    assert held >= analytic


# --- properties ------------------------------------------------------------------------

recipes = st.fixed_dictionaries({
    "optimizer": st.sampled_from(OPTIMIZERS),
    "precision": st.sampled_from(PRECISIONS),
    "zero_stage": st.sampled_from(ZERO_STAGES),
    "world_size": st.integers(1, 4096),
    "fp32_grad_buffer": st.booleans(),
})


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 10**13), recipe=recipes)
def test_never_negative_and_non_decreasing_in_size(n, recipe):
    a, b = training_memory(n, **recipe), training_memory(n + 1, **recipe)
    for part in ("parameters", "gradients", "optimizer_state", "master_weights", "total"):
        assert 0 <= getattr(a, part) <= getattr(b, part)
    assert isinstance(a.total, int)
    # bytes per parameter (the published table above) times the parameters a rank holds: all of
    # them unsharded, a padded 1/N share of each state under stage 3, in between for stages 1-2
    per = bytes_per_param(recipe["optimizer"], recipe["precision"],
                          fp32_grad_buffer=recipe["fp32_grad_buffer"])
    N = recipe["world_size"]
    if recipe["zero_stage"] == 0 or N == 1:
        assert a.total == n * per
    elif recipe["zero_stage"] == 3:
        assert a.total == -(-n // N) * per
    else:
        assert -(-n // N) * per <= a.total <= n * per


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 10**13), recipe=recipes)
def test_sharding_never_adds_memory(n, recipe):
    m = training_memory(n, **recipe)
    unsharded = training_memory(n, **{**recipe, "zero_stage": 0})
    more_ranks = training_memory(n, **{**recipe, "world_size": recipe["world_size"] + 1})
    assert m.total <= unsharded.total
    assert more_ranks.total <= m.total
    if recipe["zero_stage"] < 3:
        higher = training_memory(n, **{**recipe, "zero_stage": recipe["zero_stage"] + 1})
        assert higher.total <= m.total
    else:  # everything sharded: N shards hold at least the whole (padding adds, never loses)
        assert m.total * recipe["world_size"] >= unsharded.total


# --- bad inputs ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"n_params": 0}, "n_params must be a positive int"),
    ({"n_params": -5}, "n_params must be a positive int"),
    ({"n_params": 1.5}, "n_params must be a positive int"),
    ({"n_params": "7B"}, "n_params must be a positive int"),
    ({"n_params": True}, "n_params must be a positive int"),
    ({"n_params": float("nan")}, "n_params must be a positive int"),
    ({"optimizer": "lion"}, r"optimizer must be one of \('sgd', 'sgd-momentum', 'adam', 'adamw'\)"),
    ({"optimizer": "Adam"}, "optimizer must be one of"),
    ({"precision": "fp16"}, r"precision must be one of \('fp32', 'fp16-mixed', 'bf16-mixed', "
                             r"'bf16', 'autocast-fp16', 'autocast-bf16'\)"),
    ({"precision": torch.bfloat16}, "precision must be one of"),
    ({"zero_stage": 4}, r"zero_stage must be one of \(0, 1, 2, 3\)"),
    ({"zero_stage": "1"}, "zero_stage must be one of"),
    ({"zero_stage": 1.0}, "zero_stage must be one of"),
    ({"zero_stage": True}, "zero_stage must be one of"),
    ({"world_size": 0}, "world_size must be a positive int"),
    ({"world_size": 2.5}, "world_size must be a positive int"),
    ({"fp32_grad_buffer": "yes"}, "fp32_grad_buffer must be True or False"),
])
def test_bad_inputs_name_the_parameter(kwargs, match):
    args = {"n_params": 1000, **kwargs}
    with pytest.raises(ValueError, match=match):
        training_memory(args.pop("n_params"), **args)


def test_whole_floats_and_numpy_ints_are_accepted():
    np = pytest.importorskip("numpy")
    assert training_memory(7e9) == training_memory(7_000_000_000)
    assert training_memory(np.int64(1000), world_size=np.int64(4), zero_stage=3) == \
        training_memory(1000, world_size=4, zero_stage=3)


def test_model_state_bytes_rejects_bad_inputs():
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        model_state_bytes(torch.zeros(3))
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        model_state_bytes(GPT(SMALL), optimizer="adamw")
    with pytest.raises(ValueError, match="master_params must be an iterable of tensors"):
        model_state_bytes(GPT(SMALL), master_params=[1, 2])


def test_training_memory_is_a_frozen_record():
    m = training_memory(10)
    assert isinstance(m, TrainingMemory)
    with pytest.raises(AttributeError):
        m.total = 0


# --- activations (Korthikanti et al. 2022), kept for lecture 02 -------------------------

def _paper_layer_bytes(s, b, h, a, recompute="none"):
    """Korthikanti et al. 2022, section 4.1, term by term: 16-bit activations, 1-byte dropout
    masks, no parallelism; selective recompute drops the attention core's s x s tensors, full
    recompute keeps each layer's input only (section 5)."""
    if recompute == "full":
        return {"layer input": 2 * s * b * h}
    terms = {
        "QKV input": 2 * s * b * h, "Q and K": 4 * s * b * h, "V": 2 * s * b * h,
        "out-projection input": 2 * s * b * h, "output dropout mask": s * b * h,
        "MLP fc input": 2 * s * b * h, "GeLU input": 8 * s * b * h,
        "MLP proj input": 8 * s * b * h, "MLP dropout mask": s * b * h,
        "two LayerNorm inputs": 4 * s * b * h,
    }
    if recompute == "none":
        terms |= {"softmax output": 2 * a * s * s * b, "softmax dropout mask": a * s * s * b,
                  "softmax dropout output": 2 * a * s * s * b}
    return terms


@pytest.mark.parametrize("s,b,h,a,L", [(2048, 1, 12288, 96, 96),   # GPT-3 175B
                                       (2048, 1, 20480, 128, 105),  # MT-NLG 530B
                                       (1024, 8, 768, 12, 12),      # GPT-2 small
                                       (7, 3, 10, 5, 2)])           # 5as/h not a whole number
def test_transformer_activation_bytes_are_the_papers_terms_summed(s, b, h, a, L):
    for recompute in ("none", "selective", "full"):
        assert transformer_activation_bytes(s, b, h, a, L, recompute=recompute) == L * sum(
            _paper_layer_bytes(s, b, h, a, recompute).values()), recompute
    with pytest.raises(ValueError, match="recompute must be one of"):
        transformer_activation_bytes(s, b, h, a, recompute="some")


@pytest.mark.parametrize("s,h,a,percent", [(2048, 12288, 96, 70), (2048, 20480, 128, 65)])
def test_selective_recompute_saves_the_papers_share(s, h, a, percent):
    """The paper, section 4.2: selective recompute cuts the activations of GPT-3 by 70 %, of
    MT-NLG by 65 %."""
    none = transformer_activation_bytes(s, 1, h, a)
    selective = transformer_activation_bytes(s, 1, h, a, recompute="selective")
    assert round(100 * (1 - selective / none)) == percent
