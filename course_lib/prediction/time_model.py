"""03, 05, 08: the one time model of a training step, used by every planner, ladder and widget.

A step of ``K`` micro-batches of ``b`` sequences takes, in seconds (:func:`step_time`)::

    F / (u R[dtype])                      matmul and attention FLOPs at a utilisation of the peak
  + (B_pointwise + B_optimizer) / W       bytes that pointwise ops and the optimizer move
  + n_ops c + n_regions r                 operators (a kernel launch and eager dispatch each),
                                          checkpointed regions' own work
  + B_host / link_host + B_peer / link_peer    transfers: offloading, ZeRO

``F`` is :func:`course_lib.prediction.checkpointed.step_flops`; ``B_pointwise`` what the
pointwise ops read and write, proportional to the saved activations (halved in 16-bit, no more:
why fp16-mixed is not 8x faster on a T4); ``n_ops`` from :data:`OP_COUNTS`. A GPU preset's
:class:`DeviceSpeed` comes from its datasheet and the assumptions below; this kernel's device is
measured once per process (:func:`device_speed`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.device import GPU, GPUS, MAX_BANDWIDTH, MAX_FLOPS, resolve_gpu
from course_lib.measurement.timing import step_times
from course_lib.model.gpt import GPTConfig, gpt_param_count, param_numels
from course_lib.model.kernels import adamw_foreach, attention_kernel
from course_lib.prediction import checkpointed
from course_lib.prediction.engine import precision_of
from course_lib.prediction.step import Step
from course_lib.prediction.step_setup import build
from course_lib.training import checkpointing as ckpt, levers
from course_lib.training.loop import make_grad_scaler
from course_lib.units import dtype_bytes
from course_lib.validation import (
    MAX_BYTES,
    boolean,
    integer,
    number,
)

# Share of a GPU preset's 16-bit tensor-core peak that a step's matmuls reach, assumed: the best
# published utilisations are 46.2 % (PaLM on TPU v4, Chowdhery et al. 2022) and 52 % (a 175B GPT
# on A100s, Narayanan et al. 2021); one GPU in eager PyTorch on a GPT-2-sized model reaches less.
_UTILISATION = 0.4
# The same for fp32 matmuls on CUDA cores (PyTorch leaves TF32 off), assumed: CUDA cores need 8
# to 16 times fewer bytes per FLOP than tensor cores, so a step's matmuls get nearer their peak.
_FP32_UTILISATION = 0.7
# Seconds each operator costs on a GPU preset, assumed: eager dispatch plus one kernel launch (a
# few microseconds alone: NVIDIA, "Getting Started with CUDA Graphs", 2019).
_OP_SECONDS = 10e-6
# Host memory bandwidth (bytes/s) of an offloaded optimizer step, assumed: two thirds of two
# DDR5-4800 channels' 76.8 GB/s peak (JEDEC JESD79-5).
_HOST_BANDWIDTH = 50e9
# Passes over the saved activations' bytes that pointwise work makes, assumed: forward, an op
# writes its output and the next reads it (2); backward, a gradient reads the saved tensor and
# the incoming gradient and writes the outgoing one (3).
_FORWARD_PASSES, _BACKWARD_PASSES = 2, 3
# AdamW reads the weight, the gradient, m and v, and writes the weight, m and v.
_ADAMW_VALUES = 7

#: The checkpointing modes whose operators :data:`OP_COUNTS` records (every block alike).
CHECKPOINTING = ("none", "blocks", "selective", "attention")
_FLOPS_FIELDS = {torch.float32: "fp32_flops", torch.float16: "fp16_flops",
                 torch.bfloat16: "bf16_flops"}


@dataclass(frozen=True)
class DeviceSpeed:
    """The figures of a device that :func:`step_time` turns FLOPs, bytes and operators into time:
    matmul FLOP/s per dtype, memory bandwidth (bytes/s), seconds per operator and per
    checkpointed region, host and peer links (bytes/s)."""

    name: str
    fp32_flops: float
    fp16_flops: float
    bf16_flops: float
    memory_bandwidth: float
    op_seconds: float
    measured: bool
    source: str
    region_seconds: tuple[tuple[str, float], ...] = ()
    host_link: float | None = None
    peer_link: float | None = None
    utilisation: float | None = None

    def __post_init__(self):  # a speed of 0, NaN or 10**400 would give a time for nonsense
        for name in ("fp32_flops", "fp16_flops", "bf16_flops", "memory_bandwidth", "op_seconds"):
            maximum = {"memory_bandwidth": MAX_BANDWIDTH, "op_seconds": 1.0}.get(name, MAX_FLOPS)
            number(name, getattr(self, name), above=0.0, maximum=maximum)
        boolean("measured", self.measured)
        if not isinstance(self.region_seconds, tuple) or not all(
                isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)
                and number("region_seconds", r[1], minimum=0.0, maximum=1.0) >= 0
                for r in self.region_seconds):
            raise ValueError(f"region_seconds must be a tuple of (mode, seconds) pairs, got "
                             f"{self.region_seconds!r:.80}")
        for name, maximum in (("host_link", MAX_BANDWIDTH), ("peer_link", MAX_BANDWIDTH),
                              ("utilisation", 1.0)):
            if getattr(self, name) is not None:
                number(name, getattr(self, name), above=0.0, maximum=maximum)

    @property
    def basis(self) -> str:
        """Where the figures come from: "from rates measured on this device" or "from the datasheet"."""
        return "from rates measured on this device" if self.measured else "from the datasheet"

    def reached(self, dtype: torch.dtype) -> float:
        """The share of ``dtype``'s matmul rate a step reaches: ``utilisation`` if set; else 1
        when measured, and on a datasheet 0.7 at the fp32 rate (a T4's bf16 too), 0.4 on tensor
        cores (assumed, with their sources, in this module)."""
        if self.utilisation is not None:
            return self.utilisation
        if self.measured:
            return 1.0
        return _FP32_UTILISATION if self.flops(dtype) <= self.fp32_flops else _UTILISATION

    def flops(self, dtype: torch.dtype) -> float:
        """FLOP/s of a matmul in ``dtype`` (fp32, fp16 or bf16)."""
        if dtype not in _FLOPS_FIELDS:
            raise ValueError(f"dtype must be one of {list(_FLOPS_FIELDS)}, got {dtype!r}")
        return getattr(self, _FLOPS_FIELDS[dtype])

    def checkpoint_seconds(self, mode: str) -> float:
        """Seconds per checkpointed region and micro-batch in ``mode`` (0 where unknown)."""
        return dict(self.region_seconds).get("blocks" if mode == "sqrt" else mode, 0.0)


def _preset_of(gpu: GPU) -> GPU | None:
    """The preset whose datasheet a live card shares: same chip in its name, closest memory."""
    chips = [name for name in ("H200", "H100", "A100", "L4", "T4") if name in gpu.name]
    same = [p for p in GPUS.values() if chips and p.name.startswith(chips[0])]
    return min(same, key=lambda p: abs(p.total_memory - gpu.total_memory)) if same else None


def _datasheet_speed(card: GPU) -> DeviceSpeed:
    """A GPU's :class:`DeviceSpeed` from its datasheet (:data:`course_lib.device.GPUS`)."""
    sheet = card if card.tensor_flops else _preset_of(card)
    if sheet is None or not sheet.tensor_flops:
        raise ValueError(f"gpu {card.name!r} has no datasheet speeds and no preset of the same "
                         f"chip among {list(GPUS)}: measure it with device_speed('cuda')")
    bf16 = sheet.tensor_flops if card.has_native_bf16 else sheet.fp32_flops
    return DeviceSpeed(card.name, sheet.fp32_flops, sheet.tensor_flops, bf16,
                       sheet.memory_bandwidth, _OP_SECONDS, False, f"the {sheet.name} datasheet",
                       host_link=sheet.host_link, peer_link=sheet.peer_link)


def _measure_speed(device_type: str, *, matmul_size: int | None = None,
                   repeats: int = 5) -> DeviceSpeed:
    """This kernel's CPU or CUDA device measured (about two seconds on a CPU): medians of an
    ``n x n`` matmul per dtype (``2 n^3`` FLOPs; ``n`` 4096 on a GPU, 256 on a CPU), a GELU (the
    typical pointwise op), a tiny GPT's steps over their operators (:data:`OP_COUNTS`) and per
    checkpointed region. Links are the same chip's preset's."""
    device = torch.device(device_type)
    n = matmul_size or (4096 if device.type == "cuda" else 256)
    mats = {dtype: torch.randn(n, n, device=device).to(dtype)
            for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    timed = functools.partial(step_times, repeats=repeats, device=device)
    times = timed({str(d): (lambda a=a: a @ a) for d, a in mats.items()}).median("auto")
    rates = {d: 2 * n**3 / times[str(d)] for d in mats}
    block = torch.randn((64 if device.type == "cuda" else 1) * 2**20, device=device)
    gelu = {"gelu": lambda: torch.nn.functional.gelu(block)}
    bandwidth = 2 * block.nbytes / timed(gelu).median("auto")["gelu"]
    tiny = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=2)
    steps = {mode: _tiny_steps(tiny, mode, "fp32", device)[1] for mode in CHECKPOINTING}
    tiny_times = timed(steps).median("auto")
    plain = tiny_times["none"]
    # the tiny steps ran PyTorch's default AdamW: foreach on a GPU, per tensor on the CPU
    foreach = adamw_foreach(resolve_gpu("cuda") if device.type == "cuda" else None)
    ops = {mode: sum(_step_ops(tiny, mode, foreach=foreach)) for mode in CHECKPOINTING}
    op_seconds = plain / ops["none"]
    regions = tuple(
        (mode, max(0.0, (tiny_times[mode] - plain - (ops[mode] - ops["none"]) * op_seconds)
                   / tiny.n_layers))
        for mode in CHECKPOINTING[1:])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    sheet = _preset_of(resolve_gpu("cuda")) if device.type == "cuda" else None
    links = (sheet.host_link, sheet.peer_link) if sheet else (None, None)
    return DeviceSpeed(name, rates[torch.float32], rates[torch.float16], rates[torch.bfloat16],
                       bandwidth, op_seconds, True,
                       f"measured on {device}: {n}x{n} matmuls, a GELU, a tiny GPT's steps",
                       regions, *links)


@functools.lru_cache(maxsize=8)
def _measured(device_type: str, threads: int) -> DeviceSpeed:
    """This device measured once per process and thread count (they change the CPU's speed)."""
    return _measure_speed(device_type)


def device_speed(gpu=None) -> DeviceSpeed:
    """The :class:`DeviceSpeed` a prediction for ``gpu`` uses: a datasheet, or this device measured.

    A preset (or a :class:`course_lib.device.GPU` that is not live) is read from its datasheet;
    the CPU (None, "cpu") and this kernel's GPU ("cuda") are measured once per process
    (on the CPU once per number of threads).
    Args:
        gpu (str or GPU, optional): what :func:`course_lib.device.resolve_gpu` takes (None: CPU).
    Returns:
        DeviceSpeed: the device's speeds.
    Example:
        >>> device_speed("T4").basis
        'from the datasheet'
    """
    card = resolve_gpu(gpu)
    if card is None:
        return _measured("cpu", torch.get_num_threads())
    if card.live:
        return _measured("cuda", 1)
    return _datasheet_speed(card)


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators that compute (views launch no kernel)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def _tiny_steps(config: GPTConfig, mode: str, precision: str, device,
                foreach: bool | None = None) -> dict[int, Callable[[], None]]:
    """Steps of ``K`` = 1 and 2 micro-batches of one sequence, as a training script runs them."""
    model, optimizer = build(config, precision=precision, mode=mode, device=device)
    if foreach is not None:  # AdamW reads its group's flag at each step
        for group in optimizer.param_groups:
            group["foreach"] = foreach
    spec, device = precision_of(precision), torch.device(device)
    amp = spec.compute if spec.autocast else None
    # a scale that never overflows: no step skipped
    scaler = make_grad_scaler(device.type, init_scale=1.0) if spec.grad_scaler else None
    x = torch.zeros(2, config.seq_len, dtype=torch.long, device=device)

    def step(K: int) -> None:
        for k in range(K):
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                loss = model(x[k:k + 1], x[k:k + 1])[1] / K
            (scaler.scale(loss) if scaler else loss).backward()
        if hasattr(optimizer, "prepare_grads"):  # mixed precision: the fp32 master gradients
            optimizer.prepare_grads()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {K: functools.partial(step, K) for K in (1, 2)}


def count_step_ops(n_layers: int, dropout: bool, attention: str, bias: bool, mode: str,
                   precision: str, foreach: bool = False) -> tuple[int, int]:
    """``(per micro-batch, per step)`` operators of a tiny GPT of this structure, counted."""
    tiny = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=n_layers,
                     dropout=0.1 if dropout else 0.0, attention=attention, bias=bias)
    counts = []
    # build() seeds the global RNG and dropout draws from it: the caller's RNG comes back as it was
    with torch.random.fork_rng(devices=[]):
        steps = _tiny_steps(tiny, mode, precision, "cpu", foreach)
        steps[1]()
        for K in (1, 2):
            with _OpCounter() as counter:
                steps[K]()
            counts.append(counter.ops)
    per_micro_batch = counts[1] - counts[0]
    return per_micro_batch, counts[0] - per_micro_batch


def op_count_key(n_layers: int, dropout: bool, attention: str, bias: bool, mode: str,
                 precision: str, foreach: bool) -> str:
    """The key of one structure in :data:`OP_COUNTS`."""
    return f"{n_layers} {int(dropout)} {attention} {int(bias)} {mode} {precision} {int(foreach)}"


#: Operators of one training step by structure, recorded on the CPU with :func:`count_step_ops`
#: for 1 and 2 layers (``python -m course_tools.op_counts`` writes them again; a test recounts a
#: sample): ``{"torch": version, "counts": {op_count_key(...): [per micro-batch, per step]}}``.
OP_COUNTS = json.loads((Path(__file__).parent / "op_counts.json").read_text())


def _step_ops(config: GPTConfig, mode: str = "none", precision: str = "fp32",
              foreach: bool = False) -> tuple[int, int]:
    """``(per micro-batch, per step)`` operators of ``GPT(config)`` from :data:`OP_COUNTS`."""
    key = (config.dropout > 0, config.attention, config.bias, mode, precision, foreach)
    one, two = (OP_COUNTS["counts"][op_count_key(n, *key)] for n in (1, 2))
    L = config.n_layers
    return tuple(a + (L - 1) * (b - a) for a, b in zip(one, two))


def _optimizer_bytes(n_params: int, spec, state_bits: int) -> int:
    """AdamW's bytes moved: ``7 s`` per parameter, ``2e + 8`` more with master weights."""
    s, e = dtype_bytes(spec.state), dtype_bytes(spec.params)
    per = _ADAMW_VALUES * s + (2 * e + 8 if spec.master else 0)
    if state_bits != 32:
        per += 2 * (_low_bit_bytes_moved(state_bits) - 2 * s)
    return n_params * per


def _low_bit_bytes_moved(state_bits: int) -> int:
    """Bytes torchao's eager 8-/4-bit AdamW moves per state value (an estimate, an upper bound)."""
    # dequantise, update, scale, 40 per search round, round (torchao/optim/quant_utils.py)
    return -(-state_bits // 8) + 4 + 8 + 12 + 40 * state_bits + 60


#: Operators per quantised tensor and state of the eager low-bit step: five per binary-search
#: round (an add, a gather, a compare, a where, an add), about 25 more to dequantise, scale,
#: round and update (counted from torchao 0.18's ``quant_utils``; an estimate).
_LOW_BIT_OPS_PER_ROUND, _LOW_BIT_OPS = 5, 25
#: torchao quantises a state tensor of at least this many elements (bitsandbytes' rule).
_LOW_BIT_MIN_NUMEL = 4096


def transfer_seconds(nbytes: int, bytes_per_second: float) -> float:
    """Seconds to move ``nbytes`` over a link of ``bytes_per_second``: a lower bound (real copies
    reach less than a link's rate, from pinned memory, and less still from pageable memory).
    Args:
        nbytes (int): the bytes to move.
        bytes_per_second (float): the link's rate.
    Returns:
        float: the seconds.
    Raises:
        ValueError: naming the parameter, for a bad value.
    Example:
        >>> transfer_seconds(63_000_000_000, 63e9)  # a PCIe 5.0 x16 link for a second
        1.0
    """
    nbytes = integer("nbytes", nbytes, minimum=0, maximum=MAX_BYTES)  # numpy's ints too
    return nbytes / number("bytes_per_second", bytes_per_second, above=0.0)


@dataclass(frozen=True)
class _StepTime:
    """One optimizer step's predicted seconds, by term (:func:`step_time`)."""

    flops: int
    recompute_flops: int
    pointwise_bytes: int
    optimizer_bytes: int
    ops: int
    compute_seconds: float
    pointwise_seconds: float
    launch_seconds: float
    optimizer_seconds: float
    transfer_seconds: float
    speed: DeviceSpeed
    utilisation: float

    @property
    def seconds(self) -> float:
        """Seconds per optimizer step: the sum of the five terms."""
        return (self.compute_seconds + self.pointwise_seconds + self.launch_seconds
                + self.optimizer_seconds + self.transfer_seconds)

    @property
    def basis(self) -> str:
        """Where the figures come from (:attr:`DeviceSpeed.basis`)."""
        return self.speed.basis


def step_time(step: Step, speed: DeviceSpeed | None = None) -> _StepTime:
    """The five terms of a checked :class:`Step`'s time (``speed`` None: :func:`device_speed`)."""
    return _step_time(step, device_speed(step.gpu) if speed is None else speed)


@functools.lru_cache(maxsize=1024)
def _kept_bytes(config, b, mode, every, gpu, **kw) -> int:
    """:func:`checkpointed.predict_kept_bytes`, cached: a ladder's rungs share their model's."""
    return checkpointed.predict_kept_bytes(config, b, mode, every, gpu=gpu, **kw)


@functools.lru_cache(maxsize=1024)
def _step_time(step: Step, speed: DeviceSpeed) -> _StepTime:
    """:func:`step_time`, cached: widgets call it on every slider move."""
    config, b, K, mode, every = (step.config, step.micro_batch_size, step.accumulation_steps,
                                 step.mode, step.every)
    spec, gpu, L, P = step.spec, step.gpu, config.n_layers, gpt_param_count(config)
    tokens = step.batch_size * step.seq_len
    extra, trained = 0, P
    if step.loss_chunk is not None:  # the chunked loss's second head matmul
        extra += 2 * tokens * config.d_model * config.vocab_size
    if step.lora_rank:
        trained = levers.lora_parameter_count(config, step.lora_rank)
        extra += 6 * tokens * trained - levers.frozen_linear_flops(config, tokens)
    kw = dict(seq_len=step.seq_len, dtype=spec.compute, autocast=spec.autocast)
    # the CPU's flash attention counted as a GPU's
    flash_on_cpu = gpu is None and attention_kernel(config, spec.compute, None) == "flash"
    card = GPUS["A100 80GB"] if flash_on_cpu else gpu
    flops, recomputed = checkpointed.step_flops(config, b, mode, every, gpu=card, **kw)
    flops = K * flops + extra
    # (F + B) A + F (A - A_mode): passes over a plain step's saved bytes, plus the rerun
    plain = _kept_bytes(config, b, "none", 1, gpu, **kw)
    kept = plain if mode == "none" else _kept_bytes(config, b, mode, every, gpu, **kw)
    moved = K * ((_FORWARD_PASSES + _BACKWARD_PASSES) * plain
                 + _FORWARD_PASSES * max(0, plain - kept))
    # operators: every block runs the same ones, so a mode checkpointing some blocks reruns
    # its per-block extra in those only; ``sqrt`` segments rerun whole blocks
    regions = ckpt.checkpointed_regions(L, mode, every)
    foreach = step.runs_foreach
    per_micro, per_step = _step_ops(config, "none", step.precision, foreach)
    if mode != "none":
        counted = "blocks" if mode == "sqrt" else mode
        extra_ops = _step_ops(config, counted, step.precision, foreach)[0] - per_micro
        per_micro += round(extra_ops * sum(len(r) for r in regions) / L)
    launch = K * (per_micro * speed.op_seconds + len(regions) * speed.checkpoint_seconds(mode))
    shard = step.world_size if step.zero_stage >= 1 else 1
    opt_bytes = -(-_optimizer_bytes(trained, spec, step.state_bits) // shard)
    if step.state_bits != 32:  # the eager quantisation's operators, per large state tensor
        tensors = (sum(n >= _LOW_BIT_MIN_NUMEL for n in param_numels(config)) if trained == P
                   else 8 * L)  # LoRA: A and B beside each of a block's four linears
        per_step += 2 * tensors * (_LOW_BIT_OPS_PER_ROUND * step.state_bits + _LOW_BIT_OPS)
    opt_seconds = per_step * speed.op_seconds + (
        opt_bytes / (_HOST_BANDWIDTH if step.offload_optimizer and speed.host_link else
                     speed.memory_bandwidth))
    link = 0.0
    pb = dtype_bytes(spec.params)
    if speed.host_link:  # a GPU: what leaves it crosses the host link
        if step.offload_activations:
            link += 2 * K * kept / speed.host_link
        if step.offload_optimizer:
            link += 2 * trained * pb / speed.host_link
    if step.zero_stage and speed.peer_link:
        link += (3 if step.zero_stage == 3 else 2) * P * pb / speed.peer_link
    u = speed.reached(spec.compute)
    return _StepTime(flops, K * recomputed, moved, opt_bytes, K * per_micro + per_step,
                    compute_seconds=flops / (speed.flops(spec.compute) * u),
                    pointwise_seconds=moved / speed.memory_bandwidth,
                    launch_seconds=launch, optimizer_seconds=opt_seconds,
                    transfer_seconds=link, speed=speed, utilisation=float(u))


__all__ = ["CHECKPOINTING", "DeviceSpeed", "device_speed", "transfer_seconds", "step_time"]
