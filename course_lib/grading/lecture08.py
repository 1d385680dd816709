"""Checks for exercises/08_more_levers.ipynb.

The optimizer in backward is set against plain AdamW on a copy, the chunked loss against
``F.cross_entropy`` with a dispatch mode watching the largest tensor; the quantized state bytes
(torchao's rules) and the ladder's order are written out (rules: ``course_tools/hidden.py``).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import exactly, expect, grader, observe, observe_peak


class _Tied(nn.Module):
    """Two linears sharing one weight, a frozen scale, and a bias: the cases that bite."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.frozen = nn.Parameter(torch.full((6,), 0.5), requires_grad=False)
        self.outer = nn.Linear(6, 6)
        self.outer.weight = self.inner.weight  # tied, as the course GPT's head and embedding
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = torch.tanh(self.inner(x)) * self.frozen
        x = torch.tanh(self.outer(x))
        return self.head(x)


def _adamw(params):
    """The optimizer of every parameter, fused or not: AdamW, one tensor at a time."""
    return torch.optim.AdamW(params, lr=0.05, foreach=False)


def _fuse_data():
    """Three seeded ``(input, target)`` batches of the fused case."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(3)]


def _fuse_run(fn) -> dict:
    """Fuse the optimizer into the case's model with ``fn``, train 3 steps by backward() alone
    (beside the learner's code): the ``make_optimizer`` calls, gradients left, final weights."""
    torch.default_generator.manual_seed(0)
    model = _Tied()
    made = []

    def make_optimizer(params):
        params = list(params)
        made.append(params)
        return _adamw(params)

    fn(model, make_optimizer)
    left = []
    for x, y in _fuse_data():
        F.mse_loss(model(x), y).backward()
        left.append([n for n, p in model.named_parameters() if p.grad is not None])
    return {"made": [len(ps) for ps in made], "left": left,
            "weights": [p.detach() for p in model.parameters()]}


@grader
def check_fuse_optimizer(fn):
    """``fn(model, make_optimizer)`` makes ``loss.backward()`` also take the optimizer step."""
    torch.default_generator.manual_seed(0)
    reference = _Tied()
    trainable = [p for p in reference.parameters() if p.requires_grad]
    opt = _adamw(trainable)
    run = observe(_fuse_run, fn)
    made = run["made"]
    expect(len(made) == len(trainable),
           f"make_optimizer was called {len(made)} times for a model with {len(trainable)} "
           "trainable parameter tensors (one of them used twice, one frozen)",
           hint="one optimizer per parameter that requires grad; model.parameters() lists a "
                "shared weight once")
    expect(all(n == 1 for n in made), "each optimizer should get exactly one parameter",
           hint="make_optimizer([p])")
    for step, ((x, y), left) in enumerate(zip(_fuse_data(), run["left"])):
        F.mse_loss(reference(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        expect(not left, f"after backward() of step {step + 1}, {left} still hold a gradient",
               hint="free it in the hook: optimizer.zero_grad(set_to_none=True) after step()")
    names = [n for n, _ in reference.named_parameters()]
    weights = run["weights"]
    expect(len(run["left"]) == 3 and len(weights) == len(names), "the model came back changed",
           hint="change the parameters' values only")
    for name, a, b in zip(names, weights, reference.parameters()):
        expect(isinstance(a, torch.Tensor) and a.shape == b.shape
               and torch.allclose(a, b, rtol=0, atol=1e-7),
               f"after 3 steps {name} differs from the ordinary AdamW step's",
               hint="the hook must run after the gradient is complete: "
                    "p.register_post_accumulate_grad_hook, once per parameter tensor")


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any floating-point tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


def _chunked_run(fn, hidden, weight, targets, chunk: int) -> dict:
    """``fn``'s loss, and the most elements of a tensor it made (beside the learner's code)."""
    with torch.no_grad(), _LargestTensor() as watch:
        got = fn(hidden, weight, targets, chunk)
    return {"loss": got, "largest": watch.largest}


@grader
def check_chunked_loss(fn):
    """``fn(hidden, weight, targets, chunk_size)``: the mean cross-entropy, one chunk at a time."""
    g = torch.Generator().manual_seed(3)
    N, h, V = 13, 8, 60
    for chunk, scale, ignored in [(5, 1.0, [2, 11]), (13, 1.0, []), (4, 300.0, [0]),
                                  (1, 1.0, [12]), (20, 1.0, [3])]:
        hidden = torch.randn(N, h, generator=g, dtype=torch.float64) * scale
        weight = torch.randn(V, h, generator=g, dtype=torch.float64)
        targets = torch.randint(0, V, (N,), generator=g)
        targets[ignored] = -100
        truth = F.cross_entropy(hidden @ weight.T, targets)
        run = observe(_chunked_run, fn, hidden, weight, targets, chunk)
        got, largest = run["loss"], run["largest"]
        case = f"chunk_size={chunk}, {N} tokens, {len(ignored)} ignored"
        got = torch.as_tensor(got, dtype=torch.float64)
        expect(torch.isfinite(got).all(),
               f"{case}{', logits up to ~' + str(int(scale * 10)) if scale > 1 else ''}: "
               f"got {got.item()}",
               hint="logsumexp of large logits overflows exp(): use torch.logsumexp, or subtract "
                    "the row's maximum first")
        expect(torch.allclose(got, truth, rtol=1e-9, atol=1e-9),
               f"{case}: got {got.item():.6f}, expected {truth.item():.6f}",
               hint="sum the per-token losses over every chunk (the last one may be shorter), "
                    "then divide once by the number of targets that are not -100")
        limit = max(min(chunk, N) * V, V * h)  # a chunk of logits, or the weight (weight.T)
        expect(isinstance(largest, int) and largest <= limit,
               f"{case}: a tensor of {largest} elements appeared; one chunk of logits "
               f"has {min(chunk, N) * V}",
               hint="compute hidden[i:i + chunk_size] @ weight.T inside the loop, never "
                    "hidden @ weight.T")
    _check_chunked_memory(fn)


def _check_chunked_memory(fn) -> None:
    """Full logits of 256 MiB, a chunk's 4 MiB: ``fn``'s process must grow by under half the full
    logits, watched from outside (:func:`course_lib.grading.observe_peak`)."""
    g = torch.Generator().manual_seed(4)
    N, h, V, chunk = 4096, 8, 16384, 64
    hidden = torch.randn(N, h, generator=g)
    weight = torch.randn(V, h, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::7] = -100
    kept = targets != -100
    total = sum(F.cross_entropy(hidden[i:i + chunk] @ weight.T, targets[i:i + chunk],
                                reduction="sum").double() for i in range(0, N, chunk))
    truth = total / kept.sum()
    run, grown = observe_peak(_chunked_run, fn, hidden, weight, targets, chunk)
    case = f"chunk_size={chunk}, {N} tokens, a vocabulary of {V}, fp32"
    got = torch.as_tensor(run["loss"], dtype=torch.float64)
    expect(got.numel() == 1 and torch.allclose(got, truth, rtol=1e-4, atol=1e-5),
           f"{case}: got {got.flatten()[:1].tolist()}, expected {truth.item():.6f}",
           hint="sum the per-token losses over every chunk, then divide once by the number of "
                "targets that are not -100")
    full, one = N * V * 4, chunk * V * 4
    if grown is None:
        expect(not os.path.exists("/proc/self/clear_refs"),  # no peak to read off this OS
               f"{case}: the memory of the process running your code could not be watched "
               "throughout the call",
               hint="do not change how your process can be inspected, nor stop other processes")
        return
    expect(grown < full // 2, f"{case}: the process running your code grew by "
           f"{grown / 2**20:.0f} MiB; the full logits take {full / 2**20:.0f} MiB, one chunk "
           f"{one / 2**20:.0f} MiB", hint="compute hidden[i:i + chunk_size] @ weight.T inside "
           "the loop, never hidden @ weight.T, and keep no chunk's logits past its turn")


#: ``(numel, bits, bytes of m and v)``: torchao's block-wise quantized AdamW states (8-bit: blocks
#: of 256, a 256-entry map; 4-bit: 128, 16; under 4096 elements or not divided: fp32).
QUANTIZED_CASES = [(4096, 8, 10368), (4096, 4, 4480), (1 << 20, 8, 2131968),
                   (1 << 20, 4, 1114240), (100, 8, 800), (4095 * 256, 4, 1113968),
                   (2048, 4, 16384), (4100, 8, 32800), (768 * 2304, 8, 3596288),
                   (50257 * 768, 4, 41009840), (12800, 8, 28048)]
_LOW_BIT = {8: (256, 256), 4: (128, 16)}  # block and map sizes, for the hint


@grader
def check_quantized_state_bytes(fn):
    """``fn(numel, bits)``: bytes of AdamW's ``m`` and ``v`` for one fp32 parameter tensor."""
    for numel, bits, truth in QUANTIZED_CASES:
        block, qmap = _LOW_BIT[bits]
        why = ("left in fp32 (fewer than 4096 elements, or the block does not divide them)"
               if truth == 8 * numel else
               "quantized: codes, one fp32 scale per block, one fp32 map, for m and for v")
        got = fn(numel, bits)
        expect(exactly(got, truth), f"quantized_state_bytes({numel}, {bits}) = {got!r}, expected "
               f"{truth} ({why})",
               hint=f"{bits}-bit: {bits}/8 byte per element, 4 bytes per block of {block}, "
                    f"{qmap} fp32 map entries; two states; small tensors stay at 4 bytes each")


#: ``(name, bytes saved, time paid)`` cases of :func:`check_rank_levers`, without ties inside a
#: band; the first is lecture 08's GPT-2 small on a T4 (MiB, rounded).
_LADDER_CASES = [
    [("precision", 9073, -0.875), ("accumulation", 35850, 0.0), ("4-bit states", 822, 0.0),
     ("chunked loss", 18401, 0.088), ("selective", 6932, 0.043), ("offload optimizer", 949, 0.007),
     ("blocks/1", 17306, 0.173), ("offload activations", 18452, 0.376),
     ("in backward", 0, 0.0)],
    [("slow but large", 1000, 0.5), ("fast and small", 100, 0.01), ("free", 10, 0.0),
     ("adds bytes", -50, -0.2), ("saves nothing", 0, 0.3), ("faster", 5, -0.1)],
    [("b", 300, 0.3), ("a", 200, 0.1), ("c", 100, 0.2), ("d", 0, 0.0), ("e", 400, 0.0)],
]


#: The fit ladder's order of each of :data:`_LADDER_CASES` (lecture 08, section 6).
LADDER_ANSWERS = [
    ["precision", "accumulation", "4-bit states", "chunked loss", "selective",
     "offload optimizer", "blocks/1", "offload activations", "in backward"],
    ["faster", "free", "fast and small", "slow but large", "adds bytes", "saves nothing"],
    ["e", "a", "b", "c", "d"],
]


@grader
def check_rank_levers(fn):
    """``fn(levers)``: lever names in the fit ladder's order, best first."""
    for case, truth in zip(_LADDER_CASES, LADDER_ANSWERS, strict=True):
        got = fn([tuple(lv) for lv in case])
        expect(isinstance(got, list | tuple) and exactly(got, truth),
               f"for {[name for name, _, _ in case]} you gave {got!r}, expected {truth}",
               hint="three bands: levers that save bytes at no time (most time gained, then most "
                    "bytes), then those that cost time (bytes_saved / time_paid, largest first), "
                    "then those that save nothing, in the order given")
