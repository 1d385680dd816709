"""The shared training loop: accumulation equals one big batch, GradScaler once per step, DDP no_sync."""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn

from course_lib.model.gpt import GPT, GPTConfig
from course_lib.model.toy_data import markov_tokens
from course_lib.training import loop as tr
from course_lib.training.accumulation import micro_batch_loss

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)


def pad_to_lengths(x, y, lengths):
    """Row i keeps its first lengths[i] tokens; then input 0 and target -100, as a collator pads."""
    past = torch.arange(x.size(1)) >= torch.as_tensor(lengths)[:, None]
    return x.masked_fill(past, 0), y.masked_fill(past, -100)


def _setup(dtype=torch.float64, lr=1e-2):
    torch.manual_seed(0)
    model = GPT(CFG).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _data(n=32, seed=0):
    return markov_tokens(n, CFG.seq_len, CFG.vocab_size, seed=seed)


def _max_weight_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_accumulation_gives_the_weights_of_one_big_batch_after_adamw_steps():
    x, y = _data()
    x, y = pad_to_lengths(x, y, torch.arange(32) % 9)  # padded: needs token normalisation
    batches = tr.batches_of(x, y, 8)
    big, opt_big = _setup()
    tr.train(big, opt_big, batches, micro_batch_size=8)
    for b in (1, 2, 4):
        model, opt = _setup()
        log = tr.train(model, opt, batches, micro_batch_size=b, accumulation_steps=8 // b)
        assert log.steps == 4 and log.micro_steps == 4 * 8 // b
        assert _max_weight_diff(model, big) < 1e-12


def test_mean_of_means_drifts_from_the_big_batch_with_padding():
    x, y = pad_to_lengths(*_data(), torch.arange(32) % 8 + 1)
    batches = tr.batches_of(x, y, 8)
    big, opt_big = _setup()
    tr.train(big, opt_big, batches, micro_batch_size=8)
    model, opt = _setup()
    tr.train(model, opt, batches, micro_batch_size=2, accumulation_steps=4, normalize="mean-of-means")
    assert _max_weight_diff(model, big) > 1e-4


def test_logged_loss_is_the_batch_mean_and_counts_tokens():
    x, y = pad_to_lengths(*_data(8), [8, 1, 2, 3, 4, 5, 6, 7])
    model, opt = _setup()
    expected = model(x, y)[1].item()
    seen = []
    log = tr.train(model, opt, [(x, y)], micro_batch_size=2, accumulation_steps=4,
                   on_step=lambda step, loss: seen.append((step, loss)))
    assert log.losses[0] == pytest.approx(expected, rel=1e-6)
    assert log.tokens == [36] and seen == [(1, log.losses[0])] and log.skipped == [False]


def test_log_continues_a_run():
    model, opt = _setup()
    batches = tr.batches_of(*_data(), 8)
    log = tr.train(model, opt, batches[:2], micro_batch_size=4, accumulation_steps=2)
    tr.train(model, opt, batches[2:], micro_batch_size=4, accumulation_steps=2, log=log)
    assert log.steps == 4 and log.micro_steps == 8 and log.seconds > 0


def _gradient_after(train_batches, **kwargs):
    """The flat gradient the optimizer sees at the last step of ``train`` (SGD with lr 0)."""
    torch.manual_seed(0)
    model = GPT(CFG).double()
    seen = []
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.register_step_pre_hook(lambda o, args, kw: seen.append(
        torch.cat([p.grad.flatten() for p in model.parameters()])))
    log = tr.train(model, opt, train_batches, **kwargs)
    return seen[-1], log


@pytest.mark.parametrize("normalize", ["tokens", "mean-of-means"])
def test_last_partial_window_is_weighted_by_what_it_holds(normalize):
    x, y = _data(40)  # 10 micro-batches of 4, K = 4: windows of 4, 4 and 2 micro-batches
    batches = tr.batches_of(x, y, 16, drop_last=False)
    assert [b[0].size(0) for b in batches] == [16, 16, 8]
    got, log = _gradient_after(batches, micro_batch_size=4, accumulation_steps=4,
                               normalize=normalize)
    assert log.micro_batches == [4, 4, 2] and log.tokens[-1] == 8 * CFG.seq_len
    # reference: the mean gradient of the last window's 8 sequences, in one pass
    torch.manual_seed(0)
    model = GPT(CFG).double()
    model(x[32:], y[32:])[1].backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(got, reference, rtol=1e-10, atol=1e-13)
    # the bug: the window's two means divided by K = 4 give half of it
    model.zero_grad()
    for xs, ys in zip(x[32:].split(4), y[32:].split(4)):
        micro_batch_loss(model, xs, ys, normalize="mean-of-means", accumulation_steps=4).backward()
    bug = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(bug, reference / 2, rtol=1e-10, atol=1e-13)


def test_a_last_micro_batch_smaller_than_the_others_counts_its_tokens():
    x, y = _data(10)  # micro-batches of 4, 4 and 2 in one window of K = 4
    got, log = _gradient_after([(x, y)], micro_batch_size=4, accumulation_steps=4)
    assert log.micro_batches == [3]
    torch.manual_seed(0)
    model = GPT(CFG).double()
    model(x, y)[1].backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(got, reference, rtol=1e-10, atol=1e-13)


def test_only_the_last_batch_may_be_short():
    model, opt = _setup()
    x, y = _data(40)
    short_first = tr.batches_of(x, y, 16, drop_last=False)[::-1]  # the short one first
    with pytest.raises(ValueError, match="the last one of the run may hold fewer"):
        tr.train(model, opt, short_first, micro_batch_size=4, accumulation_steps=4)
    log = tr.train(model, opt, iter(tr.batches_of(x, y, 16, drop_last=False)),  # a generator
                   micro_batch_size=4, accumulation_steps=4)
    assert log.micro_batches == [4, 4, 2]
    assert len(tr.batches_of(x, y, 16)) == 2  # drop_last=True, the default, drops the rest
    with pytest.raises(ValueError, match="drop_last"):
        tr.batches_of(x, y, 16, drop_last="no")


class CountingScaler:
    """Wraps a GradScaler and counts the calls of each of its methods."""

    def __init__(self, scaler):
        self.scaler, self.calls = scaler, {"scale": 0, "unscale_": 0, "step": 0, "update": 0}

    def __getattr__(self, name):
        attr = getattr(self.scaler, name)
        if name in self.calls:
            def counted(*args, **kwargs):
                self.calls[name] += 1
                return attr(*args, **kwargs)
            return counted
        return attr


def test_grad_scaler_steps_once_per_effective_batch_and_changes_nothing_in_fp32():
    batches = tr.batches_of(*_data(), 8)
    plain, opt_plain = _setup(torch.float32)
    tr.train(plain, opt_plain, batches, micro_batch_size=2, accumulation_steps=4)
    model, opt = _setup(torch.float32)
    scaler = CountingScaler(tr.make_grad_scaler("cpu", init_scale=2.0**10))
    log = tr.train(model, opt, batches, micro_batch_size=2, accumulation_steps=4,
                   grad_scaler=scaler, max_grad_norm=1e9)
    assert scaler.calls == {"scale": 16, "unscale_": 4, "step": 4, "update": 4}
    assert log.scales == [2.0**10] * 4 and not any(log.skipped)
    # Powers of two scale and unscale exactly: the same weights, bit for bit.
    assert _max_weight_diff(model, plain) == 0.0


def test_an_overflow_in_one_micro_batch_skips_the_whole_step():
    model, opt = _setup(torch.float32)
    before = copy.deepcopy(model)
    calls = {"n": 0}

    def poison(module, args, output):  # the 3rd micro-batch overflows
        calls["n"] += 1
        return output * math.inf if calls["n"] == 3 else output

    model.ln_f.register_forward_hook(poison)
    scaler = tr.make_grad_scaler("cpu", init_scale=2.0**8)
    log = tr.train(model, opt, tr.batches_of(*_data(8), 8), micro_batch_size=2,
                   accumulation_steps=4, grad_scaler=scaler)
    assert log.skipped == [True] and log.scales == [2.0**7]
    assert _max_weight_diff(model, before) == 0.0


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_cpu_trains(amp_dtype):
    model, opt = _setup(torch.float32, lr=3e-3)
    log = tr.train(model, opt, tr.batches_of(*_data(64), 8) * 3, micro_batch_size=4,
                   accumulation_steps=2, amp_dtype=amp_dtype)
    assert all(math.isfinite(v) for v in log.losses)
    assert log.losses[-1] < log.losses[0]
    assert bool(log.scales) == (amp_dtype == torch.float16)  # "auto": a scaler for fp16 only


class FakeDDP(nn.Module):
    """A model with DDP's no_sync() context manager, recording when it is active."""

    def __init__(self, module):
        super().__init__()
        self.module, self.syncing, self.backward_syncs = module, True, []

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def forward(self, x):
        self.backward_syncs.append(self.syncing)
        return self.module(x)


def test_no_sync_covers_all_micro_batches_but_the_last():
    model, _ = _setup()
    ddp = FakeDDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    tr.train(ddp, opt, tr.batches_of(*_data(), 8)[:2], micro_batch_size=2, accumulation_steps=4,
             no_sync=True)
    assert ddp.backward_syncs == [False, False, False, True] * 2
    # A last micro-batch of padding only still runs: it is the one that all-reduces.
    x, y = _data(8)
    x, y = pad_to_lengths(x, y, [8, 8, 8, 8, 8, 8, 0, 0])
    ddp.backward_syncs.clear()
    tr.train(ddp, opt, [(x, y)], micro_batch_size=2, accumulation_steps=4, no_sync=True)
    assert ddp.backward_syncs == [False, False, False, True]
    with pytest.raises(ValueError, match="no_sync"):
        tr.train(model, opt, [], micro_batch_size=2, no_sync=True)


def test_real_ddp_with_gloo_matches_the_plain_model(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        batches = tr.batches_of(*_data(), 8)
        plain, opt_plain = _setup()
        tr.train(plain, opt_plain, batches, micro_batch_size=2, accumulation_steps=4)
        model, _ = _setup()
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        tr.train(ddp, opt, batches, micro_batch_size=2, accumulation_steps=4, no_sync=True)
        assert _max_weight_diff(model, plain) < 1e-12
    finally:
        dist.destroy_process_group()


def test_progress_bar(capsys):
    model, opt = _setup()
    log = tr.train(model, opt, tr.batches_of(*_data(), 16), micro_batch_size=8,
                   accumulation_steps=2, progress=True)
    assert log.steps == 2
    assert "optimizer steps" in capsys.readouterr().err


def test_bad_inputs_name_the_parameter():
    model, opt = _setup()
    batches = tr.batches_of(*_data(), 8)
    cases = [
        (dict(micro_batch_size=0), "micro_batch_size"),
        (dict(micro_batch_size=2, accumulation_steps=0), "accumulation_steps"),
        (dict(micro_batch_size=2, normalize="sum"), "normalize"),
        (dict(micro_batch_size=2, amp_dtype=torch.float64), "amp_dtype"),
        (dict(micro_batch_size=2, grad_scaler="yes"), "grad_scaler"),
        (dict(micro_batch_size=2, max_grad_norm=0.0), "max_grad_norm"),
        (dict(micro_batch_size=2, accumulation_steps=2), "each batch must hold"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            tr.train(model, opt, batches, **kwargs)
    with pytest.raises(ValueError, match="device_type"):
        tr.make_grad_scaler("tpu")
    with pytest.raises(ValueError, match="batch_size"):
        tr.batches_of(*_data(4), 8)


@pytest.mark.gpu
def test_fp16_autocast_with_scaler_on_cuda():
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = (t.cuda() for t in _data(64))
    log = tr.train(model, opt, tr.batches_of(x, y, 8) * 3, micro_batch_size=4,
                   accumulation_steps=2, amp_dtype=torch.float16)
    assert log.scales and all(math.isfinite(v) for v in log.losses)
    assert log.losses[-1] < log.losses[0]


def test_auto_makes_a_scaler_for_fp16_only_and_none_means_none():
    batches = tr.batches_of(*_data(), 8)
    scales = {}
    for amp_dtype in (torch.float16, torch.bfloat16):
        for scaler in ("auto", None):
            model, opt = _setup(torch.float32)
            log = tr.train(model, opt, batches, micro_batch_size=4, accumulation_steps=2,
                           amp_dtype=amp_dtype, grad_scaler=scaler)
            scales[amp_dtype, scaler] = len(log.scales)
    assert scales == {(torch.float16, "auto"): 4, (torch.float16, None): 0,  # 4 steps
                      (torch.bfloat16, "auto"): 0, (torch.bfloat16, None): 0}


def test_the_loop_reads_nothing_off_the_device_until_the_run_ends():
    """On the meta device any read of a value (int(), float(), .item(), a boolean mask) raises:
    both steps, eight micro-batches, run to the end; the only read is the log's, afterwards."""
    model = GPT(CFG).to("meta")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.empty(8, 8, dtype=torch.long, device="meta")
    log = tr._TrainLog()
    with pytest.raises(NotImplementedError, match="meta"):
        tr.train(model, optimizer, [(x, x), (x, x)], micro_batch_size=2, accumulation_steps=4,
                 log=log)
    assert (log.micro_steps, log.micro_batches) == (8, [4, 4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_step_does_not_wait_for_the_device():
    model = GPT(CFG).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    x = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
    try:
        log = tr._TrainLog()
        with pytest.raises(RuntimeError, match="synchroniz"):  # the log's read, after the run
            tr.train(model, optimizer, [(x, x)] * 2, micro_batch_size=4, accumulation_steps=2,
                     log=log)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert log.micro_batches == [2, 2]
