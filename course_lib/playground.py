"""03: the accumulation playground's back end: short, real, measured training runs.

:class:`Playground` trains a fresh course GPT (same seed, same data) for a
fixed budget of samples with a given micro-batch size ``b``, number of
accumulation steps ``K`` and per-block activation checkpointing on or off, and
reports the effective batch ``b*K``, the optimizer steps ``samples // (b*K)``,
the loss curve, and the peak memory of a training step, predicted and measured.
Runs are cached by their settings, so a widget can redraw instantly and train
only when asked.

Memory, in bytes, of one steady-state step (the optimizer state exists):

* measured: the bytes resident before the step (weights and AdamW's ``m``, ``v``)
  plus :func:`course_lib.measure.peak_memory` of the step (``K`` forward and
  backward passes, ``optimizer.step()``, ``zero_grad``);
* predicted: the memory engine's ``total``
  (:func:`course_lib.engine.predict_step_memory`, fp32, for the playground's
  device). From ``K = 2`` on the whole gradient is alive during every backward
  pass, so the prediction (an upper bound there) does not change with ``K``: that
  is the claim under test; ``K = 1`` peaks lower, before the gradient is whole.

Checkpointing uses :func:`course_lib.checkpointing.enable_checkpointing`
(``mode="blocks"``: ``torch.utils.checkpoint`` around every block).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .checkpointing import ALL_MODES, enable_checkpointing, step_flops
from .device import GPU, GPUS, MAX_BANDWIDTH, MAX_FLOPS, resolve_gpu
from .engine import StepMemory, precision_of, predict_step_memory
from .kernels import attention_kernel
from .measure import peak_memory, resident_bytes
from .models import GPT, MAX_SEED, GPTConfig, check_batch, check_config, gpt_param_count
from .step_setup import build, measure_step_memory, train_options
from .timing import CLOCKS, MAX_RUNS, step_times
from .toy_data import markov_tokens
from .training import batches_of, make_grad_scaler, train
from .units import dtype_bytes
from .validation import (
    MAX_BATCH,
    MAX_COUNT,
    boolean,
    choice,
    function,
    integer,
    number,
    positive_int,
)
from .validation import available_device as as_device

#: The most samples a playground trains on, and the largest micro-batch and accumulation
#: steps it takes (each at most :data:`course_lib.validation.MAX_BATCH`).
MAX_SAMPLES = MAX_BATCH
#: The largest ``matmul_size`` :func:`measure_device_speed` times: 16384 (1 GiB in fp32).
MAX_MATMUL = 16384


def effective_batch(micro_batch_size: int, accumulation_steps: int) -> int:
    """Samples per optimizer step: ``micro_batch_size * accumulation_steps``.

    Args:
        micro_batch_size (int): from 1 to :data:`course_lib.validation.MAX_BATCH`.
        accumulation_steps (int): from 1 to :data:`course_lib.validation.MAX_BATCH`.

    Returns:
        int: the product.

    Raises:
        ValueError: naming the parameter, for anything but an int (not a bool) in range.
    """
    return positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH) * positive_int(
        "accumulation_steps", accumulation_steps, maximum=MAX_BATCH)


def optimizer_steps(samples: int, micro_batch_size: int, accumulation_steps: int) -> int:
    """Optimizer steps in a budget of ``samples``: ``samples // (micro_batch_size * accumulation_steps)``.

    Args:
        samples (int): from 1 to :data:`MAX_SAMPLES`.
        micro_batch_size (int): as :func:`effective_batch`.
        accumulation_steps (int): as :func:`effective_batch`.

    Returns:
        int: the steps (0 when the effective batch exceeds ``samples``).

    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    samples = positive_int("samples", samples, maximum=MAX_SAMPLES)
    return samples // effective_batch(micro_batch_size, accumulation_steps)


def step_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, *,
                log=None, **train_kwargs) -> int:
    """Bytes of one training step on ``batch`` (an ``(inputs, targets)`` pair): resident plus peak.

    :func:`resident_bytes` before the step (weights and whatever optimizer state
    exists) plus :func:`course_lib.measure.peak_memory` of
    ``course_lib.training.train(model, optimizer, [batch], **train_kwargs)``.
    Run one step first for the steady state (AdamW creates ``m`` and ``v`` in
    its first step).

    Args:
        model (torch.nn.Module): the model.
        optimizer (torch.optim.Optimizer): its optimizer.
        batch (tuple): ``(inputs, targets)`` tensors.
        log (TrainLog, optional): a ``TrainLog`` the step is appended to.
        **train_kwargs: :func:`course_lib.training.train`'s (``micro_batch_size`` is required).

    Returns:
        int: bytes.

    Raises:
        ValueError: naming ``model`` (not an ``nn.Module``), ``optimizer`` (no ``step``) or
            ``batch`` (not a pair of tensors).
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(getattr(optimizer, "step", None)):
        raise ValueError(f"optimizer must be an optimizer (with step()), got "
                         f"{type(optimizer).__name__}")
    if not (isinstance(batch, tuple | list) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ValueError(f"batch must be an (inputs, targets) pair of tensors, got "
                         f"{type(batch).__name__}")
    check_batch(model, *batch, names=("batch's inputs", "batch's targets"))
    resident = resident_bytes(model, optimizer)
    return resident + peak_memory(lambda: train(model, optimizer, [batch], log=log, **train_kwargs))


@dataclass(frozen=True)
class Run:
    """One cached playground run; memory in bytes.

    Attributes:
        micro_batch_size (int): sequences per forward and backward pass.
        accumulation_steps (int): micro-batches per optimizer step.
        checkpointing (bool): every block checkpointed (``mode="blocks"``).
        effective_batch (int): ``micro_batch_size * accumulation_steps``.
        optimizer_steps (int): steps the run's sample budget bought.
        measured_peak (int): bytes of the second (steady-state) step, measured
            (:func:`step_memory`).
        predicted_peak (int): the engine's bytes for the same step.
        samples_seen (tuple of int): samples trained on after each optimizer step.
        losses (tuple of float): the loss of each optimizer step.
    """

    micro_batch_size: int
    accumulation_steps: int
    checkpointing: bool
    effective_batch: int
    optimizer_steps: int
    measured_peak: int
    predicted_peak: int
    samples_seen: tuple[int, ...]
    losses: tuple[float, ...]


class Playground:
    """Short training runs of one GPT ``config`` on :func:`course_lib.toy_data.markov_tokens`.

    Args:
        config (GPTConfig, optional): the model; default a 4-layer GPT of width 32 on 64 tokens
            and sequences of 32.
        samples (int): the training budget of every run (the effective batch sets how
            many optimizer steps it buys), an int from 1 to :data:`MAX_SAMPLES`.
        lr (float): AdamW's learning rate, the same for every run, a finite number > 0.
        seed (int): an int from 0 to :data:`course_lib.models.MAX_SEED`.
        device (str or torch.device): "cpu", "cuda", ...

    Raises:
        ValueError: naming the parameter, for a bad value.
    """

    def __init__(self, config: GPTConfig | None = None, *, samples: int = 384, lr: float = 1e-2,
                 seed: int = 0, device: torch.device | str = "cpu"):
        self.config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=4) \
            if config is None else check_config(config)
        self.samples = positive_int("samples", samples, maximum=MAX_SAMPLES)
        lr = number("lr", lr, above=0.0)
        seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
        self.lr, self.seed, self.device = lr, seed, as_device("device", device)
        self._gpu = resolve_gpu("cuda") if self.device.type == "cuda" else None
        self.data = markov_tokens(samples, self.config.seq_len, self.config.vocab_size,
                                  seed=seed, device=self.device)
        self.cache: dict[tuple[int, int, bool], Run] = {}

    def _model(self, checkpointing: bool) -> tuple[GPT, torch.optim.Optimizer]:
        torch.manual_seed(self.seed)
        model = GPT(self.config).to(self.device)
        if checkpointing:
            enable_checkpointing(model, mode="blocks", every=1)
        # foreach=False: the per-tensor AdamW whose scratch the engine counts (on CUDA the
        # default is the multi-tensor one, which holds a copy of v at once).
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr, foreach=False)

    def predict_peak(self, micro_batch_size: int, accumulation_steps: int,
                     checkpointing: bool = False) -> int:
        """The engine's peak bytes of a steady-state step with these settings (see the module doc).

        Args:
            micro_batch_size (int): sequences per forward and backward pass.
            accumulation_steps (int): micro-batches per optimizer step.
            checkpointing (bool): every block checkpointed.

        Returns:
            int: bytes (``predict_step_memory(...).total``).

        Raises:
            ValueError: naming the parameter, for a bad value.
        """
        boolean("checkpointing", checkpointing)
        return predict_step_memory(self.config, micro_batch_size, accumulation_steps,
                                   mode="blocks" if checkpointing else "none",
                                   gpu=self._gpu).total

    def cached(self, micro_batch_size: int, accumulation_steps: int,
               checkpointing: bool = False) -> Run | None:
        """The run with these settings if it has been trained, else None.

        Args:
            micro_batch_size (int): as :func:`effective_batch`.
            accumulation_steps (int): as :func:`effective_batch`.
            checkpointing (bool): every block checkpointed.

        Returns:
            Run or None: the cached run.

        Raises:
            ValueError: naming the parameter, for a bad value.
        """
        effective_batch(micro_batch_size, accumulation_steps)
        boolean("checkpointing", checkpointing)
        return self.cache.get((micro_batch_size, accumulation_steps, checkpointing))

    def run(self, micro_batch_size: int, accumulation_steps: int, checkpointing: bool = False, *,
            on_step: Callable[[int, float], None] | None = None) -> Run:
        """Train (or fetch from the cache) one run with these settings.

        The first optimizer step creates AdamW's state; the second is measured
        (:func:`step_memory`); the rest train on.

        Args:
            micro_batch_size (int): as :func:`effective_batch`.
            accumulation_steps (int): as :func:`effective_batch`.
            checkpointing (bool): every block checkpointed.
            on_step (callable, optional): ``on_step(step, loss)``, called after every optimizer step
                of a new run (a widget shows the progress with it).

        Returns:
            Run: the run, cached under its settings.

        Raises:
            ValueError: naming the parameter, for a bad value, or when the effective batch leaves
                fewer than two optimizer steps in ``samples``.
        """
        b = effective_batch(micro_batch_size, accumulation_steps)
        boolean("checkpointing", checkpointing)
        function("on_step", on_step, optional=True)
        key = (micro_batch_size, accumulation_steps, checkpointing)
        if key in self.cache:
            return self.cache[key]
        steps = optimizer_steps(self.samples, micro_batch_size, accumulation_steps)
        if steps < 2:
            raise ValueError(f"micro_batch_size * accumulation_steps must be at most "
                             f"{self.samples // 2} (two optimizer steps in {self.samples} samples), "
                             f"got {b}")
        model, opt = self._model(checkpointing)
        batches = batches_of(*self.data, b)
        kw = dict(micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
                  on_step=on_step)
        log = train(model, opt, batches[:1], **kw)  # the first step creates AdamW's m and v
        measured = step_memory(model, opt, batches[1], log=log, **kw)
        train(model, opt, batches[2:], log=log, **kw)
        result = Run(micro_batch_size, accumulation_steps, bool(checkpointing), b, steps,
                     measured_peak=measured,
                     predicted_peak=self.predict_peak(*key),
                     samples_seen=tuple(b * (i + 1) for i in range(log.steps)),
                     losses=tuple(log.losses))
        self.cache[key] = result
        return result


# --------------------------------------------------------------------------- the trade-off
#
# One optimizer step's cost at a glance: its peak memory (the engine) and its time (a model,
# below). The widget of lecture 03 § 7 shows both against the plain step, one batch of b * K.

#: The checkpointing choices of the trade-off (``course_lib.checkpointing`` modes whose cost
#: is the same for every block, so that counting the ops of a 1- and 2-layer model suffices).
CHECKPOINTING = ("none", "blocks", "selective", "attention")
#: Fraction of the datasheet's peak FLOP/s that a training step's matmuls reach on a GPU
#: preset. An assumption, not a measurement: model FLOPs utilisation of 46.2 % (PaLM 540B on
#: TPU v4, Chowdhery et al. 2022, "PaLM") and 52 % of the A100's peak (a 175B GPT on 3072
#: A100s, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
#: Using Megatron-LM") are among the best published. On this kernel's device the rate is
#: measured instead (:func:`measure_device_speed`).
UTILISATION = 0.5
#: Seconds each operator costs on a GPU whatever its size. An assumption for the presets, not a
#: measurement: PyTorch's eager dispatch on the CPU plus one kernel launch, which alone costs a
#: few microseconds (NVIDIA, "Getting Started with CUDA Graphs", 2019), of the order of 10
#: microseconds together. :func:`measure_device_speed` measures it on this kernel's device.
OP_SECONDS = 10e-6


@dataclass(frozen=True)
class DeviceSpeed:
    """The four numbers of a device that the time model of :func:`optimizer_step_cost` uses.

    Attributes:
        name (str): the device.
        fp32_flops, fp16_flops, bf16_flops: FLOP/s of matmuls in each dtype (peak for a GPU
            preset, measured on a large matmul for :func:`measure_device_speed`).
        memory_bandwidth (float): bytes/s between the device and its memory.
        op_seconds (float): seconds each operator costs whatever its size (dispatch, launch).
        measured (bool): True when measured on this kernel's device, False for a datasheet.
        source (str): where the figures come from.
        region_seconds (tuple): ``((mode, seconds), ...)``: what ``torch.utils.checkpoint`` costs
            per checkpointed region and micro-batch beyond the operators it reruns (its own Python
            work: saved-tensor hooks, RNG state, a policy's dispatch mode). Measured for this
            device; empty (0) for a datasheet speed, where it is not known.

    Raises:
        ValueError: naming the field: FLOP/s not in (0, 1e18], a bandwidth not in (0, 1e15]
            bytes/s, ``op_seconds`` not in (0, 1], a region's seconds not in [0, 1].
    """

    name: str
    fp32_flops: float
    fp16_flops: float
    bf16_flops: float
    memory_bandwidth: float
    op_seconds: float
    measured: bool
    source: str
    region_seconds: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):  # a speed of 0, NaN or 10**400 would give a time for nonsense
        for name in ("fp32_flops", "fp16_flops", "bf16_flops", "memory_bandwidth", "op_seconds"):
            maximum = {"memory_bandwidth": MAX_BANDWIDTH, "op_seconds": 1.0}.get(name, MAX_FLOPS)
            number(name, getattr(self, name), above=0.0, maximum=maximum)
        if not isinstance(self.region_seconds, tuple) or not all(
                isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)
                and number("region_seconds", r[1], minimum=0.0, maximum=1.0) >= 0
                for r in self.region_seconds):
            raise ValueError(f"region_seconds must be a tuple of (mode, seconds) pairs, got "
                             f"{self.region_seconds!r:.80}")

    def flops(self, dtype: torch.dtype) -> float:
        """FLOP/s of a matmul in ``dtype`` (fp32, fp16 or bf16).

        Args:
            dtype (torch.dtype): ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``.

        Returns:
            float: FLOP/s.
        """
        return {torch.float32: self.fp32_flops, torch.float16: self.fp16_flops,
                torch.bfloat16: self.bf16_flops}[dtype]

    def checkpoint_seconds(self, mode: str) -> float:
        """Seconds per checkpointed region and micro-batch in ``mode`` (0 where unknown).

        Args:
            mode (str): a checkpointing mode of :data:`CHECKPOINTING`.

        Returns:
            float: seconds.
        """
        return dict(self.region_seconds).get(mode, 0.0)


def _preset_of(gpu: GPU) -> GPU | None:
    """The preset whose datasheet a live card shares: same chip in its name, closest memory."""
    chips = [name for name in ("H200", "H100", "A100", "L4", "T4") if name in gpu.name]
    same = [p for p in GPUS.values() if chips and p.name.startswith(chips[0])]
    return min(same, key=lambda p: abs(p.total_memory - gpu.total_memory)) if same else None


def device_speed(gpu, *, op_seconds: float = OP_SECONDS) -> DeviceSpeed:
    """The datasheet :class:`DeviceSpeed` of a GPU.

    A preset name, a :class:`~course_lib.device.GPU` or "cuda" (this kernel's card, matched to
    the preset of the same chip).

    fp16 runs on tensor cores; bf16 too from compute capability 8.0 (a T4 has no bf16 tensor
    cores: its fp32 rate); fp32 at the fp32 rate (PyTorch keeps TF32 off for matmuls unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set).

    Args:
        gpu (str or GPU): a name of :data:`course_lib.device.GPUS`, a ``GPU``, or "cuda".
        op_seconds (float): seconds per operator, in (0, 1] (default :data:`OP_SECONDS`).

    Returns:
        DeviceSpeed: with ``measured=False``.

    Raises:
        ValueError: for the CPU (measure it: :func:`measure_device_speed`), an unknown name,
            a card without datasheet figures and no preset of the same chip, or a bad
            ``op_seconds``.
    """
    card = resolve_gpu(gpu)
    if card is None:
        raise ValueError("gpu must name a GPU: the CPU has no datasheet here, measure it with "
                         "measure_device_speed('cpu')")
    sheet = card if card.tensor_flops else _preset_of(card)
    if sheet is None or not sheet.tensor_flops:
        raise ValueError(f"gpu {card.name!r} has no datasheet speeds and no preset of the same "
                         f"chip among {list(GPUS)}: measure it with measure_device_speed('cuda')")
    op_seconds = number("op_seconds", op_seconds, above=0, maximum=1)
    bf16 = sheet.tensor_flops if card.has_native_bf16 else sheet.fp32_flops
    return DeviceSpeed(card.name, sheet.fp32_flops, sheet.tensor_flops, bf16,
                       sheet.memory_bandwidth, op_seconds, False, sheet.datasheet)


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators that compute (views launch no kernel)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


@functools.lru_cache(maxsize=256)
def _ops(n_layers: int, dropout: bool, attention: str, bias: bool, mode: str,
         precision: str) -> tuple[int, int]:
    """``(per micro-batch, per optimizer step)`` operators of a tiny GPT of this structure."""
    tiny = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=n_layers,
                     dropout=0.1 if dropout else 0.0, attention=attention, bias=bias)
    counts = []
    for K in (1, 2):
        step = _tiny_step(tiny, mode, precision, K, "cpu")
        step()
        with _OpCounter() as counter:  # the second step: the optimizer state exists
            step()
        counts.append(counter.ops)
    per_micro_batch = counts[1] - counts[0]
    return per_micro_batch, counts[0] - per_micro_batch


def _tiny_step(config: GPTConfig, mode: str, precision: str, K: int, device) -> Callable[[], None]:
    """One optimizer step of ``K`` micro-batches of one sequence, as a callable."""
    model, optimizer = build(config, precision=precision, mode=mode, device=device)
    options = train_options(precision, device)
    if options["grad_scaler"] is not None:  # a scale that never overflows: no step skipped
        options["grad_scaler"] = make_grad_scaler(torch.device(device).type, init_scale=1.0)
    x = torch.zeros(K, config.seq_len, dtype=torch.long, device=device)
    return lambda: train(model, optimizer, [(x, x)], micro_batch_size=1, accumulation_steps=K,
                         **options)


def step_ops(config: GPTConfig, checkpointing: str = "none",
             precision: str = "fp32") -> tuple[int, int]:
    """Operators one step of ``GPT(config)`` runs: ``(per micro-batch, per optimizer step)``.

    Counted, not estimated: :func:`course_lib.training.train` runs a tiny model of the same
    structure (attention, dropout, bias, checkpointing, precision) under a dispatch mode
    that counts every aten operator except views, with 1 and 2 micro-batches (their
    difference is one micro-batch's forward and backward), for 1 and 2 layers; both counts
    are linear in the layers (every block runs the same operators), which gives any depth.
    Widths and batch sizes do not change them. The CPU's kernels are counted: on a GPU the
    same model runs the same operators, except SDPA with dropout, which is one fused kernel
    there and the math kernel's dozen operators here.

    Args:
        config (GPTConfig): the model.
        checkpointing (str): one of :data:`CHECKPOINTING`.
        precision (str): one of :data:`course_lib.memory.PRECISIONS`.

    Returns:
        tuple of int: ``(per micro-batch, per optimizer step)`` operator counts.

    Raises:
        ValueError: naming ``config``, ``checkpointing`` or ``precision``.

    Example:
        >>> step_ops(GPTConfig(n_layers=4))[0] > step_ops(GPTConfig(n_layers=2))[0]
        True
    """
    check_config(config)
    _check_choices(checkpointing, precision)
    key = (config.dropout > 0, config.attention, config.bias, checkpointing, precision)
    one, two = _ops(1, *key), _ops(2, *key)
    L = config.n_layers
    return tuple(a + (L - 1) * (b - a) for a, b in zip(one, two))


def _check_choices(checkpointing: str, precision: str) -> None:
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    precision_of(precision)


def micro_batch_flops(config: GPTConfig, micro_batch_size: int, checkpointing: str = "none",
                      precision: str = "fp32", gpu=None) -> tuple[int, int]:
    """``(flops, recomputed)`` of one micro-batch's forward, backward and recomputation.

    :func:`course_lib.checkpointing.step_flops` on the kernel ``gpu`` runs. On the CPU,
    where ``FlopCounterMode`` has no formula for the flash kernel and counts its attention
    as 0, the fused kernel's work is counted as on a GPU (an A100's rules), since the
    arithmetic is the same.

    Args:
        config (GPTConfig): the model.
        micro_batch_size (int): sequences, from 1 to :data:`course_lib.validation.MAX_BATCH`.
        checkpointing (str): a checkpointing mode.
        precision (str): one of :data:`course_lib.memory.PRECISIONS`.
        gpu (str or GPU, optional): None for the CPU, or what :func:`course_lib.device.resolve_gpu`
            takes.

    Returns:
        tuple of int: ``(flops, recomputed)``.

    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    check_config(config)
    micro_batch_size = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    choice("checkpointing", checkpointing, ALL_MODES)
    spec = precision_of(precision)
    card = resolve_gpu(gpu)
    if card is None and attention_kernel(config, spec.compute, None) == "flash":
        card = GPUS["A100 80GB"]
    return step_flops(config, micro_batch_size, checkpointing, dtype=spec.compute, gpu=card,
                      autocast=spec.autocast)


def adamw_bytes_moved(n_params: int, precision: str = "fp32") -> int:
    """Bytes AdamW reads and writes in one step of ``n_params`` parameters.

    Per parameter it reads the weight, the gradient, ``m`` and ``v`` and writes the weight,
    ``m`` and ``v``: ``7 s`` bytes with ``s`` bytes per state value (4 in fp32, 2 in pure
    bf16). With fp32 master weights it also casts the ``e``-byte gradients to fp32 and the
    master weights back (``2e + 8`` more): 40 bytes per parameter in fp16/bf16-mixed.

    Args:
        n_params (int): parameters, a positive int.
        precision (str): one of :data:`course_lib.memory.PRECISIONS`.

    Returns:
        int: bytes.

    Raises:
        ValueError: naming ``n_params`` or ``precision``.

    Example::

        adamw_bytes_moved(1000, "bf16-mixed")  # 40000
    """
    spec = precision_of(precision)
    s, e = dtype_bytes(spec.state), dtype_bytes(spec.params)
    n = positive_int("n_params", n_params, maximum=MAX_COUNT)
    return n * (7 * s + (2 * e + 8 if spec.master else 0))


@dataclass(frozen=True)
class StepCost:
    """What one optimizer step costs, predicted: peak bytes and seconds.

    See :func:`optimizer_step_cost` for the model.

    Attributes:
        micro_batch_size (int): sequences per forward and backward pass (b).
        accumulation_steps (int): micro-batches per optimizer step (K).
        checkpointing (str): the checkpointing mode.
        precision (str): the precision.
        memory (StepMemory): the engine's prediction; its ``total`` is :attr:`peak_bytes`.
        flops (int): forward, backward and recomputation of all K micro-batches.
        recompute_flops (int): the recomputation's share of ``flops``.
        compute_seconds (float): K micro-batches' FLOPs at the utilised rate.
        overhead_seconds (float): K micro-batches' operators at ``op_seconds`` each (and the
            checkpointed regions' own cost).
        optimizer_seconds (float): AdamW's bytes moved over the memory bandwidth, and its
            operators.
        speed (DeviceSpeed): the device's figures used.
        utilisation (float): the fraction of the matmul rate assumed.
    """

    micro_batch_size: int
    accumulation_steps: int
    checkpointing: str
    precision: str
    memory: StepMemory
    flops: int
    recompute_flops: int
    compute_seconds: float
    overhead_seconds: float
    optimizer_seconds: float
    speed: DeviceSpeed
    utilisation: float

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step: ``micro_batch_size * accumulation_steps``."""
        return self.micro_batch_size * self.accumulation_steps

    @property
    def peak_bytes(self) -> int:
        """All bytes on the device at the step's peak (``memory.total``)."""
        return self.memory.total

    @property
    def seconds(self) -> float:
        """Seconds per optimizer step: compute, operator overhead and the optimizer."""
        return self.compute_seconds + self.overhead_seconds + self.optimizer_seconds

    @property
    def achieved_utilisation(self) -> float:
        """FLOPs per second over the device's matmul rate.

        Model FLOPs utilisation, with the recomputation counted.
        """
        rate = self.speed.flops(precision_of(self.precision).compute)
        return self.flops / (self.seconds * rate)


def optimizer_step_cost(config: GPTConfig, micro_batch_size: int, accumulation_steps: int, *,
                        checkpointing: str = "none", precision: str = "fp32", gpu=None,
                        speed: DeviceSpeed | None = None,
                        utilisation: float | None = None) -> StepCost:
    """Predicted peak bytes and seconds of one optimizer step of ``K`` micro-batches of ``b``.

    Memory: :func:`course_lib.engine.predict_step_memory` (steady state; its ``total``).

    Time, a model in three terms (seconds):

    * compute: ``K F(b) / (R u)``, with ``F(b)`` a micro-batch's FLOPs with the recomputation
      (:func:`micro_batch_flops`), ``R`` the device's matmul rate in the compute dtype and
      ``u`` the utilisation;
    * operators: ``K (n_op c + L_ckpt r)``: each micro-batch runs ``n_op`` operators
      (:func:`step_ops`, counted) and each costs ``c`` seconds however small
      (``speed.op_seconds``); each of its ``L_ckpt`` checkpointed regions costs ``r`` more
      (``speed.checkpoint_seconds``: measured on this device, 0 for a datasheet);
    * optimizer: ``adamw_bytes_moved / bandwidth + n_opt c``.

    At a fixed effective batch ``B = bK`` the compute term does not change with ``K``
    (``F`` is linear in ``b``), but the operator term grows as ``K``: a micro-batch too small
    to fill the device costs its operators' fixed price anyway. That is the whole of the
    model's "under-filling", and where it is only a model: a real GPU also loses
    throughput on small matmuls whose tiles do not fill its SMs, overlaps the CPU's dispatch
    with the GPU's work once kernels are long enough (then ``c`` is hidden, not added), and
    ``u`` depends on sizes that one number does not capture. The course measures it on the
    device it runs on (:func:`measure_step_cost`) and shows both.

    Args:
        config (GPTConfig): the model (a :class:`~course_lib.models.GPTConfig`).
        micro_batch_size (int): ``b``, sequences per forward and backward pass.
        accumulation_steps (int): ``K``, micro-batches per optimizer step.
        checkpointing (str): one of :data:`CHECKPOINTING`.
        precision (str): one of :data:`course_lib.engine.PRECISIONS`.
        gpu (str or GPU, optional): where it runs: a preset name of :data:`course_lib.device.GPUS`,
            a :class:`~course_lib.device.GPU`, "cuda", or None/"cpu" (the CPU; then ``speed`` is
            required).
        speed (DeviceSpeed, optional): the device's :class:`DeviceSpeed`; default: the GPU's
            datasheet (:func:`device_speed`).
        utilisation (float, optional): ``u`` in (0, 1]; default :data:`UTILISATION` for a datasheet
            speed and 1 for a measured one (measured on a large matmul, it is already achieved).

    Returns:
        A :class:`StepCost` (``peak_bytes``, ``seconds`` and the terms above).

    Raises:
        ValueError: naming the argument, for anything outside the above.

    Example:
        >>> cost = optimizer_step_cost(GPTConfig(n_layers=2), 4, 8, precision="bf16-mixed",
        ...                            gpu="A100 80GB")
        >>> cost.effective_batch, cost.seconds > cost.compute_seconds
        (32, True)
    """
    check_config(config)
    b = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    K = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    _check_choices(checkpointing, precision)
    card = resolve_gpu(gpu)
    if speed is None:
        if card is None:
            raise ValueError("gpu=None (the CPU) needs speed=measure_device_speed('cpu'): "
                             "there is no datasheet for it")
        speed = device_speed(card)
    elif not isinstance(speed, DeviceSpeed):
        raise ValueError(f"speed must be a DeviceSpeed or None, got {type(speed).__name__}")
    if utilisation is None:
        utilisation = 1.0 if speed.measured else UTILISATION
    utilisation = number("utilisation", utilisation, above=0, maximum=1)
    memory = predict_step_memory(config, b, K, precision=precision, mode=checkpointing, gpu=card)
    flops, recomputed = micro_batch_flops(config, b, checkpointing, precision, card)
    ops, optimizer_ops = step_ops(config, checkpointing, precision)
    rate = speed.flops(precision_of(precision).compute) * utilisation
    moved = adamw_bytes_moved(gpt_param_count(config), precision)
    regions = 0 if checkpointing == "none" else config.n_layers
    per_micro_batch = ops * speed.op_seconds + regions * speed.checkpoint_seconds(checkpointing)
    return StepCost(b, K, checkpointing, precision, memory, K * flops, K * recomputed,
                    compute_seconds=K * flops / rate, overhead_seconds=K * per_micro_batch,
                    optimizer_seconds=moved / speed.memory_bandwidth + optimizer_ops * speed.op_seconds,
                    speed=speed, utilisation=float(utilisation))


def _best_seconds(fn, repeats: int, device: torch.device, clock: str = "wall") -> float:
    """The fastest seconds of ``repeats`` timed calls of ``fn`` (after one warm-up), on ``clock``."""
    return step_times({"fn": fn}, repeats=repeats, device=device).best(clock)["fn"]


def measure_device_speed(device: torch.device | str = "cpu", *, matmul_size: int | None = None,
                         repeats: int = 5) -> DeviceSpeed:
    """This kernel's device, measured: the :class:`DeviceSpeed` a prediction for it uses.

    * matmul FLOP/s per dtype: ``2 n^3`` over the best time of an ``n x n`` matmul
      (``n`` = 512 on the CPU, 4096 on a GPU);
    * operator seconds: the best time of one training step (:func:`course_lib.training.train`,
      AdamW) of a tiny course GPT (1 sequence of 8 tokens, width 8, 2 layers), whose FLOPs
      are negligible, divided by the operators it runs (:func:`step_ops`);
    * checkpointing, per mode: the same step with every block checkpointed, minus the plain
      step and its extra operators, per region;
    * bandwidth: bytes read and written by a copy of 64 MiB, over its best time.

    About a second on a CPU. The fastest of ``repeats`` runs is kept: the others include
    other work of the machine.

    Args:
        device (str or torch.device): a cpu or cuda device.
        matmul_size (int, optional): ``n`` of the timed matmul (default 512 on the CPU, 4096 on
            a GPU), at most :data:`MAX_MATMUL`.
        repeats (int): runs of each timing, the fastest kept; from 1 to
            :data:`course_lib.timing.MAX_RUNS`.

    Returns:
        DeviceSpeed: with ``measured=True``.

    Raises:
        ValueError: naming the parameter: a device other than cpu or cuda, a bad ``repeats``
            or ``matmul_size``.
    """
    device = as_device("device", device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a cpu or cuda device, got {device}")
    repeats = positive_int("repeats", repeats, maximum=MAX_RUNS)
    n = positive_int("matmul_size", matmul_size, maximum=MAX_MATMUL) if matmul_size is not None \
        else (4096 if device.type == "cuda" else 512)
    rates = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.randn(n, n, device=device).to(dtype)
        rates[dtype] = 2 * n**3 / _best_seconds(lambda a=a: a @ a, repeats, device)
    tiny = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=2)
    plain = _best_seconds(_tiny_step(tiny, "none", "fp32", 1, device), repeats, device)
    op_seconds = plain / sum(step_ops(tiny))
    regions = []
    for mode in CHECKPOINTING[1:]:
        extra_ops = sum(step_ops(tiny, mode)) - sum(step_ops(tiny))
        seconds = _best_seconds(_tiny_step(tiny, mode, "fp32", 1, device), repeats, device)
        regions.append((mode, max(0.0, (seconds - plain - extra_ops * op_seconds) / tiny.n_layers)))
    block = torch.empty(16 * 2**20, device=device)  # 64 MiB of fp32
    copy = torch.empty_like(block)
    bandwidth = 2 * block.nbytes / _best_seconds(lambda: copy.copy_(block), repeats, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    return DeviceSpeed(name, rates[torch.float32], rates[torch.float16], rates[torch.bfloat16],
                       bandwidth, op_seconds, True,
                       f"measured on {device}: {n}x{n} matmuls, a tiny GPT's steps, a copy",
                       tuple(regions))


@dataclass(frozen=True)
class MeasuredStep:
    """One optimizer step measured on a device: peak bytes and seconds (best of the steps).

    Attributes:
        peak_bytes (int): resident bytes plus the measured peak of a steady-state step.
        seconds (float): the fastest optimizer step, in seconds.
        device (str): where it ran (``"cpu"``, ``"cuda"``).
    """

    peak_bytes: int
    seconds: float
    device: str


def measure_step_cost(config: GPTConfig, micro_batch_size: int, accumulation_steps: int, *,
                      checkpointing: str = "none", precision: str = "fp32",
                      device: torch.device | str = "cpu", steps: int = 3,
                      clock: str = "wall") -> MeasuredStep:
    """Run the setting of :func:`optimizer_step_cost` on ``device`` and measure it.

    Memory: :func:`course_lib.step_setup.measure_step_memory` (resident bytes plus the measured
    peak of a steady-state step: the CUDA allocator on CUDA, the live-tensor tracker
    elsewhere). Time: the fastest of ``steps`` optimizer steps of
    :func:`course_lib.training.train` after one warm-up step, on the model and optimizer of
    :func:`course_lib.step_setup.build` (synchronised on CUDA), on ``clock``: the wall clock,
    or with ``"auto"`` this process's CPU time on the CPU (which other work on the machine
    disturbs less) and the wall clock on a GPU.

    Args:
        config (GPTConfig): the model.
        micro_batch_size (int): sequences per forward and backward pass.
        accumulation_steps (int): micro-batches per optimizer step.
        checkpointing (str): one of :data:`CHECKPOINTING`.
        precision (str): one of :data:`course_lib.memory.PRECISIONS`.
        device (str or torch.device): where it runs.
        steps (int): timed steps, from 1 to :data:`course_lib.timing.MAX_RUNS`.
        clock (str): one of :data:`course_lib.timing.CLOCKS` (see above).

    Returns:
        MeasuredStep: peak bytes and seconds.

    Raises:
        ValueError: naming the parameter, for a bad value.
    """
    check_config(config)
    b = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    K = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    steps = positive_int("steps", steps, maximum=MAX_RUNS)
    choice("clock", clock, CLOCKS)
    _check_choices(checkpointing, precision)
    device = as_device("device", device)
    peak = measure_step_memory(config, b, K, precision=precision, mode=checkpointing,
                               device=device)
    model, optimizer = build(config, precision=precision, mode=checkpointing, device=device)
    options = train_options(precision, device)
    x, y = markov_tokens(b * K, config.seq_len, config.vocab_size, device=device)
    seconds = _best_seconds(lambda: train(model, optimizer, [(x, y)], micro_batch_size=b,
                                          accumulation_steps=K, **options), steps, device,
                            clock)
    return MeasuredStep(peak, seconds, str(device))
