"""A micro-batch's share of the batch's loss (``micro_batch_loss``, with which the training loop
weights every micro-batch) against an independent derivation: the full batch's gradient, by hand."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.training import accumulation as acc

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)


def _gpt(dtype=torch.float64):
    torch.manual_seed(0)
    return GPT(CFG).to(dtype)


def _padded(batch=8, seed=0, lengths=None):
    """Row i keeps its first lengths[i] tokens; then input 0 and target -100, as a collator pads."""
    x, y = random_tokens(CFG, batch, seed=seed)
    if lengths is None:
        lengths = torch.randint(0, CFG.seq_len + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    past = torch.arange(CFG.seq_len) >= torch.as_tensor(lengths)[:, None]
    return x.masked_fill(past, 0), y.masked_fill(past, -100)


def _flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _grads_by_hand(model, micro_batches, weights):
    """sum_k weight_k * grad(mean loss of micro-batch k), through .grad and backward().

    The loss is F.cross_entropy's mean of the logits in the model's own dtype (the GPT's
    own loss is computed in fp32, which would cap an fp64 comparison at ~1e-9).
    """
    model = copy.deepcopy(model)
    for (x, y), w in zip(micro_batches, weights):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        (loss * w).backward()
    return _flat_grad(model)


def _accumulated(model, x, y, b, normalize="tokens"):
    """The gradient of micro-batches of ``b``, each weighted by ``micro_batch_loss``."""
    model = copy.deepcopy(model)
    for xs, ys in zip(x.split(b), y.split(b)):
        acc.micro_batch_loss(model, xs, ys, normalize=normalize, total_tokens=(y != -100).sum(),
                             accumulation_steps=x.size(0) // b).backward()
    return _flat_grad(model)


def _gap(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def test_tokens_equals_full_batch_gradient_in_fp64_with_padding():
    model = _gpt()
    x, y = _padded(lengths=[8, 1, 3, 8, 0, 2, 8, 5])
    ref = _grads_by_hand(model, [(x, y)], [1.0])
    for b in (1, 2, 4, 8):
        assert (_accumulated(model, x, y, b) - ref).abs().max() < 1e-13, b


def test_fp32_is_allclose_to_the_full_batch():
    model = _gpt(torch.float32)
    x, y = random_tokens(CFG, 16, seed=3)
    assert _gap(_accumulated(model, x, y, 2), _grads_by_hand(model, [(x, y)], [1.0])) < 1e-5


def test_mean_of_means_is_the_average_of_micro_batch_means():
    model = _gpt()
    x, y = _padded(lengths=[8, 8, 1, 1, 4, 6, 2, 7])
    micro = list(zip(x.split(2), y.split(2)))
    got = _accumulated(model, x, y, 2, normalize="mean-of-means")
    assert (got - _grads_by_hand(model, micro, [1 / 4] * 4)).abs().max() < 1e-13
    full = _grads_by_hand(model, [(x, y)], [1.0])
    assert _gap(got, full) > 0.05  # the bug is visible with padding


def test_mean_of_means_is_right_without_padding():
    model = _gpt()
    x, y = random_tokens(CFG, 8, seed=1)
    full = _grads_by_hand(model, [(x, y)], [1.0])
    assert (_accumulated(model, x, y, 2, normalize="mean-of-means") - full).abs().max() < 1e-13


@pytest.mark.parametrize("b", [1, 2, 4])
def test_sum_of_means_is_k_times_too_large(b):
    model = _gpt()
    x, y = random_tokens(CFG, 8, seed=2)
    full = _grads_by_hand(model, [(x, y)], [1.0])
    got = _accumulated(model, x, y, b, normalize="sum-of-means")
    assert (got / (8 // b) - full).abs().max() < 1e-13


def test_the_reference_by_hand_is_the_models_own_loss():
    model = _gpt(torch.float32)
    x, y = _padded(lengths=[8, 1, 3, 8, 0, 2, 8, 5])
    ref = _grads_by_hand(model, [(x, y)], [1.0])
    model(x, y)[1].backward()
    assert (_flat_grad(model) - ref).abs().max() < 1e-7


def test_classifier_with_layernorm_is_equivalent_and_batchnorm_is_not():
    torch.manual_seed(0)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 3, (16,))
    for norm, equivalent in ((nn.LayerNorm(8), True), (nn.GroupNorm(2, 8), True),
                             (nn.BatchNorm1d(8), False)):
        model = nn.Sequential(nn.Linear(6, 8), norm, nn.ReLU(), nn.Linear(8, 3)).double()
        full = _grads_by_hand(model, [(x, y)], [1.0])
        assert (_gap(_accumulated(model, x, y, 4), full) < 1e-12) == equivalent, type(norm).__name__


def test_all_padding_micro_batch_adds_nothing_but_breaks_mean_of_means():
    model = _gpt()
    x, y = _padded(batch=4, lengths=[0, 0, 5, 8])
    full = _grads_by_hand(model, [(x, y)], [1.0])
    assert (_accumulated(model, x, y, 2) - full).abs().max() < 1e-13
    with pytest.raises(ValueError, match="no target tokens"):
        _accumulated(model, x, y, 2, normalize="mean-of-means")


def test_micro_batch_loss_weights():
    model = _gpt()
    x, y = _padded(batch=2, lengths=[3, 5])
    logits = model(x)
    summed = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), y.reshape(-1), reduction="sum")
    tokens = acc.micro_batch_loss(model, x, y, total_tokens=16)
    assert torch.allclose(tokens, summed / 16)
    mom = acc.micro_batch_loss(model, x, y, normalize="mean-of-means", accumulation_steps=4)
    assert torch.allclose(mom, summed / 8 / 4)


def test_micro_batch_loss_upcasts_half_logits_only():
    class Constant(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3, dtype=dtype))

        def forward(self, x):
            return x.to(self.w.dtype) + self.w

    y = torch.tensor([0, 2])
    for dtype, expected in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        loss = acc.micro_batch_loss(Constant(dtype), torch.zeros(2, 3), y, total_tokens=2)
        assert loss.dtype == expected


@given(lengths=st.lists(st.integers(0, CFG.seq_len), min_size=8, max_size=8),
       b=st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=15, deadline=None)
def test_property_tokens_normalisation_equals_full_batch(lengths, b):
    if sum(lengths) == 0:
        lengths[0] = 1
    model = _gpt()
    x, y = _padded(lengths=lengths)
    full = _grads_by_hand(model, [(x, y)], [1.0])
    assert (_accumulated(model, x, y, b) - full).abs().max() < 1e-12
