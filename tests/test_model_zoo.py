"""course_lib.model.zoo: published parameter counts, meta-device builds, a runnable Llama."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from course_lib.model.gpt import GPT, GPTConfig, gpt_param_count, random_tokens
from course_lib.model.zoo import (
    PRESETS,
    _Llama as Llama,
    _LlamaConfig as LlamaConfig,
    build_model,
)


def llama_param_count(config) -> int:
    """Closed form: ``V*h*(1 or 2) + L*(2h^2 + 2h*kv + 3h*f + 2h) + h``, ``kv = n_kv_heads * d_head``."""
    h, kv, f = config.d_model, config.n_kv_heads * config.d_head, config.d_ff
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return config.vocab_size * h * (1 if config.tie_embeddings else 2) + config.n_layers * per_layer + h


def param_count(config) -> int:
    return gpt_param_count(config) if isinstance(config, GPTConfig) else llama_param_count(config)


# Exact counts of the published checkpoints (transformers' num_parameters()).
PUBLISHED = {
    "GPT-2 124M": 124_439_808,
    "GPT-2 1.5B": 1_557_611_200,
    "Llama 3.2 1B": 1_235_814_400,
    "Llama 2 7B": 6_738_415_616,
    "Llama 3.1 8B": 8_030_261_248,
    "Llama 2 70B": 68_976_648_192,
    "Llama 3.1 70B": 70_553_706_496,
    "Llama 3.1 405B": 405_853_388_800,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_match_published_counts_on_meta(name, count_parameters):
    preset = PRESETS[name]
    model = build_model(preset.config)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert count_parameters(model) == param_count(preset.config) == PUBLISHED[name]
    assert preset.published_params == PUBLISHED[name]


def test_llama_2_7b_by_hand():
    """Llama 2 7B: V=32000, h=4096, L=32, MHA, f=11008, untied head (Touvron et al. 2023)."""
    h, f, V, L = 4096, 11008, 32000, 32
    per_layer = 4 * h * h + 3 * h * f + 2 * h
    assert llama_param_count(PRESETS["Llama 2 7B"].config) == 2 * V * h + L * per_layer + h


def test_build_model_dtype_and_device():
    config = LlamaConfig()
    model = build_model(config, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    cpu = build_model(GPTConfig(), device="cpu")
    assert isinstance(cpu, GPT) and next(cpu.parameters()).device.type == "cpu"
    with pytest.raises(ValueError, match="config must be a GPTConfig or a LlamaConfig"):
        build_model({"d_model": 64})
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
        build_model(config, dtype=torch.int8)


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([(4, 1), (4, 2), (4, 4), (8, 2)]), head_dim=st.sampled_from([2, 8]),
       n_layers=st.integers(1, 3), d_ff=st.integers(1, 50), vocab=st.integers(1, 40),
       tie=st.booleans())
def test_closed_form_equals_module_count(heads, head_dim, n_layers, d_ff, vocab, tie,
                                         count_parameters):
    n_heads, n_kv = heads
    config = LlamaConfig(vocab_size=vocab, d_model=n_heads * head_dim, n_layers=n_layers,
                         n_heads=n_heads, n_kv_heads=n_kv, d_ff=d_ff, tie_embeddings=tie)
    assert count_parameters(build_model(config)) == llama_param_count(config)


def test_small_llama_trains_on_cpu():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                         seq_len=16)
    model = Llama(config)
    x, y = random_tokens(GPTConfig(vocab_size=32, seq_len=16), 3)
    logits, loss = model(x, y)
    assert logits.shape == (3, 16, 32)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model(x).shape == (3, 16, 32)
    # causal: the first position's logits do not depend on later tokens
    x2 = x.clone()
    x2[:, 1:] = (x2[:, 1:] + 1) % 32
    assert torch.allclose(model(x)[:, 0], model(x2)[:, 0], atol=1e-5)
    with pytest.raises(ValueError, match="exceeds config.seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_tied_llama_counts_the_embedding_once():
    tied = LlamaConfig(tie_embeddings=True)
    untied = LlamaConfig(tie_embeddings=False)
    assert llama_param_count(untied) - llama_param_count(tied) == tied.vocab_size * tied.d_model
    model = Llama(tied)
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize("field,value,match", [
    ("d_model", 0, "d_model must be a positive int"),
    ("n_layers", 2.0, "n_layers must be a positive int"),
    ("n_heads", 3, "d_model must be n_heads times an even head size"),
    ("n_kv_heads", 3, "n_kv_heads must divide n_heads"),
    ("tie_embeddings", "yes", "tie_embeddings must be True or False"),
])
def test_llama_config_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{field: value})
