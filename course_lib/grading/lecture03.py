"""Checks for exercises/03_gradient_accumulation.ipynb: what the learner's function does to a
small course GPT, against the gradient of one pass over the whole batch."""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.gpt import GPT, GPTConfig

from . import expect, grader, observe

_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)


class _BatchCoupledGPT(GPT):
    """The course GPT whose blocks subtract half their input's batch mean, coupling a pass's
    sequences as a BatchNorm does: only micro-batch passes reproduce its gradient."""

    def run_blocks(self, x):
        return super().run_blocks(x - 0.5 * x.mean(dim=0, keepdim=True))


def _gpt(seed: int = 0, coupled: bool = False) -> GPT:
    torch.default_generator.manual_seed(seed)
    return (_BatchCoupledGPT if coupled else GPT)(_CFG)


def _tokens(batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, _CFG.vocab_size, (batch, _CFG.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _flat(grads) -> torch.Tensor:
    """The gradients as one flat tensor."""
    return torch.cat([g.flatten() for g in grads])


def _reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int):
    """The reference ``(flat gradient, loss)`` of accumulation: each micro-batch's summed token
    loss over the batch's targets that are not -100 (``micro`` the batch size: one pass)."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    grads = [torch.zeros_like(p) for p in params]
    tokens, total = (y != -100).sum(), 0.0
    for i in range(0, x.size(0), micro):
        logits = model(x[i:i + micro])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[i:i + micro].reshape(-1),
                               ignore_index=-100, reduction="sum") / tokens
        total += loss.item()
        for g, d in zip(grads, torch.autograd.grad(loss, params)):
            g += d
    return _flat(grads), total


def _whole_batch_at_once(grads, model: nn.Module, x, y) -> None:
    """Fail when ``grads`` are those of one pass over the whole batch through the coupled model."""
    one_pass = _reference_grads(model, x, y, x.size(0))[0]
    expect(not torch.allclose(_flat(grads), one_pass, rtol=1e-4, atol=1e-6),
           "the gradients are those of one forward pass over the whole batch (this model couples "
           "the sequences of a forward pass, as BatchNorm does, so its gradient tells)",
           hint="run the model on one micro-batch at a time, model(inputs[i:i + "
                "micro_batch_size]), and call backward() on each micro-batch's loss")


def _record_sizes(model: nn.Module):
    """``(sizes, handle)``: a forward pre-hook appends the batch size of every forward call."""
    sizes: list[int] = []

    def record(module, args, kwargs):
        sizes.append(next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
                     .size(0))

    return sizes, model.register_forward_pre_hook(record, with_kwargs=True)


def _compare_grads(grads, ref, what: str, K: int):
    """Fail, with the hint its size suggests, unless the learner's ``grads`` are ``ref``."""
    expect(all(g is not None for g in grads), f"after {what}, some parameters have no .grad",
           hint="call .backward() on each micro-batch's loss")
    got = _flat(grads)
    ratio = (got.norm() / ref.norm()).item()
    if not torch.allclose(got, ref, rtol=1e-4, atol=1e-6):
        if K > 1 and abs(ratio - K) < 0.05 * K:
            hint = (f"your gradients are {K} times too large: the {K} micro-batch losses are "
                    f"each a mean, so divide each by K before backward()")
        elif ratio < 0.98:
            hint = (f"your gradients are too small: divide each micro-batch's mean loss by K = {K} "
                    "(the number of micro-batches, not the batch size), and let every "
                    "micro-batch's gradient add up: zero .grad once, before the loop")
        elif abs(ratio - 1) < 1e-3:
            hint = "the size is right but the direction is not: is every micro-batch weighted right?"
        else:
            hint = (f"the gradient norm is {ratio:.3g} times the right one: zero the gradients "
                    "first (model.zero_grad()), then add each micro-batch's share once")
        expect(False, f"after {what}, .grad differs from the full batch's gradient "
               f"(norm ratio {ratio:.4g})", hint=hint)


def _loss_answer(loss):
    """The loss a learner returned, as plain data (a float, int or tensor, else its repr)."""
    if isinstance(loss, float | int | torch.Tensor) and not isinstance(loss, bool):
        return loss.detach() if isinstance(loss, torch.Tensor) else loss
    return repr(loss)[:200]


def _accumulate_run(fn, batch: int, micro: int, seed: int, padded: list | None = None,
                    coupled: bool = False) -> dict:
    """Run ``fn`` on the case's model (beside the learner's code): the gradients it left, the
    loss it returned and the batch size of every forward call."""
    model = _gpt(seed, coupled)
    x, y = _tokens(batch, seed) if padded is None else _padded_tokens(padded, seed)
    for p in model.parameters():  # leftovers from an earlier step must not survive
        p.grad = torch.ones_like(p) if padded is None else None
    sizes, handle = _record_sizes(model)
    try:
        loss = fn(model, x, y, micro)
    finally:
        handle.remove()
    return {"grads": [p.grad for p in model.parameters()], "loss": _loss_answer(loss),
            "sizes": sizes}


@grader
def check_accumulate_gradients(fn):
    """``fn(model, inputs, targets, micro_batch_size)``: accumulated ``.grad``; returns the loss."""
    for batch, micro, seed in ((8, 2, 0), (8, 4, 1), (6, 1, 2), (4, 4, 3)):
        x, y = _tokens(batch, seed)
        reference, ref_loss = _reference_grads(_gpt(seed), x, y, x.size(0))
        run = observe(_accumulate_run, fn, batch, micro, seed)
        loss, sizes = run["loss"], run["sizes"]
        K = batch // micro
        what = f"a batch of {batch} in micro-batches of {micro}"
        expect(sizes and max(sizes) <= micro,
               f"for {what}, the model ran on batches of {sorted(set(sizes))}",
               hint="run the model on one micro-batch at a time: inputs[i:i + micro_batch_size]")
        expect(sum(sizes) == batch,
               f"for {what}, the model saw {sum(sizes)} samples, not {batch}",
               hint="every sample of the batch goes through the model exactly once")
        _compare_grads(run["grads"], reference, what, K)
        expect(isinstance(loss, float | int | torch.Tensor) and abs(float(loss) - ref_loss) < 1e-4,
               f"for {what}, you returned the loss {loss!r}; the batch's mean loss is {ref_loss:.6f}",
               hint="return the sum of the micro-batch losses you called backward() on, as a float")
    # What ran, told by the gradient itself: a model that couples the sequences of a pass.
    batch, micro, seed = 8, 2, 4
    x, y = _tokens(batch, seed)
    reference = _reference_grads(_gpt(seed, coupled=True), x, y, micro)[0]
    grads = observe(_accumulate_run, fn, batch, micro, seed, coupled=True)["grads"]
    expect(all(g is not None for g in grads), "after a batch of 8 in micro-batches of 2, some "
           "parameters have no .grad", hint="call .backward() on each micro-batch's loss")
    _whole_batch_at_once(grads, _gpt(seed, coupled=True), x, y)
    _compare_grads(grads, reference, f"a batch of {batch} in micro-batches of {micro}, through a "
                   "model that couples the sequences of a forward pass", batch // micro)


def _padded_tokens(lengths: list[int], seed: int):
    x, y = _tokens(len(lengths), seed)
    pad = torch.arange(_CFG.seq_len)[None, :] >= torch.tensor(lengths)[:, None]
    return x.masked_fill(pad, 0), y.masked_fill(pad, -100)


@grader
def check_accumulate_padded(fn):
    """``fn(model, inputs, targets, micro_batch_size)``: the same with padded targets (-100)."""
    cases = (([8, 8, 1, 2, 8, 3, 5, 1], 2, 0),   # short and long micro-batches
             ([1, 8, 2, 7, 3, 6], 3, 1),
             ([8, 5, 0, 0, 2, 8, 4, 1], 2, 2))   # one micro-batch is all padding
    for lengths, micro, seed in cases:
        x, y = _padded_tokens(lengths, seed)
        reference, ref_loss = _reference_grads(_gpt(seed), x, y, x.size(0))
        run = observe(_accumulate_run, fn, len(lengths), micro, seed, list(lengths))
        loss, grads = run["loss"], run["grads"]
        what = f"sequences of lengths {lengths} in micro-batches of {micro}"
        expect(all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
               f"for {what}, some gradients are missing or not finite (NaN)",
               hint="a micro-batch with only padding has a mean loss of 0/0 = NaN: skip it, or "
                    "sum the token losses (F.cross_entropy(..., reduction='sum'))")
        got, ref = _flat(grads), reference
        expect(torch.allclose(got, ref, rtol=1e-4, atol=1e-6),
               f"for {what}, .grad differs from the full batch's gradient by "
               f"{((got - ref).norm() / ref.norm()).item():.1%}",
               hint="weight each micro-batch by its share of the real tokens: count the targets "
                    "that are not -100 in the whole batch (N) and use sum of token losses / N; "
                    "dividing each micro-batch's mean by K over-weights short micro-batches")
        expect(isinstance(loss, float | int | torch.Tensor) and abs(float(loss) - ref_loss) < 1e-4,
               f"for {what}, you returned the loss {loss!r}; the batch's mean over its real "
               f"tokens is {ref_loss:.6f}",
               hint="a micro-batch of padding only has a mean loss of 0/0 = NaN: sum the token "
                    "losses (reduction='sum') and divide the total by the batch's real tokens")
    lengths, micro, seed = [8, 3, 0, 5, 8, 1], 2, 5
    x, y = _padded_tokens(lengths, seed)
    reference = _reference_grads(_gpt(seed, coupled=True), x, y, micro)[0]
    grads = observe(_accumulate_run, fn, len(lengths), micro, seed, lengths, coupled=True)["grads"]
    expect(all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
           f"for sequences of lengths {lengths}, some gradients are missing or not finite",
           hint="sum the token losses (F.cross_entropy(..., reduction='sum'))")
    _whole_batch_at_once(grads, _gpt(seed, coupled=True), x, y)
    expect(torch.allclose(_flat(grads), reference, rtol=1e-4, atol=1e-6),
           f"for sequences of lengths {lengths} in micro-batches of {micro}, through a model that "
           "couples the sequences of a forward pass, .grad differs from the micro-batches' sum",
           hint="one forward and backward per micro-batch, each its summed token loss divided "
                "by the batch's real tokens")


class _BatchCenter(nn.Module):
    """Subtracts the batch mean: couples samples, and is not a BatchNorm."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


def _coupling_model() -> tuple[nn.Module, set[str]]:
    torch.default_generator.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        fc1=nn.Linear(6, 8), bn=nn.BatchNorm1d(8), act=nn.ReLU(), ln=nn.LayerNorm(8),
        drop=nn.Dropout(0.5), center=_BatchCenter(), gn=nn.GroupNorm(2, 8),
        frozen_bn=nn.BatchNorm1d(8), fc2=nn.Linear(8, 3))).train()
    model.frozen_bn.eval()  # uses its running statistics: no coupling
    return model, {"bn", "center"}


def _conv_model() -> tuple[nn.Module, set[str]]:
    torch.default_generator.manual_seed(1)
    body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.GroupNorm(2, 4), nn.InstanceNorm2d(4))
    model = nn.Sequential(OrderedDict(body=body, pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(),
                                      head=nn.Linear(4, 2)))
    return model.train(), {"body.1"}


_LAYERS = {"linear": lambda: nn.Linear(8, 8), "bn": lambda: nn.BatchNorm1d(8),
           "bn_eval": lambda: nn.BatchNorm1d(8).eval(), "ln": lambda: nn.LayerNorm(8),
           "relu": nn.ReLU, "drop": lambda: nn.Dropout(0.5), "center": _BatchCenter,
           "gn": lambda: nn.GroupNorm(2, 8), "tanh": nn.Tanh}
#: The kinds of :data:`_LAYERS` whose output for one sample depends on the others (in train mode).
COUPLED_KINDS = {"bn", "center"}


def _drawn_coupling_model(kinds: list[tuple[str, str]], seed: int) -> nn.Module:
    """A ``nn.Sequential`` of ``(name, kind)`` layers of :data:`_LAYERS`, 8 features wide."""
    torch.default_generator.manual_seed(seed)
    model = nn.Sequential()
    for name, kind in kinds:
        model.add_module(name, _LAYERS[kind]())
    model.train()
    for name, kind in kinds:
        if kind == "bn_eval":
            getattr(model, name).eval()
    return model


def _drawn_coupled_answer(fn, kinds, seed):
    """The learner's answer for a drawn model (run beside the learner's code)."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    return fn(_drawn_coupling_model(kinds, seed), x)


@grader
def check_batch_coupled_modules(fn):
    """``fn(model, x)``: the leaf modules whose output for a sample depends on the others."""
    cases = ((_coupling_model, torch.randn(8, 6, generator=torch.Generator().manual_seed(0))),
             (_conv_model, torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(1))))
    for build, x in cases:
        model, truth = build()
        got = fn(model, x.clone())
        expect(isinstance(got, list | set | tuple) and all(isinstance(n, str) for n in got),
               f"returned {got!r}; expected a list of module names (str)",
               hint="names as model.named_modules() gives them, e.g. 'bn' or 'body.1'")
        got = {str.__str__(n) for n in got}  # a str's own value, whatever its __eq__
        missing, extra = sorted(truth - got), sorted(got - truth)
        layers = {name: type(m).__name__ for name, m in model.named_modules()}
        expect(not missing, f"missed {[f'{n} ({layers.get(n)})' for n in missing]}",
               hint="test every leaf module by measurement, not by its type: feed it its own input "
                    "twice, with the other samples changed the second time, and compare sample 0; "
                    "a BatchNorm in eval mode uses running statistics and does not couple")
        expect(not extra, f"flagged {[f'{n} ({layers.get(n)})' for n in extra]}, whose output for "
               "one sample does not depend on the other samples",
               hint="compare only sample 0's output, re-seed the RNG before each call so that "
                    "Dropout draws the same mask (torch.manual_seed), and leave eval-mode "
                    "BatchNorm alone")


def _epoch_run(fn, n: int, micro: int, K: int, coupled: bool = False) -> dict:
    """Train one epoch with ``fn`` (beside the learner's code): the gradient each optimizer
    step saw and the batch size of every forward call."""
    model = _gpt(n, coupled)
    x, y = _tokens(n, n)
    params, seen = list(model.parameters()), []
    optimizer = torch.optim.SGD(params, lr=0.0)  # the weights stay put
    optimizer.register_step_pre_hook(lambda *_: seen.append(torch.cat(  # no .grad counts as zeros
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])))
    sizes, handle = _record_sizes(model)
    try:
        fn(model, optimizer, x, y, micro, K)
    finally:
        handle.remove()
    return {"sizes": sizes, "seen": seen}


@grader
def check_epoch_windows(fn):
    """``fn(model, optimizer, inputs, targets, micro_batch_size, accumulation_steps)``: one epoch.

    A step every K micro-batches and one for a last partial window, each with the mean gradient
    of its window's sequences.
    """
    # windows 4,4,2 / 3,3,1 / 4,4 / 2,1; the last through a model that couples the sequences of
    # a forward pass, whose gradients tell the micro-batches from a window run at once
    cases = ((20, 2, 4, False), (14, 2, 3, False), (16, 2, 4, False), (12, 4, 2, False),
             (6, 1, 4, True))
    for n, micro, K, coupled in cases:
        model = _gpt(n, coupled)
        x, y = _tokens(n, n)
        micro_batches = n // micro
        windows = [list(range(s, min(s + K, micro_batches))) for s in range(0, micro_batches, K)]
        run = observe(_epoch_run, fn, n, micro, K, coupled)
        sizes, seen_steps = run["sizes"], run["seen"]
        what = (f"{n} sequences in micro-batches of {micro} with K = {K} "
                f"(windows of {[len(w) for w in windows]} micro-batches)")
        expect(sizes and max(sizes) <= micro,
               f"for {what}, the model ran on batches of {sorted(set(sizes))}",
               hint="run the model on one micro-batch at a time")
        got = len(seen_steps)
        expect(got == len(windows),
               f"for {what}, the optimizer stepped {got} times, not {len(windows)}",
               hint="step once every K micro-batches and once more for the micro-batches left "
                    "at the end of the epoch (the last partial window)" if got < len(windows)
               else "step once per window of K micro-batches, not once per micro-batch")
        for number, (window, seen) in enumerate(zip(windows, seen_steps), start=1):
            first, last = window[0] * micro, (window[-1] + 1) * micro
            ref = _reference_grads(model, x[first:last], y[first:last], micro)[0]
            if torch.allclose(seen, ref, rtol=1e-4, atol=1e-6):
                continue
            if coupled and torch.allclose(seen, _reference_grads(
                    model, x[first:last], y[first:last], last - first)[0], rtol=1e-4, atol=1e-6):
                expect(False, f"for {what}, optimizer step {number} saw the gradient of one "
                       "forward pass over its whole window (this model couples the sequences of "
                       "a forward pass, as BatchNorm does, so its gradient tells)",
                       hint="run the model on one micro-batch at a time")
            ratio = (seen.norm() / ref.norm()).item()
            if len(window) < K and abs(ratio - len(window) / K) < 0.02:
                hint = (f"the last window holds {len(window)} micro-batches, not K = {K}: divide "
                        f"its losses by {len(window)}, the micro-batches it holds")
            elif ratio > 1.02:
                hint = ("zero the gradients after each optimizer step (optimizer.zero_grad()), "
                        "so that one window's gradients do not leak into the next")
            else:
                hint = ("each step must see the mean gradient of its own window's sequences: "
                        "every micro-batch's mean loss divided by the number of micro-batches "
                        "in that window")
            expect(False, f"for {what}, optimizer step {number} saw a gradient {ratio:.3g} "
                   "times the mean gradient of its window", hint=hint)
