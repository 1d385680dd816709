import dataclasses

import pytest
import torch

from course_lib.model import fused as fused_ops
from course_lib.model.gpt import (
    GPT,
    GPTConfig,
    check_config,
    gpt_param_count,
    param_numels,
    random_tokens,
)


def test_config_is_frozen_hashable_and_replaced_not_changed():
    config = GPTConfig(n_layers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_layers = 4
    deeper = dataclasses.replace(config, n_layers=4)
    assert (config.n_layers, deeper.n_layers) == (2, 4)
    assert hash(GPTConfig(n_layers=2)) == hash(config) and {config: "two"}[GPTConfig(n_layers=2)]
    assert deeper != config
    with pytest.raises(ValueError, match="n_layers"):  # replace checks the new config again
        dataclasses.replace(config, n_layers=0)


def test_check_config_returns_a_config_and_names_the_parameter():
    config = GPTConfig()
    assert check_config(config) is config
    for bad in ({"n_layers": 2}, None, "gpt2", GPT):
        with pytest.raises(ValueError, match="config must be a course_lib.model.gpt.GPTConfig"):
            check_config(bad)
    with pytest.raises(ValueError, match="model_config must be a course_lib.model.gpt.GPTConfig, "
                                         "got dict"):
        check_config({}, "model_config")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_closed_forms_match_the_built_model(bias, attention, count_parameters):
    config = GPTConfig(vocab_size=97, seq_len=16, d_model=24, n_heads=3, n_layers=3,
                       bias=bias, attention=attention)
    model = GPT(config)
    assert param_numels(config) == [p.numel() for p in model.parameters()]
    assert count_parameters(model) == gpt_param_count(config) == sum(param_numels(config))


def test_gpt2_small_has_its_published_parameter_count(count_parameters):
    # nanoGPT: "number of parameters: 124.44M" including position embeddings, head tied.
    config = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
    with torch.device("meta"):
        assert count_parameters(GPT(config)) == 124_439_808 == gpt_param_count(config)


def test_forward_shapes_loss_and_the_two_attentions_agree():
    torch.manual_seed(0)
    config = GPTConfig(attention="explicit")
    explicit = GPT(config).eval()
    sdpa = GPT(GPTConfig(attention="sdpa")).eval()
    sdpa.load_state_dict(explicit.state_dict())
    x, y = random_tokens(config, 3)
    logits, loss = explicit(x, y)
    assert logits.shape == (3, config.seq_len, config.vocab_size)
    assert torch.allclose(logits, sdpa(x), atol=1e-5)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1  # ~uniform at init


def test_fp64_logits_keep_fp64_in_the_loss():
    model = GPT(GPTConfig()).double()
    x, y = random_tokens(model.config, 2)
    assert model(x, y)[1].dtype == torch.float64


def test_random_tokens_are_shifted_and_own_their_storage():
    config = GPTConfig()
    x, y = random_tokens(config, 1, seed=3)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    assert torch.equal(random_tokens(config, 1, seed=3)[0], x)


@pytest.mark.parametrize("field,value,message", [
    ("d_model", 30, "divisible"), ("n_layers", 0, "n_layers"), ("dropout", 1.0, "dropout"),
    ("attention", "flash", "attention"), ("vocab_size", 2.5, "vocab_size"),
    ("fused_mlp", 1, "fused_mlp"), ("fused_residual", 1, "fused_residual")])
def test_bad_configs_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{field: value})


def test_too_long_a_sequence_is_refused():
    model = GPT(GPTConfig(seq_len=8))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("idx, match", [
    ([[1, 2, 3]], "idx must be a torch.Tensor"),
    (torch.zeros(2, 3), "integers"),
    (torch.zeros(3, dtype=torch.long), "2 dimensions"),
])
def test_forward_rejects_what_is_not_a_batch_of_token_ids(idx, match):
    config = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=1)
    with pytest.raises(ValueError, match=match):
        GPT(config)(idx)


def test_config_keeps_plain_ints_whatever_int_it_was_given():
    import numpy as np

    cfg = GPTConfig(n_layers=torch.tensor(2), d_model=np.int64(64), dropout=np.float32(0.5))
    assert type(cfg.n_layers) is int and type(cfg.d_model) is int and type(cfg.dropout) is float
    assert cfg == GPTConfig(n_layers=2, dropout=0.5)


@pytest.mark.parametrize("idx, targets, match", [
    (torch.zeros(0, 4, dtype=torch.long), None, "at least one token"),
    (torch.zeros(2, 4, dtype=torch.uint8), None, "int64"),
    (torch.full((2, 4), 256), None, r"idx must hold token ids in \[0, 256\)"),
    (torch.full((2, 4), -1), None, "from -1"),
    (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), "targets must"),
    (torch.zeros(2, 4, dtype=torch.long), torch.full((2, 4), 300), "targets must hold token"),
])
def test_forward_refuses_ids_it_cannot_embed_or_score(idx, targets, match):
    model = GPT(GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match=match):
        model(idx, targets)


def test_forward_and_batch_check_read_no_ids_off_the_cpu_unless_asked():
    """A tensor on the meta device has no values: reading one (``int(idx.max())``, what would make
    the host wait for a GPU) raises. The forward pass and check_batch must not read it; with the
    debug switch the forward pass does."""
    from course_lib.model.gpt import check_batch

    cfg = GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(2, 4, dtype=torch.long)
    check_batch(model, idx, idx)
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 4, 256) and loss.device.type == "meta"
    model.check_ids = True
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(idx, idx)


def test_ignore_index_targets_are_still_accepted():
    model = GPT(GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=1))
    targets = torch.zeros(2, 4, dtype=torch.long)
    targets[0, 0] = -100
    assert torch.isfinite(model(torch.zeros(2, 4, dtype=torch.long), targets)[1])


def _fused_pair(dtype, switch="fused_mlp", **shape):
    """The same weights as the plain model and as the fused one (``GPTConfig(fused_mlp=True)``,
    or the other ``switch``)."""
    config = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, **shape)
    torch.manual_seed(0)
    plain = GPT(config).to(dtype)
    fused = GPT(dataclasses.replace(config, **{switch: True})).to(dtype)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@pytest.mark.parametrize("switch", ["fused_mlp", "fused_residual"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fused_models_have_the_plain_models_outputs_and_gradients(dtype, tol, switch):
    pytest.importorskip("triton")  # on the CPU the kernel runs in Triton's interpreter
    plain, fused = _fused_pair(dtype, switch, dropout=0.0)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in fused.named_parameters()]
    x, y = random_tokens(plain.config, 2)
    losses = []
    for model in (plain, fused):
        logits, loss = model(x, y)
        loss.backward()
        losses.append((logits, loss))
    for got, want in zip(losses[1], losses[0], strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert q.grad.dtype == p.grad.dtype, name
        torch.testing.assert_close(q.grad.float(), p.grad.float(), atol=tol, rtol=tol, msg=name)


def test_the_fused_mlp_runs_the_kernel_under_autocast_and_needs_a_bias():
    pytest.importorskip("triton")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    plain, fused = _fused_pair(torch.float32)
    x, y = random_tokens(plain.config, 2)
    with torch.autocast("cpu", torch.bfloat16):
        want = plain(x, y)[1]
        with Ops() as ops:
            got = fused(x, y)[1]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert ops.seen.count(torch.ops.course.bias_gelu.default) == 2  # once per block
    assert torch.ops.aten.gelu.default not in ops.seen
    with pytest.raises(ValueError, match="fused_mlp=True needs bias=True"):
        GPTConfig(fused_mlp=True, bias=False)


def test_the_fused_residual_runs_the_kernel_under_autocast_and_needs_a_bias():
    pytest.importorskip("triton")
    plain, fused = _fused_pair(torch.float32, "fused_residual")
    x, y = random_tokens(plain.config, 2)
    with torch.autocast("cpu", torch.bfloat16):
        want = plain(x, y)[1]
        got = fused(x, y)[1]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="fused_residual=True needs bias=True"):
        GPTConfig(fused_residual=True, bias=False)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fused_residual_drops_what_the_unfused_ops_drop_under_its_mask(dtype, tol,
                                                                           monkeypatch):
    """With dropout, against the unfused ops (an add, a multiply by the mask, an add) on the
    mask the kernel draws: the same loss and gradients, seed for seed."""
    pytest.importorskip("triton")
    _, model = _fused_pair(dtype, "fused_residual", dropout=0.25)
    x, y = random_tokens(model.config, 2)

    def run():
        torch.manual_seed(5)  # the seeds the kernels draw, and every other dropout's mask
        model.zero_grad()
        loss = model(x, y)[1]
        loss.backward()
        return loss, [p.grad.clone() for p in model.parameters()]

    def unfused(branch, bias, residual, p, seed=None):
        seed = int(torch.randint(2**31, ())) if seed is None else seed  # as the op draws it
        ones = torch.ones_like(branch)
        with torch.no_grad():
            keep = torch.ops.course.bias_dropout_add(ones, torch.zeros_like(bias),
                                                     torch.zeros_like(ones), p, seed) != 0
        return residual + (branch + bias) * keep / (1 - p)

    loss, grads = run()
    monkeypatch.setattr(fused_ops, "bias_dropout_add", unfused)
    want, want_grads = run()
    torch.testing.assert_close(loss, want, atol=tol, rtol=tol)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    model.eval()  # the dropout did drop: without it the loss is another
    assert not torch.allclose(model(x, y)[1], loss)
