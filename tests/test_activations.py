"""course_lib.prediction.activations: the op-by-op prediction of what the course GPT saves, to the byte
(plain and under autocast), the rules of other devices, and Korthikanti et al.'s formula."""

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from course_lib.device import pick_dtype
from course_lib.measurement.memory import saved_bytes, saved_tensors
from course_lib.model import kernels
from course_lib.model.gpt import GPT, Block, GPTConfig, random_tokens
from course_lib.prediction import activations as act


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
    assert act.total_bytes(act.block_saved(cfg, 3, 9, dtype)) == saved_bytes(out, block.parameters())


def test_the_sdpa_kernel_is_the_one_the_graph_shows():
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=1, attention="sdpa")
    for dropout, kernel, node in [(0.0, "flash", "ScaledDotProductFlashAttentionForCpuBackward0"),
                                  (0.1, "math", "SafeSoftmaxBackward0")]:
        c = dataclasses.replace(cfg, dropout=dropout)
        assert kernels.sdpa_kernel(c, torch.bfloat16, "cpu") == kernel
        model = GPT(c).to(torch.bfloat16)
        _, loss = model(*random_tokens(c, 2))
        assert node in {r.node for r in saved_tensors(loss)}


def test_fused_attention_drops_the_quadratic_term_only_without_cpu_dropout():
    base = GPTConfig(vocab_size=16, seq_len=256, d_model=64, n_heads=4, n_layers=1)

    def per_block(attention, dropout, s, gpu=None, dtype=torch.bfloat16):
        c = dataclasses.replace(base, attention=attention, dropout=dropout)
        return act.total_bytes(act.block_saved(c, 2, s, dtype, gpu))

    for attention, dropout, gpu, dtype, quadratic in [
            ("explicit", 0.1, None, torch.bfloat16, True),
            ("sdpa", 0.0, None, torch.bfloat16, False),
            ("sdpa", 0.1, None, torch.bfloat16, True),         # math fallback
            ("sdpa", 0.1, "A100 80GB", torch.bfloat16, False),  # flash, dropout included
            ("sdpa", 0.1, "T4", torch.float16, False),          # memory-efficient kernel
            ("sdpa", 0.0, "T4", torch.bfloat16, True)]:         # no bf16 kernel on sm75: math
        y = [per_block(attention, dropout, s, gpu, dtype) for s in (64, 128, 192)]
        second_difference = y[2] - 2 * y[1] + y[0]
        assert (second_difference > 0) == quadratic, (attention, dropout, gpu, dtype)
    # On the CPU with dropout, the math kernel in fp32 keeps more than explicit bf16 attention.
    assert per_block("sdpa", 0.1, 128) > per_block("explicit", 0.1, 128)


# --------------------------------------------------------------------------- Korthikanti et al.

def test_the_block_is_the_paper_plus_what_it_leaves_out():
    """Korthikanti et al.'s eq. 1 plus the terms lecture 02 names: the masks' dtype beyond the
    paper's 1 byte, LayerNorm's mean and 1/std, the causal mask and the 8-byte scalar."""
    cfg = GPTConfig(vocab_size=16, seq_len=128, d_model=64, n_heads=4, n_layers=1, dropout=0.1,
                    attention="explicit")
    s, b, h, a = 128, 2, 64, 4
    torch.manual_seed(0)
    block = Block(cfg).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes(block(x), block.parameters())  # what autograd keeps, on the CPU
    paper = s * b * h * 34 + 5 * a * s * s * b
    # the CPU: 2-byte bf16 masks (the paper counts 1), bf16 statistics
    cpu = paper + (2 * s * b * h + a * s * s * b) + 2 * 2 * s * b * 2 + s * s + 8
    assert act.total_bytes(act.block_saved(cfg, b, s, torch.bfloat16)) == cpu == measured
    for gpu in ("A100 80GB", "H100 80GB"):  # CUDA: 1-byte masks, fp32 statistics
        predicted = act.total_bytes(act.block_saved(cfg, b, s, torch.bfloat16, gpu))
        assert predicted == paper + 2 * 2 * s * b * 4 + s * s + 8


def test_on_cuda_the_course_block_is_the_paper_for_gpt3():
    """GPT-3 175B's layer (s=2048, h=12288, a=96, b=1): 2048*12288*(34 + 80) bytes in the paper."""
    cfg = GPTConfig(vocab_size=16, seq_len=2048, d_model=12288, n_heads=96, n_layers=1,
                    dropout=0.1, attention="explicit")
    paper = 2048 * 12288 * (34 + 5 * 96 * 2048 // 12288)
    ours = act.total_bytes(act.block_saved(cfg, 1, 2048, torch.bfloat16, "A100 80GB"))
    assert ours - paper == 16 * 2048 + 2048**2 + 8    # LayerNorm stats, causal mask, the scalar
    assert abs(ours / paper - 1) < 0.002


# --------------------------------------------------------------------------- autocast

@pytest.mark.parametrize("attention,dropout", [("explicit", 0.0), ("explicit", 0.1),
                                               ("sdpa", 0.0), ("sdpa", 0.1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,heads,bias", [(2, 4, True), (1, 2, False)])
def test_autocast_saved_bytes_equal_measured_to_the_byte(attention, dropout, dtype, batch, heads,
                                                         bias):
    """Under torch.autocast the fp32 model keeps fp32 LayerNorm inputs and 16-bit copies of
    every linear's input and weight: predicted to the byte against autograd's own graph."""
    cfg = GPTConfig(vocab_size=48, seq_len=16, d_model=32, n_heads=heads, n_layers=2,
                    dropout=dropout, attention=attention, bias=bias)
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = (t.clone() for t in random_tokens(cfg, batch))
    with torch.autocast("cpu", dtype=dtype):
        _, loss = model(x, y)
    measured = saved_bytes(loss, model.parameters())
    assert act.predict_saved_bytes(cfg, batch, 16, dtype, autocast=True) == measured
    # the weight copies: one 16-bit copy of every matmul weight, the tied LM head's included
    items = act._model_items(cfg, *act.prediction_args(cfg, batch, 16, dtype, None, True))
    copies = act.total_bytes(items, ("weight copy",))
    h, V = 32, 48
    assert copies == (12 * h * h * cfg.n_layers + V * h) * 2


def test_autocast_on_cuda_keeps_fp32_probabilities_in_explicit_attention():
    cfg = GPTConfig(vocab_size=16, seq_len=32, d_model=32, n_heads=4, n_layers=1, dropout=0.1,
                    attention="explicit")
    core = act.attention_core_saved(cfg, 2, 32, torch.float16, "T4", autocast=True)
    probs = [i for i in core if i.shape == (2, 4, 32, 32)]
    assert [(i.op, i.dtype) for i in probs] == [("softmax", torch.float32),
                                               ("attn dropout", torch.bool),
                                               ("probs @ v", torch.float16)]
    cpu = act.attention_core_saved(cfg, 2, 32, torch.float16, autocast=True)
    assert {i.dtype for i in cpu if i.shape == (2, 4, 32, 32)} == {torch.float16}


# --------------------------------------------------------------------------- properties

CONFIGS = st.builds(
    GPTConfig, vocab_size=st.integers(2, 5000), seq_len=st.just(512),
    d_model=st.sampled_from([8, 64, 96, 256]), n_heads=st.sampled_from([1, 2, 4, 8]),
    n_layers=st.integers(1, 12), dropout=st.sampled_from([0.0, 0.1]),
    attention=st.sampled_from(["explicit", "sdpa"]), bias=st.booleans())


@given(cfg=CONFIGS, batch=st.integers(1, 64), seq=st.integers(1, 256),
       dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
       gpu=st.sampled_from([None, "T4", "A100 80GB", "H100 80GB"]))
@settings(max_examples=100, deadline=None)
def test_saved_bytes_are_positive_and_monotone(cfg, batch, seq, dtype, gpu):
    def saved(config=cfg, b=batch, s=seq):
        return act.predict_saved_bytes(config, b, s, dtype, gpu)

    base = saved()
    assert base > 0
    assert saved(b=batch + 1) > base
    assert saved(s=seq + 1) > base
    assert saved(config=dataclasses.replace(cfg, n_layers=cfg.n_layers + 1)) > base


CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2)


@pytest.mark.parametrize("call,name", [
    (lambda: act.predict_saved_bytes("gpt2", 1, 8), "config"),
    (lambda: act.predict_saved_bytes(CFG, 0, 8), "batch_size"),
    (lambda: act.predict_saved_bytes(CFG, 2.0, 8), "batch_size"),
    (lambda: act.predict_saved_bytes(CFG, 1, 9), "seq_len"),
    (lambda: act.predict_saved_bytes(CFG, 1, 0), "seq_len"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, torch.int8), "dtype"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, "fp8"), "dtype"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, gpu="tpu"), "gpu"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, gpu="V100"), "gpu"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, torch.float32, autocast=True), "autocast"),
    (lambda: act.predict_saved_bytes(CFG, 1, 8, torch.bfloat16, autocast="yes"), "autocast"),
    (lambda: act.block_saved(CFG, True, 8), "batch_size"),
    (lambda: kernels.sdpa_kernel(CFG, torch.float32, "mps"), "gpu"),
])
def test_bad_inputs_raise_value_errors_naming_the_parameter(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_prediction_matches_a_cuda_measurement(attention, autocast):
    """CUDA keeps bool dropout masks, fp32 LayerNorm statistics and its fused kernels' outputs,
    in the dtype this GPU trains in (fp16 on a T4, bf16 from Ampere on)."""
    cfg = GPTConfig(vocab_size=128, seq_len=64, d_model=128, n_heads=4, n_layers=2, dropout=0.1,
                    attention=attention)
    dtype = pick_dtype("cuda")
    torch.manual_seed(0)
    model = GPT(cfg).to(device="cuda", dtype=torch.float32 if autocast else dtype)
    x, y = random_tokens(cfg, 4, device="cuda")
    with torch.autocast("cuda", dtype=dtype, enabled=autocast):
        _, loss = model(x, y)
    measured = saved_bytes(loss, model.parameters())
    predicted = act.predict_saved_bytes(cfg, 4, 64, dtype, "cuda", autocast=autocast)
    assert abs(measured - predicted) <= 0.005 * measured


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_mlp_saves_what_the_plain_one_does_to_the_byte(attention, dtype):
    """The course kernel keeps its input x @ W.T where GELU kept fc's output: the same bytes."""
    pytest.importorskip("triton")
    cfg = GPTConfig(vocab_size=40, seq_len=32, d_model=32, n_heads=4, n_layers=2,
                    attention=attention, fused_mlp=True)
    predicted = act.predict_saved_bytes(cfg, 3, dtype=dtype)
    assert _measured_saved(cfg, 3, None, dtype) == predicted
    assert predicted == act.predict_saved_bytes(dataclasses.replace(cfg, fused_mlp=False), 3,
                                                dtype=dtype)
    assert "bias_gelu" in [item.op for item in act.block_saved(cfg, 3, dtype=dtype)]


def test_a_forced_kernel_is_counted_as_that_kernel():
    """``kernel=`` counts what that SDPA kernel keeps, whatever the target would pick."""
    cfg = GPTConfig(vocab_size=16, seq_len=64, d_model=32, n_heads=4)
    math_items = act.attention_core_saved(cfg, 2, 64, torch.float32, kernel="math")
    assert any(item.shape == (2, 4, 64, 64) for item in math_items)
    efficient = act.attention_core_saved(cfg, 2, 50, torch.float16, "T4", kernel="efficient")
    lse = next(item for item in efficient if item.what == "logsumexp")
    assert lse.shape == (2, 4, 64)  # log-sum-exp rows padded to 32
    # and the RNG seed and offset, on the host (measured on an H200): not GPU memory
    assert [(i.what, i.kind) for i in efficient[-2:]] == [("RNG seed", "scalar"),
                                                          ("RNG offset", "scalar")]
    with pytest.raises(ValueError, match="kernel"):
        act.attention_core_saved(cfg, 2, 64, torch.float32, kernel="xformers")
