"""Gradient accumulation against independent derivations: the full batch's gradient, by hand."""

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
    x, y = random_tokens(CFG, batch, seed=seed)
    if lengths is None:
        lengths = torch.randint(0, CFG.seq_len + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    return acc.pad_to_lengths(x, y, lengths)


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
    return {n: p.grad for n, p in model.named_parameters()}


def test_tokens_equals_full_batch_gradient_in_fp64_with_padding():
    model = _gpt()
    x, y = _padded(lengths=[8, 1, 3, 8, 0, 2, 8, 5])
    ref = _grads_by_hand(model, [(x, y)], [1.0])
    for b in (1, 2, 4, 8):
        got = acc.accumulated_gradients(model, x, y, b)
        assert acc._max_abs_difference(got, ref) < 1e-13, b


def test_fp32_is_allclose_to_the_full_batch():
    model = _gpt(torch.float32)
    x, y = random_tokens(CFG, 16, seed=3)
    ref = acc.full_batch_gradients(model, x, y)
    got = acc.accumulated_gradients(model, x, y, 2)
    assert acc.relative_difference(got, ref) < 1e-5


def test_mean_of_means_is_the_average_of_micro_batch_means():
    model = _gpt()
    x, y = _padded(lengths=[8, 8, 1, 1, 4, 6, 2, 7])
    micro = list(zip(x.split(2), y.split(2)))
    ref = _grads_by_hand(model, micro, [1 / 4] * 4)
    got = acc.accumulated_gradients(model, x, y, 2, normalize="mean-of-means")
    assert acc._max_abs_difference(got, ref) < 1e-13
    full = acc.full_batch_gradients(model, x, y)
    assert acc.relative_difference(got, full) > 0.05  # the bug is visible with padding


def test_mean_of_means_is_right_without_padding():
    model = _gpt()
    x, y = random_tokens(CFG, 8, seed=1)
    full = acc.full_batch_gradients(model, x, y)
    got = acc.accumulated_gradients(model, x, y, 2, normalize="mean-of-means")
    assert acc._max_abs_difference(got, full) < 1e-13


@pytest.mark.parametrize("b", [1, 2, 4])
def test_sum_of_means_is_k_times_too_large(b):
    model = _gpt()
    x, y = random_tokens(CFG, 8, seed=2)
    full = acc.full_batch_gradients(model, x, y)
    got = acc.accumulated_gradients(model, x, y, b, normalize="sum-of-means")
    K = 8 // b
    assert acc._max_abs_difference({n: g / K for n, g in got.items()}, full) < 1e-13


def test_full_batch_reference_matches_the_models_own_loss():
    model = _gpt(torch.float32)
    x, y = _padded(lengths=[8, 1, 3, 8, 0, 2, 8, 5])
    _, loss = model(x, y)
    loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert acc._max_abs_difference(acc.full_batch_gradients(model, x, y), ref) < 1e-7


def test_model_grad_is_left_untouched():
    model = _gpt()
    x, y = random_tokens(CFG, 4)
    params = list(model.parameters())
    params[0].grad = torch.full_like(params[0], 7.0)
    acc.accumulated_gradients(model, x, y, 2)
    assert torch.equal(params[0].grad, torch.full_like(params[0], 7.0))
    assert all(p.grad is None for p in params[1:])


def test_tied_weight_appears_once_and_frozen_parameters_are_left_out():
    model = _gpt()
    model.pos_emb.weight.requires_grad_(False)
    x, y = random_tokens(CFG, 4)
    grads = acc.accumulated_gradients(model, x, y, 2)
    assert "tok_emb.weight" in grads and "lm_head.weight" not in grads
    assert "pos_emb.weight" not in grads
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_classifier_with_layernorm_is_equivalent_and_batchnorm_is_not():
    torch.manual_seed(0)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 3, (16,))
    for norm, equivalent in ((nn.LayerNorm(8), True), (nn.GroupNorm(2, 8), True),
                             (nn.BatchNorm1d(8), False)):
        model = nn.Sequential(nn.Linear(6, 8), norm, nn.ReLU(), nn.Linear(8, 3)).double()
        full = acc.full_batch_gradients(model, x, y)
        got = acc.accumulated_gradients(model, x, y, 4)
        assert (acc.relative_difference(got, full) < 1e-12) == equivalent, type(norm).__name__


def test_all_padding_micro_batch_adds_nothing_but_breaks_mean_of_means():
    model = _gpt()
    x, y = _padded(batch=4, lengths=[0, 0, 5, 8])
    full = acc.full_batch_gradients(model, x, y)
    assert acc._max_abs_difference(acc.accumulated_gradients(model, x, y, 2), full) < 1e-13
    with pytest.raises(ValueError, match="no target tokens"):
        acc.accumulated_gradients(model, x, y, 2, normalize="mean-of-means")


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
    full = acc.full_batch_gradients(model, x, y)
    assert acc._max_abs_difference(acc.accumulated_gradients(model, x, y, b), full) < 1e-12


def test_token_counts_and_padding():
    x, y = random_tokens(CFG, 4)
    xp, yp = acc.pad_to_lengths(x, y, [8, 0, 3, 5], pad_token=1)
    assert acc.token_counts(yp, 2) == [8, 8]
    assert acc.token_counts(yp, 1) == [8, 0, 3, 5]
    assert torch.equal(xp[2, :3], x[2, :3]) and bool((xp[2, 3:] == 1).all())
    assert bool((yp[1] == -100).all()) and torch.equal(yp[0], y[0])


@pytest.mark.parametrize("bad", [0, -1, 3, 1.0, True])
def test_bad_micro_batch_size(bad):
    model = _gpt()
    x, y = random_tokens(CFG, 4)
    with pytest.raises(ValueError, match="micro_batch_size"):
        acc.accumulated_gradients(model, x, y, bad)


def test_other_bad_inputs():
    model = _gpt()
    x, y = random_tokens(CFG, 4)
    with pytest.raises(ValueError, match="normalize must be one of"):
        acc.accumulated_gradients(model, x, y, 2, normalize="mean")
    with pytest.raises(ValueError, match="targets must be int64 of inputs's shape"):
        acc.accumulated_gradients(model, x, y[:2], 2)
    with pytest.raises(ValueError, match="model must be"):
        acc.accumulated_gradients(lambda t: t, x, y, 2)
    with pytest.raises(ValueError, match="at least one token"):
        acc.accumulated_gradients(model, x, torch.full_like(y, -100), 2)
    with pytest.raises(ValueError, match="lengths"):
        acc.pad_to_lengths(x, y, [1, 2, 3, 99])
    with pytest.raises(ValueError, match="same names"):
        acc._max_abs_difference({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


def test_weight_gap_is_the_largest_weight_difference():
    a, b = _gpt(), _gpt()
    assert acc.weight_gap(a, b) == 0.0
    with torch.no_grad():
        next(b.parameters()).view(-1)[3] += 0.25
        list(b.parameters())[-1].view(-1)[0] -= 0.5
    assert acc.weight_gap(a, b) == pytest.approx(0.5, abs=1e-12)
    assert acc.weight_gap(b, a) == acc.weight_gap(a, b)
    with pytest.raises(ValueError, match="a must be a torch.nn.Module"):
        acc.weight_gap({"w": torch.ones(1)}, b)
    with pytest.raises(ValueError, match="b must have parameters"):
        acc.weight_gap(a, nn.ReLU())
    with pytest.raises(ValueError, match="same names and shapes"):
        acc.weight_gap(nn.Linear(2, 3), nn.Linear(3, 2))


def test_count_scaler_calls_counts_what_the_training_loop_calls():
    from course_lib.training.loop import batches_of, make_grad_scaler, train

    model = _gpt(torch.float32)
    scaler = make_grad_scaler("cpu", init_scale=2.0**8)
    calls = acc.count_scaler_calls(scaler)
    assert calls == {"scale": 0, "unscale_": 0, "step": 0, "update": 0}
    x, y = random_tokens(CFG, 12, seed=3)
    log = train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches_of(x, y, 4),
                micro_batch_size=2, accumulation_steps=2, grad_scaler=scaler, max_grad_norm=1.0)
    # 3 steps of 2 micro-batches: every loss scaled, the rest once per effective batch
    assert log.steps == 3 and calls == {"scale": 6, "unscale_": 3, "step": 3, "update": 3}
    assert scaler.get_scale() == 2.0**8  # the scaler still works: no overflow, no growth yet
    with pytest.raises(ValueError, match="scaler must be a GradScaler"):
        acc.count_scaler_calls(object())
