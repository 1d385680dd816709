"""The truths the grading checks carry written out, against real tensors and published figures:
lecture 01's bytes per parameter against real optimizer steps and its ZeRO formulas against the
paper's figures and a brute-force search, lecture 02's and 04's measured steps measured again."""

from fractions import Fraction

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

from course_lib.device import GPUS
from course_lib.grading import lecture01, lecture02, lecture04
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


@pytest.mark.parametrize("precision", list(lecture01._TABLE))
def test_lecture01_bytes_per_param_are_what_real_steps_keep(precision):
    for optimizer, expected in zip(lecture01._OPTIMIZERS, lecture01._TABLE[precision]):
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


def test_the_grader_table_is_the_check_table():
    assert hidden.TABLE == lecture01._TABLE and hidden.OPTIMIZERS == lecture01._OPTIMIZERS


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


@pytest.mark.parametrize("key", list(lecture02.SMALL_STEP_BYTES))
def test_lecture02_small_steps_are_measured(key):
    precision, seq_len = key
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    written = lecture02.SMALL_STEP_BYTES[key]
    measured = tuple(_steady_step_bytes(lecture02.SMALL, b, dtype, seq_len)
                     for b in range(1, len(written) + 1))
    assert measured == written
    assert list(written) == sorted(set(written))  # more sequences, more bytes


def test_lecture02_measured_cases_lie_inside_the_table():
    truths = []
    for s, capacity, precision, truth in lecture02._measured_cases():
        table = lecture02.SMALL_STEP_BYTES[(precision, s)]
        assert capacity < table[-1]  # the table goes past the answer
        assert truth == 0 or table[truth - 1] <= capacity < table[truth]
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
    assert measured == lecture04.SEGMENT_COSTS
