"""course_lib.activations: the op-by-op prediction of what the course GPT saves, to the byte,
the step-peak prediction against the tracker, and Korthikanti et al.'s formula."""

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib import activations as act
from course_lib.measure import peak_memory, saved_bytes, saved_tensors, training_step
from course_lib.memory import training_memory, transformer_activation_bytes
from course_lib.models import GPT, Block, GPTConfig, gpt_param_count, random_tokens


def _measured_saved(cfg, batch, seq, dtype):
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    # clone: random_tokens' inputs and targets share one storage when batch == 1
    x, y = (t.clone() for t in random_tokens(cfg, batch, seq))
    _, loss = model(x, y)
    return saved_bytes(loss, model.parameters())


GRID = [  # (attention, dropout, dtype, batch, heads, bias): the view cases b == 1 and a == 1 included
    (att, p, dtype, b, a, bias)
    for att, p, dtype in itertools.product(["explicit", "sdpa"], [0.0, 0.1],
                                           [torch.float32, torch.bfloat16, torch.float16])
    for b, a, bias in [(2, 3, True), (1, 2, False), (3, 1, True)]
]


@pytest.mark.parametrize("attention,dropout,dtype,batch,heads,bias", GRID)
def test_predicted_saved_bytes_equal_measured_to_the_byte(attention, dropout, dtype, batch, heads,
                                                          bias):
    cfg = GPTConfig(vocab_size=40, seq_len=10, d_model=12 * heads, n_heads=heads, n_layers=2,
                    dropout=dropout, attention=attention, bias=bias)
    for seq in (10, 7):
        assert act.predict_saved_bytes(cfg, batch, seq, dtype) == _measured_saved(cfg, batch, seq,
                                                                                  dtype)


@given(heads=st.integers(1, 4), d_head=st.integers(1, 9), layers=st.integers(1, 3),
       batch=st.integers(1, 3), seq=st.integers(1, 12), vocab=st.integers(2, 70),
       dropout=st.sampled_from([0.0, 0.2]), attention=st.sampled_from(["explicit", "sdpa"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans())
@settings(max_examples=40, deadline=None)
def test_predicted_saved_bytes_for_random_configs(heads, d_head, layers, batch, seq, vocab,
                                                  dropout, attention, dtype, bias):
    cfg = GPTConfig(vocab_size=vocab, seq_len=12, d_model=heads * d_head, n_heads=heads,
                    n_layers=layers, dropout=dropout, attention=attention, bias=bias)
    assert act.predict_saved_bytes(cfg, batch, seq, dtype) == _measured_saved(cfg, batch, seq, dtype)


@pytest.mark.parametrize("attention,dropout", [("explicit", 0.1), ("explicit", 0.0), ("sdpa", 0.0),
                                               ("sdpa", 0.1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_items_match_the_storages_autograd_keeps(attention, dropout, dtype):
    """Not only the sum: the multiset of storage sizes of one Block is the predicted one."""
    cfg = GPTConfig(vocab_size=16, seq_len=9, d_model=20, n_heads=4, n_layers=1,
                    dropout=dropout, attention=attention)
    torch.manual_seed(0)
    block = Block(cfg).to(dtype)
    x = torch.randn(3, 9, 20, dtype=dtype, requires_grad=True)
    out = block(x)
    rows = [r for r in saved_tensors(out, block.parameters()) if not r.is_parameter]
    measured = sorted({r.storage_id: r.nbytes for r in rows}.values())
    predicted = sorted(item.nbytes for item in act.block_saved(cfg, 3, 9, dtype))
    assert measured == predicted
    assert act.block_saved_bytes(cfg, 3, 9, dtype) == saved_bytes(out, block.parameters())


def test_the_sdpa_kernel_is_the_one_the_graph_shows():
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=1, attention="sdpa")
    for dropout, kernel, node in [(0.0, "flash", "ScaledDotProductFlashAttentionForCpuBackward0"),
                                  (0.1, "math", "SafeSoftmaxBackward0")]:
        c = dataclasses.replace(cfg, dropout=dropout)
        assert act.sdpa_kernel(c, torch.bfloat16, "cpu") == kernel
        model = GPT(c).to(torch.bfloat16)
        _, loss = model(*random_tokens(c, 2))
        assert node in {r.node for r in saved_tensors(loss)}
    assert act.sdpa_kernel(cfg, torch.bfloat16, "cuda") == "flash"
    assert act.sdpa_kernel(cfg, torch.float32, "cuda") == "efficient"


def test_fused_attention_drops_the_quadratic_term_only_without_cpu_dropout():
    base = GPTConfig(vocab_size=16, seq_len=256, d_model=64, n_heads=4, n_layers=1)

    def per_block(attention, dropout, s, device="cpu"):
        c = dataclasses.replace(base, attention=attention, dropout=dropout)
        return act.block_saved_bytes(c, 2, s, torch.bfloat16, device)

    for attention, dropout, device, quadratic in [("explicit", 0.1, "cpu", True),
                                                  ("sdpa", 0.0, "cpu", False),
                                                  ("sdpa", 0.1, "cpu", True),   # math fallback
                                                  ("sdpa", 0.1, "cuda", False)]:
        y = [per_block(attention, dropout, s, device) for s in (64, 128, 192)]
        second_difference = y[2] - 2 * y[1] + y[0]
        assert (second_difference > 0) == quadratic, (attention, dropout, device)
    # On the CPU with dropout, the math kernel in fp32 keeps more than explicit bf16 attention.
    assert per_block("sdpa", 0.1, 128) > per_block("explicit", 0.1, 128)


# --------------------------------------------------------------------------- Korthikanti et al.

def test_korthikanti_terms_add_up_to_the_block_exactly():
    cfg = GPTConfig(vocab_size=16, seq_len=128, d_model=64, n_heads=4, n_layers=1, dropout=0.1,
                    attention="explicit")
    for device in ("cpu", "cuda"):
        terms = act.korthikanti_terms(cfg, 2, 128, torch.bfloat16, device)
        block = terms.pop("block")
        assert terms["paper"] == transformer_activation_bytes(128, 2, 64, 4)
        assert sum(terms.values()) == block
    s, b, h, a = 128, 2, 64, 4
    cpu = act.korthikanti_terms(cfg, b, s, torch.bfloat16, "cpu")
    assert cpu["dropout masks"] == 2 * s * b * h + a * s * s * b   # 2-byte masks, not 1
    assert cpu["layernorm stats"] == 4 * s * b * 2
    cuda = act.korthikanti_terms(cfg, b, s, torch.bfloat16, "cuda")
    assert cuda["dropout masks"] == 0 and cuda["layernorm stats"] == 4 * s * b * 4


def test_on_cuda_the_course_block_is_the_paper_for_gpt3():
    """GPT-3 175B's layer (s=2048, h=12288, a=96, b=1): 2048*12288*(34 + 80) bytes in the paper."""
    cfg = GPTConfig(vocab_size=16, seq_len=2048, d_model=12288, n_heads=96, n_layers=1,
                    dropout=0.1, attention="explicit")
    paper = 2048 * 12288 * (34 + 5 * 96 * 2048 // 12288)
    ours = act.block_saved_bytes(cfg, 1, 2048, torch.bfloat16, "cuda")
    assert ours - paper == 16 * 2048 + 2048**2 + 8    # LayerNorm stats, causal mask, the scalar
    assert abs(ours / paper - 1) < 0.002


def test_korthikanti_terms_need_the_papers_setting():
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, dropout=0.1)
    with pytest.raises(ValueError, match="dropout"):
        act.korthikanti_terms(dataclasses.replace(cfg, dropout=0.0), 1, 8)
    with pytest.raises(ValueError, match="16-bit"):
        act.korthikanti_terms(cfg, 1, 8, torch.float32)


# --------------------------------------------------------------------------- the step peak

STEP_GRID = [
    GPTConfig(vocab_size=512, seq_len=16, d_model=32, n_heads=2, n_layers=2),                  # loss
    GPTConfig(vocab_size=32, seq_len=64, d_model=64, n_heads=2, n_layers=1, dropout=0.1),      # MLP
    GPTConfig(vocab_size=32, seq_len=128, d_model=32, n_heads=4, n_layers=1,
              attention="explicit"),                                                           # attention
    GPTConfig(vocab_size=512, seq_len=16, d_model=128, n_heads=4, n_layers=2),                 # AdamW
    GPTConfig(vocab_size=32, seq_len=128, d_model=32, n_heads=2, n_layers=1, dropout=0.1),     # math fwd
]


@pytest.mark.parametrize("cfg", STEP_GRID, ids=["loss", "mlp", "attention", "adamw", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predicted_step_peak_matches_the_tracker(cfg, dtype):
    batch = 2
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    opt = torch.optim.AdamW(model.parameters())
    x, y = (t.clone() for t in random_tokens(cfg, batch))
    measured = peak_memory(lambda: training_step(model, opt, x, y), device="cpu")
    pred = act.predict_step_peak(cfg, batch, cfg.seq_len, dtype)
    assert abs(pred.total - measured) <= 0.03 * measured, (pred, measured)
    assert pred.total == pred.gradients + pred.optimizer_state + pred.activations + pred.transient
    assert pred.parameters == sum(p.numel() * p.element_size() for p in model.parameters())
    assert min(pred.gradients, pred.optimizer_state, pred.activations, pred.transient) >= 0


def test_step_peak_moves_from_activations_to_optimizer_state():
    small_batch = act.predict_step_peak(STEP_GRID[3], 1, 16)
    big_batch = act.predict_step_peak(STEP_GRID[3], 64, 16)
    assert small_batch.moment == "AdamW step" and small_batch.activations == 0
    assert small_batch.optimizer_state == 2 * small_batch.parameters + 4 * 28
    assert big_batch.moment != "AdamW step" and big_batch.activations > big_batch.gradients


def test_adamw_scratch_is_what_a_second_step_allocates():
    """Independent measurement: with m and v allocated, AdamW's step only allocates its scratch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 50))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(4, 30)).sum().backward()
        if opt.state:
            measured = peak_memory(opt.step, device="cpu")
        else:
            opt.step()
    sizes = [p.numel() * 4 for p in model.parameters()]
    assert measured == act.adamw_scratch_bytes(sizes) == sizes[1] + 2 * sizes[2]


# --------------------------------------------------------------------------- budgets and properties

def test_memory_budget_parts():
    cfg = GPTConfig(vocab_size=1000, seq_len=256, d_model=256, n_heads=4, n_layers=4,
                    dropout=0.1, attention="sdpa")
    parts = act.memory_budget(cfg, 8, 256, precision="bf16-mixed")
    assert parts["model states"] == 16 * gpt_param_count(cfg)
    assert parts["model states"] == training_memory(gpt_param_count(cfg),
                                                    precision="bf16-mixed").total
    assert parts["logits gradients"] == 2 * 8 * 256 * 1000 * 4
    saved = act.model_saved(cfg, 8, 256, torch.bfloat16, "cuda")
    assert parts["activations"] == act.total_bytes(saved, ("activation", "input"))


CONFIGS = st.builds(
    GPTConfig, vocab_size=st.integers(2, 5000), seq_len=st.just(512),
    d_model=st.sampled_from([8, 64, 96, 256]), n_heads=st.sampled_from([1, 2, 4, 8]),
    n_layers=st.integers(1, 12), dropout=st.sampled_from([0.0, 0.1]),
    attention=st.sampled_from(["explicit", "sdpa"]), bias=st.booleans())


@given(cfg=CONFIGS, batch=st.integers(1, 64), seq=st.integers(1, 256),
       dtype=st.sampled_from(["fp32", "bf16", "fp16"]), device=st.sampled_from(["cpu", "cuda"]))
@settings(max_examples=100, deadline=None)
def test_memory_is_positive_and_monotone(cfg, batch, seq, dtype, device):
    def saved(config=cfg, b=batch, s=seq):
        return act.predict_saved_bytes(config, b, s, dtype, device)

    base = saved()
    assert base > 0
    assert saved(b=batch + 1) > base
    assert saved(s=seq + 1) > base
    assert saved(config=dataclasses.replace(cfg, n_layers=cfg.n_layers + 1)) > base
    budget = act.memory_budget(cfg, batch, seq, device=device)
    assert all(v > 0 for v in budget.values())
    bigger = act.memory_budget(cfg, batch + 1, seq, device=device)
    assert bigger["model states"] == budget["model states"]        # flat in batch
    assert bigger["activations"] > budget["activations"]


CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2)


@pytest.mark.parametrize("call,name", [
    (lambda: act.predict_saved_bytes("gpt2", 1, 8), "config"),
    (lambda: act.predict_saved_bytes(CFG, 0, 8), "batch_size"),
    (lambda: act.predict_saved_bytes(CFG, 2.0, 8), "batch_size"),
    (lambda: act.predict_saved_bytes(CFG, 1, 9), "seq_len"),
    (lambda: act.predict_saved_bytes(CFG, 1, 0), "seq_len"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, torch.int8), "dtype"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, "fp8"), "dtype"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, device="tpu"), "device"),
    (lambda: act.block_saved(CFG, True, 8), "batch_size"),
    (lambda: act.predict_step_peak(CFG, -1), "batch_size"),
    (lambda: act.memory_budget(CFG, 1, precision="int4"), "precision"),
    (lambda: act.memory_budget(CFG, 1, optimizer="lion"), "optimizer"),
    (lambda: act.sdpa_kernel(CFG, torch.float32, "mps"), "device"),
])
def test_bad_inputs_raise_value_errors_naming_the_parameter(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_cuda_prediction_matches_a_cuda_measurement(attention):
    """CUDA keeps bool dropout masks, fp32 LayerNorm statistics and flash attention's outputs."""
    cfg = GPTConfig(vocab_size=128, seq_len=64, d_model=128, n_heads=4, n_layers=2, dropout=0.1,
                    attention=attention)
    torch.manual_seed(0)
    model = GPT(cfg).to(device="cuda", dtype=torch.bfloat16)
    x, y = random_tokens(cfg, 4, device="cuda")
    _, loss = model(x, y)
    measured = saved_bytes(loss, model.parameters())
    predicted = act.predict_saved_bytes(cfg, 4, 64, torch.bfloat16, "cuda")
    assert abs(measured - predicted) <= 0.005 * measured
