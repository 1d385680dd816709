"""The truths of the grading checks, against real tensors and published figures: lecture 01's
bytes per parameter against real optimizer steps and its ZeRO formulas against the paper's
figures and a brute-force search, lecture 02's and 04's measured steps measured again; the
answers the public cases carry written out against the grader's truths (``course_tools/hidden.py``),
and those truths absent from the installed package."""

import importlib
import pkgutil
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn as nn
from notebook_tools import SOLUTIONS, check_calls, definitions
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

import course_lib
from course_lib import grading
from course_lib.device import GPUS
from course_lib.grading import (
    lecture00,
    lecture01,
    lecture02,
    lecture04,
    lecture05,
    lecture06,
    lecture07,
    lecture08,
)
from course_lib.measurement.memory import peak_memory
from course_lib.model.gpt import GPT, random_tokens
from course_lib.units import storage_bytes
from course_tools import hidden

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- lecture 01

_OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
               "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
               "adam": lambda ps: torch.optim.Adam(ps), "adamw": lambda ps: torch.optim.AdamW(ps)}
_DTYPES = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False),
           "bf16-mixed": (torch.bfloat16, True), "fp16-mixed": (torch.float16, True)}


def _measured_bytes_per_param(optimizer: str, precision: str) -> Fraction:
    """Storage bytes of weights, gradients, master copies and optimizer state after a real step,
    per parameter (the optimizers' 0-d ``step`` counters left out: one per tensor, not per
    parameter). Mixed precision by hand: a 16-bit model, fp32 copies the optimizer updates."""
    dtype, mixed = _DTYPES[precision]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 8)).to(dtype)
    master = [p.detach().float().requires_grad_() for p in model.parameters()] if mixed else []
    opt = _OPTIMIZERS[optimizer](master or list(model.parameters()))
    model(torch.randn(5, 12, dtype=dtype)).float().square().mean().backward()
    for p16, p32 in zip(model.parameters(), master):
        p32.grad = p16.grad.float()
    opt.step()
    for p32 in master:  # the fp32 gradients are the step's scratch, not a state
        p32.grad = None
    params = list(model.parameters())
    states = [v for s in opt.state.values() for k, v in s.items()
              if isinstance(v, torch.Tensor) and k != "step"]
    kept = storage_bytes(params + [p.grad for p in params] + master + states)
    return Fraction(kept, sum(p.numel() for p in params))


@pytest.mark.parametrize("precision", list(hidden.TABLE))
def test_lecture01_bytes_per_param_are_what_real_steps_keep(precision):
    for optimizer, expected in zip(hidden.OPTIMIZERS, hidden.TABLE[precision]):
        assert _measured_bytes_per_param(optimizer, precision) == expected, optimizer


@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_lecture01_zero_formulas_give_the_papers_figure(stage, gb):
    """ZeRO paper, Figure 1: Psi = 7.5B parameters on N_d = 64 GPUs, K = 12."""
    a, b = hidden.ZERO[stage]
    assert round((a * 7_500_000_000 + b * 7_500_000_000 / 64) / 10**9, 1) == gb


def _fewest_by_trying(P: int, capacity: int, stage: int, most: int = 10**5) -> int | None:
    """The first N of 1, 2, ... with a*P + b*P/N <= capacity (times N: exact integers)."""
    a, b = hidden.ZERO[stage]
    return next((N for N in range(1, most) if (a * P - capacity) * N + b * P <= 0), None)


def test_lecture01_fewest_gpus_is_the_first_count_that_fits():
    a100_80, a100_40, t4 = (GPUS[n].total_memory for n in ("A100 80GB", "A100 40GB", "T4"))
    cases = [(68_976_648_192, a100_80), (6_738_415_616, a100_40), (1_235_814_400, t4),
             (7_500_000_000, 31_406_250_000), (7_500_000_000, 31_406_249_999),
             (7_500_000_000, 1_875_000_000), (1_000, 16_000), (1_000, 15_999), (999, 3_997)]
    for P, capacity in cases:
        for stage in range(4):
            assert hidden.fewest_gpus(P, capacity, stage) == _fewest_by_trying(
                P, capacity, stage), (P, capacity, stage)


def test_lecture01_written_out_answers_are_the_formulas():
    """The public cases' answers in course_lib (no formula there) are the grader's formulas'."""
    for P, stage, N, truth in lecture01.ZERO_CASES:
        a, b = hidden.ZERO[stage]
        assert truth == a * P + b * P // N, (P, stage, N)
    for P, card, stage, truth in lecture01.GPUS_CASES:
        capacity = GPUS[card].total_memory if isinstance(card, str) else card
        assert truth == hidden.fewest_gpus(P, capacity, stage) == _fewest_by_trying(
            P, capacity, stage), (P, card, stage)


def test_lecture01_public_recipes_are_the_table_less_the_held_back_ones():
    public = {(o, p): truth for o, p, truth in lecture01.BYTES_CASES}
    assert public == {(o, p): hidden.bytes_per_param(o, p) for p in hidden.TABLE
                      for o in hidden.OPTIMIZERS if (o, p) not in hidden.BYTES_HELD_BACK}
    assert len(public) + len(hidden.BYTES_HELD_BACK) == 16
    for card, optimizer, precision, truth in lecture01.LARGEST_CASES:
        capacity = GPUS[card].total_memory if isinstance(card, str) else card
        assert truth == capacity // hidden.bytes_per_param(optimizer, precision)
        assert truth * hidden.bytes_per_param(optimizer, precision) <= capacity


def test_lecture00_public_dtypes_are_the_rule_less_the_held_back_inputs():
    assert torch.bfloat16 == course_lib.device.pick_dtype(GPUS["A100 80GB"])
    assert torch.float16 == course_lib.device.pick_dtype(GPUS["T4"])
    public = {(d, b): truth for d, b, truth in lecture00.DTYPE_CASES}
    domain = {(d, b) for d in ("cpu", "cuda", "mps") for b in (False, True)}
    assert set(public) == domain - set(hidden.DTYPE_HELD_BACK)
    assert all(truth == hidden.training_dtype(*key) for key, truth in public.items())
    assert hidden.training_dtype("cuda", False) == course_lib.device.pick_dtype(GPUS["T4"])


# --------------------------------------------------------------------------- lecture 02

def _steady_step_bytes(config, batch: int, dtype: torch.dtype, seq_len: int) -> int:
    """Bytes live at the peak of a steady-state step: held before it, plus its own peak."""
    torch.manual_seed(0)
    model = GPT(config).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x, y = (t.clone() for t in random_tokens(config, batch, seq_len))

    def step():
        loss = model(x, y)[1]  # alive until the step ends, as in course_lib.training.loop.train
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW creates m and v in its first step
    held = storage_bytes([*model.parameters(),
                           *(v for s in opt.state.values() for v in s.values())])
    return held + peak_memory(step, device="cpu")


@pytest.mark.parametrize("key", list(hidden.SMALL_STEP_BYTES))
def test_lecture02_small_steps_are_measured(key):
    precision, seq_len = key
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    written = hidden.SMALL_STEP_BYTES[key]
    measured = tuple(_steady_step_bytes(lecture02.SMALL, b, dtype, seq_len)
                     for b in range(1, len(written) + 1))
    assert measured == written
    assert list(written) == sorted(set(written))  # more sequences, more bytes


def test_lecture02_measured_cases_lie_inside_the_table():
    truths = []
    for s, capacity, precision, truth in lecture02.MEASURED_CASES:
        table = hidden.SMALL_STEP_BYTES[(precision, s)]
        assert capacity < table[-1]  # the table goes past the answer
        assert truth == 0 or table[truth - 1] <= capacity < table[truth]
        assert truth == hidden.measured_largest_batch(precision, s, capacity)
        truths.append(truth)
    assert truths == [11, 6, 0]


# --------------------------------------------------------------------------- lecture 04

def test_lecture04_segment_costs_are_measured():
    config, batch = lecture04.SEGMENTS_CONFIG, lecture04.SEGMENTS_BATCH
    torch.manual_seed(0)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x, y = (t.clone() for t in random_tokens(config, batch))

    def step():
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    held = storage_bytes([*model.parameters(),
                           *(v for s in opt.state.values() for v in s.values())])
    measured = {}
    for k in range(1, config.n_layers + 1):
        model.run_blocks = lambda h, k=k: checkpoint_sequential(model.blocks, k, h,
                                                                use_reentrant=False)
        peak = held + peak_memory(step, device="cpu")
        with FlopCounterMode(display=False) as counter:
            model(x, y)[1].backward()
        model.zero_grad(set_to_none=True)
        measured[k] = (peak, counter.get_total_flops())
    assert measured == hidden.SEGMENT_COSTS


def test_lecture04_public_budgets_answer_as_the_measured_costs():
    for budget, truth in lecture04.SEGMENT_CASES:
        assert truth == hidden.cheapest_segments(budget), budget
    peaks = sorted(nbytes for nbytes, _ in hidden.SEGMENT_COSTS.values())
    assert lecture04.SEGMENT_CASES[0][0] == peaks[0] - 1  # below every measured peak


# --------------------------------------------------------------------------- lectures 05 to 08

def test_lecture05_written_out_answers_are_the_graders():
    assert lecture05.EVERY_ANSWERS == [hidden.largest_every(*case)
                                       for case in lecture05._every_cases()]
    assert lecture05.FRONT_ANSWERS == [[p[2] for p in hidden.front(points)]
                                       for points in lecture05._front_cases()]


def test_lecture05_every_peak_is_what_checkpointing_keeps():
    """Chen et al.'s model, counted block by block: k=1 keeps every input and rebuilds the last
    block; k=n keeps the first block's input only; k=n-1 checkpoints the last block too, and its
    rebuild costs what checkpointing it saved (lecture 05 measures both to the byte)."""
    n, block, inp, fixed = 6, 100, 10, 50
    assert hidden.every_peak(n, 1, block, inp, fixed) == fixed + n * inp + block - inp
    assert hidden.every_peak(n, n, block, inp, fixed) == fixed + (n - 1) * block + inp
    assert hidden.every_peak(n, n - 1, block, inp, fixed) == hidden.every_peak(n, n, block, inp,
                                                                               fixed)
    assert hidden.every_peak(n, 2, block, inp, fixed) == fixed + 3 * block + 3 * inp


def test_lecture06_written_out_answers_are_the_graders():
    for *case, truth in lecture06.STEP_PEAK_CASES:
        assert truth == hidden.phases_peak(*case)
    for base, per, budget, effective, truth in lecture06.MICRO_BATCH_CASES:
        assert truth == hidden.best_micro_batch(lecture06._quadratic(base, per), budget,
                                                effective)


def test_lecture07_written_out_answers_are_the_graders_and_torch_chunks():
    for *case, truth in lecture07.PLAN_CASES:
        assert truth == hidden.ddp_plan(*case)
    for shape, N, truth in lecture07.NUMEL_CASES:
        chunks = torch.empty(shape, device="meta").chunk(N, dim=0)
        assert truth == hidden.fsdp_numels(shape, N) == [c.numel() for c in chunks] + [0] * (
            N - len(chunks))
    rng = random.Random(0)
    for _ in range(200):  # the grader's rule is torch.chunk's on drawn shapes too
        shape, N = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3))), rng.randint(1, 9)
        chunks = torch.empty(shape, device="meta").chunk(N, dim=0)
        assert hidden.fsdp_numels(shape, N) == [c.numel() for c in chunks] + [0] * (
            N - len(chunks))


def test_lecture08_written_out_answers_are_the_graders():
    for numel, bits, truth in lecture08.QUANTIZED_CASES:
        assert truth == hidden.quantized_bytes(numel, bits)
    assert lecture08.LADDER_ANSWERS == [hidden.ladder_order(c) for c in lecture08._LADDER_CASES]


# --------------------------------------------------------------------------- not installed

#: The grader's truths, by the names they had in the installed package and have in hidden.py.
_TRUTH_NAMES = {"_TABLE", "_OPTIMIZERS", "_fits", "_ZERO", "_fewest_gpus", "_peak", "_front",
                "_phases_peak", "_ladder_order", "_chunk_numels", "_measured_cases",
                "SMALL_STEP_BYTES", "SEGMENT_COSTS", "TABLE", "ZERO", "LOW_BIT",
                *(name for name, value in vars(hidden).items()
                  if callable(value) and getattr(value, "__module__", "") == hidden.__name__
                  and not name.startswith("_"))}


def test_the_truths_are_not_in_the_installed_package():
    """A learner's code can import all of ``course_lib``: no module of it holds a truth of the
    grader's (by name), a table of its measured bytes, or a function that computes one."""
    assert {"bytes_per_param", "front", "ladder_order", "phases_peak"} <= _TRUTH_NAMES
    modules = [course_lib] + [importlib.import_module(info.name) for info in pkgutil.walk_packages(
        course_lib.__path__, "course_lib.")]
    measured = set(hidden.SEGMENT_COSTS.values()) | set(hidden.SMALL_STEP_BYTES.values())
    for module in modules:
        names = set(vars(module))
        if module.__name__.startswith("course_lib.grading"):
            assert not names & _TRUTH_NAMES, (module.__name__, names & _TRUTH_NAMES)
        for name, value in vars(module).items():
            assert not (isinstance(value, dict) and any(
                isinstance(v, tuple) and v in measured for v in value.values())), (
                module.__name__, name)
            assert getattr(value, "__module__", None) != hidden.__name__, (module.__name__, name)


# --------------------------------------------------------------------------- every check


class _EqualToAll:
    """An answer that says it equals whatever it is compared with."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


def _liar(*args, **kwargs):
    return _EqualToAll()


_CALLS = sorted({(name, len(args)) for path in SOLUTIONS for name, args in check_calls(path)})


@pytest.mark.parametrize("check,n_args", _CALLS, ids=[c for c, _ in _CALLS])
def test_no_check_takes_an_answer_that_equals_everything(check, n_args):
    """A check compares a learner's answer by its value (``grading.exactly``), never by the
    answer's own ``__eq__``: nor do the grader's drawn cases."""
    liars = [_liar] * n_args
    assert not grading.CHECKS[check](*liars, quiet=True)
    draw = hidden.CASES.get(check.removeprefix("check_"))
    if draw is not None:
        with pytest.raises(grading.CheckFailed):
            draw(*liars, random.Random(0))


@pytest.mark.parametrize("got,truth,same", [
    (torch.tensor(float("inf"), dtype=torch.float16), 70_000, False),
    (torch.tensor(float("nan")), 3, False), (float("nan"), float("nan"), False),
    (torch.tensor(24), 24, True), (torch.tensor([24.0]), 24, True), (24.0, 24, True),
    (np.int64(24), 24, True), (np.array([[7]]), 7, True), (True, 1, False),
    (torch.tensor(2, dtype=torch.float16), 2.0, True), ("2", 2, False),
    (torch.tensor(1.3, dtype=torch.float16), 1.3, False), ([np.str_("bn")], ["bn"], True),
    ((1, 2.5, "a"), [1, 2.5, "a"], True), ([1, 2], (1, 2, 3), False),
    (torch.float32, torch.float, True), (_EqualToAll(), None, False), (None, None, True),
    (_EqualToAll(), torch.float32, False), (_EqualToAll(), "bn", False),
])
def test_answers_are_compared_by_their_exact_value(got, truth, same):
    assert grading.exactly(got, truth) is same


_SOLVED = [(path, name, args) for path in SOLUTIONS for name, args in check_calls(path)]


@pytest.mark.parametrize("path,check,args", _SOLVED, ids=[c for _, c, _ in _SOLVED])
def test_a_check_leaves_the_notebooks_random_state_as_it_was(path, check, args):
    """A check seeds what it builds, and the learner's code may draw too: the notebook's random
    state is the same after the check as before it."""
    solution = definitions(path)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    assert grading.CHECKS[check](*[solution[a] for a in args], quiet=True)
    assert torch.equal(torch.get_rng_state(), before)
