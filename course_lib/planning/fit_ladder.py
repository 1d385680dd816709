"""08: the fit ladder: every lever of the course for one model and one GPU, ranked.

Each lever replaces one field of the plain :class:`~course_lib.prediction.step.Step`;
:func:`~course_lib.prediction.predict.predict` gives its peak bytes and time (datasheet figures).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig
from course_lib.planning.fit import FIT_POLICIES
from course_lib.prediction import time_model
from course_lib.prediction.engine import StepMemory
from course_lib.prediction.formulas import MAX_WORLD_SIZE, mixed_precision_for
from course_lib.prediction.predict import Step, predict
from course_lib.training import checkpointing as ckpt
from course_lib.units import format_bytes
from course_lib.validation import MAX_BATCH, MAX_BYTES, MAX_COUNT, choice, number, positive_int

#: Groups that change the job rather than how it runs: LoRA trains other parameters, ZeRO
#: needs more GPUs. The ladder tries them last.
JOB_CHANGING = ("LoRA", "ZeRO")


@dataclass(frozen=True)
class _Rung:
    """One lever alone on the plain step: its peak moment, the peak bytes it saves and the time
    it adds (a fraction of the plain step's), and how ("engine", or "engine + formula")."""

    lever: str
    group: str
    step: Step
    memory: StepMemory
    bytes_saved: int
    time_paid: float
    how: str

    @property
    def bytes_per_time(self) -> float:
        """Bytes saved per plain step's time paid; inf for a lever that costs no time."""
        return self.bytes_saved / self.time_paid if self.time_paid > 0 else math.inf


@dataclass(frozen=True)
class Ladder:
    """What :func:`ladder` found: ``rungs``, every lever alone, best first (``listed``: in the
    course's order); ``climb``, the combination lever by lever, ``(lever, StepMemory, time paid
    so far)``; ``step``, the combination, and whether it ``fits`` ``budget_bytes``."""

    config: GPTConfig
    gpu: str
    budget_bytes: int
    batch_size: int
    seq_len: int
    baseline: StepMemory
    rungs: tuple
    climb: tuple
    step: Step
    fits: bool
    listed: tuple = ()

    @property
    def memory(self) -> StepMemory:
        """The predicted peak of the combination."""
        return self.climb[-1][1] if self.climb else self.baseline

    def table(self) -> str:
        """The rungs in rank order: bytes saved, time paid, bytes saved per +1 % of time."""
        w = max(len(r.lever) for r in self.rungs)
        lines = [f"{'lever':{w}s} {'saves':>10s} {'time':>7s} {'per +1 %':>10s} {'peak':>10s}"
                 "  how"]
        for r in self.rungs:
            per = ("-" if r.bytes_saved <= 0 else "free" if r.bytes_per_time == math.inf
                   else format_bytes(r.bytes_per_time / 100))
            lines.append(f"{r.lever:{w}s} {format_bytes(r.bytes_saved):>10s} "
                         f"{r.time_paid:>+7.1%} {per:>10s} {format_bytes(r.memory.total):>10s}"
                         f"  {r.how}")
        return "\n".join(lines)


def _levers(plain: Step, loss_chunk: int, lora_rank: int, world_size: int) -> list:
    """``(lever, group, fields it replaces)`` for every rung, in the course's order."""
    half = mixed_precision_for(plain.gpu)
    out = [(f"precision {half}", "precision", dict(precision=half))]
    if plain.batch_size > 1:
        out.append(("accumulation: 1 sequence per micro-batch", "accumulation",
                    dict(micro_batch_size=1, accumulation_steps=plain.batch_size)))
    out += [(f"checkpointing {ckpt.policy_label(mode, every)}", "checkpointing",
             dict(mode=mode, every=every)) for mode, every in FIT_POLICIES[1:]]
    out += [(f"chunked loss ({loss_chunk} tokens)", "chunked loss", dict(loss_chunk=loss_chunk)),
            ("optimizer step in backward", "optimizer in backward", dict(in_backward=True)),
            ("8-bit AdamW states", "optimizer states", dict(state_bits=8)),
            ("4-bit AdamW states", "optimizer states", dict(state_bits=4)),
            ("offload activations (save_on_cpu)", "offload activations",
             dict(offload_activations=True)),
            ("offload optimizer states", "offload optimizer", dict(offload_optimizer=True)),
            (f"LoRA rank {lora_rank} (base frozen)", "LoRA", dict(lora_rank=lora_rank))]
    out += [(f"ZeRO-{z} on {world_size} GPUs", "ZeRO", dict(zero_stage=z, world_size=world_size))
            for z in (1, 2, 3)]
    return out


_ENGINE_GROUPS = ("precision", "accumulation", "checkpointing", "chunked loss")


def _rank_key(rung: _Rung) -> tuple:
    """Free levers (most time gained, then most bytes), then bytes saved per time paid, then
    those that save nothing; the same again for :data:`JOB_CHANGING` levers, after the rest."""
    free = round(rung.time_paid, 6) <= 0  # rounded: float noise around 0 is no time paid
    return (rung.group in JOB_CHANGING, rung.bytes_saved <= 0, not free,
            round(rung.time_paid, 6) if free else -rung.bytes_per_time, -rung.bytes_saved)


def ladder(config: GPTConfig, gpu: str, *, batch_size: int = 8, seq_len: int | None = None,
           budget_bytes: int | None = None, loss_chunk: int = 1024, lora_rank: int | None = None,
           world_size: int = 8, utilization: float | None = None) -> Ladder:
    """Every lever of the course for training ``config`` on ``gpu``, ranked, and the mix that fits.

    The plain step is fp32 AdamW on the whole batch at once, nothing checkpointed, offloaded or
    sharded: the baseline of every saving and price. Each lever alone is the plain step with a
    field replaced, ranked by bytes saved per time paid, free levers first and
    :data:`JOB_CHANGING` levers last (``rungs`` is in that order). The combination
    adds them in that order, each only if it lowers the predicted peak, until the step fits
    ``budget_bytes`` (default the GPU's :attr:`~course_lib.device.GPU.capacity`). ``lora_rank``
    defaults to 16 (at most ``d_model``); ``world_size`` is the ZeRO rungs' GPUs;
    ``utilization``, the share of the GPU's peak FLOP/s (None: the time model's figure).
    Args:
        config (GPTConfig): the model.
        gpu (str): a name of :data:`~course_lib.device.GPUS`.
        batch_size, loss_chunk, world_size (int): sequences, tokens per loss chunk, ZeRO's GPUs.
        seq_len, budget_bytes, lora_rank (int, optional): None: the config's, the GPU's, 16.
        utilization (float, optional): the share of the GPU's peak FLOP/s.
    Returns:
        Ladder: the rungs, ranked, the climb and the combination.
    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    choice("gpu", gpu, tuple(GPUS))
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    plain = Step(config, batch_size, seq_len=seq_len, gpu=gpu)
    budget = GPUS[gpu].capacity if budget_bytes is None else positive_int(
        "budget_bytes", budget_bytes, maximum=MAX_BYTES)
    loss_chunk = positive_int("loss_chunk", loss_chunk, maximum=MAX_COUNT)
    lora_rank = min(16, config.d_model) if lora_rank is None else positive_int(
        "lora_rank", lora_rank, maximum=config.d_model)
    world_size = positive_int("world_size", world_size, maximum=MAX_WORLD_SIZE)
    speed = None if utilization is None else replace(
        time_model.device_speed(plain.gpu),
        utilisation=number("utilization", utilization, above=0.0, maximum=1.0))
    return _ladder(plain, budget, loss_chunk, lora_rank, world_size, speed)


@functools.lru_cache(maxsize=256)
def _ladder(plain: Step, budget: int, loss_chunk: int, lora_rank: int, world_size: int,
            speed: time_model.DeviceSpeed | None) -> Ladder:
    """:func:`ladder` of checked arguments, cached: a widget asks again for settings seen."""
    base = predict(plain, speed)
    rungs, fields = [], {}
    for lever, group, change in _levers(plain, loss_chunk, lora_rank, world_size):
        p = predict(replace(plain, **change), speed)
        fields[lever] = change
        rungs.append(_Rung(lever, group, p.step, p.peak, base.total - p.total,
                           p.seconds / base.seconds - 1,
                           "engine" if group in _ENGINE_GROUPS else "engine + formula"))
    listed = tuple(rungs)
    rungs.sort(key=_rank_key)

    current, climbed = base, []
    for rung in rungs:
        if current.total <= budget:
            break
        try:
            trial = predict(replace(current.step, **fields[rung.lever]), speed)
        except ValueError:  # a pair that does not run (optimizer in backward with accumulation)
            continue
        if trial.total < current.total:
            current = trial
            climbed.append((rung.lever, trial.peak, trial.seconds / base.seconds - 1))
    return Ladder(plain.config, plain.gpu.name, budget, plain.batch_size, plain.seq_len,
                  base.peak, tuple(rungs), tuple(climbed), current.step, current.total <= budget,
                  listed)

