"""03, 05, 08: the one time model of a training step, used by every planner, ladder and widget.

A step of ``K`` micro-batches of ``b`` sequences takes, in seconds (:func:`step_time`)::

    F / (u R[dtype])                      matmul and attention FLOPs at a utilisation of the peak
  + (B_pointwise + B_optimizer) / W       bytes that pointwise ops and the optimizer move
  + n_ops c + n_regions r                 operators (a kernel launch and eager dispatch each),
                                          checkpointed regions' own work
  + B_host / link_host + B_peer / link_peer    transfers: offloading, ZeRO

* ``F``: :func:`matmul_flops` (as ``FlopCounterMode`` counts them, the recomputation included);
  ``R[dtype]`` the matmul rate of the compute dtype, ``u`` the share of it reached.
* ``B_pointwise``: :func:`pointwise_bytes`: what LayerNorm, GELU, softmax, dropout, the residual
  adds and their gradients read and write, proportional to the activations a step saves; the
  recomputation of a checkpointed region writes and reads its dropped activations again. In
  16-bit these bytes halve, no more: that is why fp16-mixed is not 8x faster on a T4 whose
  tensor cores are 8x its fp32 rate.
* ``B_optimizer``: :func:`optimizer_bytes`, AdamW's reads and writes (and, for 8- and 4-bit
  states, their dequantisation and quantisation).
* ``n_ops``: the operators a step runs, recorded once for a tiny model of the same structure
  (:func:`step_ops`, :data:`OP_COUNTS`); ``c`` each one's fixed cost; ``r`` what
  ``torch.utils.checkpoint`` costs per region beyond the operators it reruns (measured only; 0
  on a datasheet).

Where the figures come from (:class:`DeviceSpeed`, its ``basis``): a GPU preset uses its datasheet
(:data:`course_lib.device.GPUS`) and the assumed :data:`UTILISATION` and :data:`OP_SECONDS`;
this kernel's device is measured (:func:`measure_speed`: a matmul, a copy, and a tiny model's
operators, timed through :func:`course_lib.measurement.timing.step_times`), once per process
(:func:`device_speed`). ``tests/test_time_model.py`` compares the model with measured CPU steps.
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
from course_lib.model.gpt import GPTConfig, check_config, gpt_param_count, param_numels
from course_lib.model.kernels import adamw_foreach, attention_kernel
from course_lib.prediction import checkpointed
from course_lib.prediction.engine import precision_of
from course_lib.prediction.step_setup import build
from course_lib.training import checkpointing as ckpt
from course_lib.training.loop import make_grad_scaler
from course_lib.units import dtype_bytes
from course_lib.validation import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_COUNT,
    boolean,
    choice,
    device as as_device,
    integer,
    number,
    optional_positive_int,
    positive_int,
)

#: Fraction of the datasheet's peak FLOP/s that a training step's matmuls reach on a GPU
#: preset's 16-bit tensor cores. An assumption, not a measurement: the best published model
#: FLOPs utilisations are 46.2 % (PaLM 540B on TPU v4, Chowdhery et al. 2022) and 52 % of the
#: A100's peak (a 175B GPT on 3072 A100s, Narayanan et al. 2021, "Efficient Large-Scale Language
#: Model Training on GPU Clusters Using Megatron-LM"); one GPU training a GPT-2-sized model in
#: eager PyTorch reaches less, so 40 %. On this kernel's device the rate is measured instead.
UTILISATION = 0.4
#: The same for fp32 matmuls on CUDA cores (no tensor cores: PyTorch leaves TF32 off for
#: matmuls). An assumption: cuBLAS's SGEMM runs large square matrices near its peak, and CUDA
#: cores are far easier to keep fed than tensor cores (8 to 16 times fewer FLOPs per byte
#: loaded), so a step's smaller matmuls reach 70 %.
FP32_UTILISATION = 0.7
#: Seconds each operator costs on a GPU whatever its size. An assumption for the presets, not a
#: measurement: PyTorch's eager dispatch on the CPU plus one kernel launch, which alone costs a
#: few microseconds (NVIDIA, "Getting Started with CUDA Graphs", 2019), of the order of 10
#: microseconds together. :func:`measure_speed` measures it on this kernel's device.
OP_SECONDS = 10e-6
#: Host memory bandwidth (bytes/s) for an optimizer step offloaded to the CPU. An assumption:
#: two channels of DDR5-4800 peak at 76.8 GB/s (JEDEC JESD79-5), and a stream of reads and
#: writes reaches about two thirds of it.
HOST_BANDWIDTH = 50e9
#: Passes over the saved activations' bytes that pointwise work makes. An assumption from how
#: an eager step runs: forward, each pointwise op writes its output and the next op reads it (2);
#: backward, its gradient reads the saved tensor and the incoming gradient and writes the
#: outgoing one (3). Lecture 05's companion splits a measured step by kernel class.
FORWARD_PASSES, BACKWARD_PASSES = 2, 3
#: Bytes AdamW reads and writes per parameter per value of ``s`` bytes: the weight, the gradient,
#: ``m`` and ``v`` read, the weight, ``m`` and ``v`` written.
ADAMW_VALUES = 7

#: The checkpointing modes whose operators :func:`step_ops` counts (every block alike).
CHECKPOINTING = ("none", "blocks", "selective", "attention")
#: The bases of a :class:`DeviceSpeed`: measured here, or read from a datasheet.
BASES = ("from rates measured on this device", "from the datasheet")


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
        for name in ("host_link", "peer_link"):
            if getattr(self, name) is not None:
                number(name, getattr(self, name), above=0.0, maximum=MAX_BANDWIDTH)
        if self.utilisation is not None:
            number("utilisation", self.utilisation, above=0.0, maximum=1.0)

    @property
    def basis(self) -> str:
        """Where the figures come from, one of :data:`BASES`."""
        return BASES[0] if self.measured else BASES[1]

    def reached(self, dtype: torch.dtype) -> float:
        """The share of ``dtype``'s matmul rate a step reaches: ``utilisation`` if set; else 1
        when measured, and on a datasheet :data:`FP32_UTILISATION` at the fp32 rate (a T4's
        bf16 too), :data:`UTILISATION` on tensor cores."""
        if self.utilisation is not None:
            return self.utilisation
        if self.measured:
            return 1.0
        return FP32_UTILISATION if self.flops(dtype) <= self.fp32_flops else UTILISATION

    def flops(self, dtype: torch.dtype) -> float:
        """FLOP/s of a matmul in ``dtype`` (fp32, fp16 or bf16)."""
        rates = {torch.float32: self.fp32_flops, torch.float16: self.fp16_flops,
                 torch.bfloat16: self.bf16_flops}
        if dtype not in rates:
            raise ValueError(f"dtype must be one of {list(rates)}, got {dtype!r}")
        return rates[dtype]

    def checkpoint_seconds(self, mode: str) -> float:
        """Seconds per checkpointed region and micro-batch in ``mode`` (0 where unknown);
        ``sqrt`` segments cost as ``blocks`` regions do."""
        return dict(self.region_seconds).get("blocks" if mode == "sqrt" else mode, 0.0)


# --------------------------------------------------------------------------- the figures


def _preset_of(gpu: GPU) -> GPU | None:
    """The preset whose datasheet a live card shares: same chip in its name, closest memory."""
    chips = [name for name in ("H200", "H100", "A100", "L4", "T4") if name in gpu.name]
    same = [p for p in GPUS.values() if chips and p.name.startswith(chips[0])]
    return min(same, key=lambda p: abs(p.total_memory - gpu.total_memory)) if same else None


def datasheet_speed(gpu, *, op_seconds: float = OP_SECONDS) -> DeviceSpeed:
    """The datasheet :class:`DeviceSpeed` of a GPU (``basis`` "datasheet"): peak FLOP/s per dtype
    (:meth:`course_lib.device.GPU.peak_flops`), bandwidth and links of
    :data:`course_lib.device.GPUS`."""
    card = resolve_gpu(gpu)
    if card is None:
        raise ValueError("gpu must name a GPU: the CPU has no datasheet here, measure it with "
                         "measure_speed('cpu')")
    sheet = card if card.tensor_flops else _preset_of(card)
    if sheet is None or not sheet.tensor_flops:
        raise ValueError(f"gpu {card.name!r} has no datasheet speeds and no preset of the same "
                         f"chip among {list(GPUS)}: measure it with measure_speed('cuda')")
    op_seconds = number("op_seconds", op_seconds, above=0, maximum=1)
    bf16 = sheet.tensor_flops if card.has_native_bf16 else sheet.fp32_flops
    return DeviceSpeed(card.name, sheet.fp32_flops, sheet.tensor_flops, bf16,
                       sheet.memory_bandwidth, op_seconds, False, sheet.datasheet,
                       host_link=sheet.host_link, peer_link=sheet.peer_link)


def _median_seconds(steps: dict, repeats: int, device: torch.device) -> dict:
    """Median seconds of each step, interleaved (:func:`course_lib.measurement.timing.step_times`):
    the process's CPU time on the CPU (steadier on a shared machine), the wall clock on a GPU."""
    return step_times(steps, repeats=repeats, device=device).median("auto")


def measure_speed(device: torch.device | str = "cpu", *, matmul_size: int | None = None,
                  repeats: int = 5) -> DeviceSpeed:
    """This kernel's device, measured: the :class:`DeviceSpeed` (its ``basis`` the first of :data:`BASES`).

    Each figure is the median of ``repeats`` interleaved runs of
    :func:`course_lib.measurement.timing.step_times` (process CPU time on the CPU, wall clock on a GPU):

    * matmul FLOP/s per dtype: ``2 n^3`` over the time of an ``n x n`` matmul (``n`` 256 on the
      CPU, 4096 on a GPU);
    * bandwidth: the bytes read and written by a GELU over 4 MiB (CPU) or 256 MiB (GPU) of fp32,
      the typical pointwise op of a step (one read and one write per element and a little
      arithmetic: at the memory bandwidth on a GPU; on a CPU the arithmetic costs too, which a
      plain copy, twice as fast there, would miss);
    * operator seconds: one training step (AdamW) of a tiny course GPT (1 sequence of 8 tokens,
      width 8, 2 layers), whose FLOPs and bytes are negligible, over the operators it runs
      (:func:`step_ops`): an empty operator's launch and dispatch as a training step pays it
      (autograd included, which a bare ``torch.add`` would leave out);
    * per mode, a checkpointed region's own cost: the tiny step with every block checkpointed,
      minus the plain step and its extra operators, per region.

    About two seconds on a CPU. Links are the preset's of the same chip, if any (a CPU has none).

    Args:
        device (str or torch.device): a cpu or cuda device.
        matmul_size (int, optional): ``n`` of the timed matmul, from 16 to 16384.
        repeats (int): rounds of each timing, from 1 to 100.

    Returns:
        DeviceSpeed: with ``measured=True``.

    Raises:
        ValueError: naming the parameter: a device other than cpu or cuda, a bad ``repeats`` or
            ``matmul_size``.
    """
    device = as_device("device", device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a cpu or cuda device, got {device}")
    repeats = positive_int("repeats", repeats, maximum=100)
    n = (integer("matmul_size", matmul_size, minimum=16, maximum=16384) if matmul_size is not None
         else 4096 if device.type == "cuda" else 256)
    mats = {dtype: torch.randn(n, n, device=device).to(dtype)
            for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    times = _median_seconds({str(d): (lambda a=a: a @ a) for d, a in mats.items()}, repeats,
                            device)
    rates = {d: 2 * n**3 / times[str(d)] for d in mats}
    block = torch.randn((64 if device.type == "cuda" else 1) * 2**20, device=device)
    gelu = {"gelu": lambda: torch.nn.functional.gelu(block)}
    bandwidth = 2 * block.nbytes / _median_seconds(gelu, repeats, device)["gelu"]
    tiny = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=2)
    steps = {mode: _tiny_steps(tiny, mode, "fp32", device)[1] for mode in CHECKPOINTING}
    tiny_times = _median_seconds(steps, repeats, device)
    plain = tiny_times["none"]
    # the tiny steps ran PyTorch's default AdamW: foreach on a GPU, per tensor on the CPU
    foreach = adamw_foreach(resolve_gpu("cuda") if device.type == "cuda" else None)
    ops = {mode: sum(step_ops(tiny, mode, foreach=foreach)) for mode in CHECKPOINTING}
    op_seconds = plain / ops["none"]
    regions = tuple(
        (mode, max(0.0, (tiny_times[mode] - plain - (ops[mode] - ops["none"]) * op_seconds)
                   / tiny.n_layers))
        for mode in CHECKPOINTING[1:])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    links = (None, None)
    if device.type == "cuda":
        sheet = _preset_of(resolve_gpu("cuda"))
        links = (sheet.host_link, sheet.peer_link) if sheet else (None, None)
    return DeviceSpeed(name, rates[torch.float32], rates[torch.float16], rates[torch.bfloat16],
                       bandwidth, op_seconds, True,
                       f"measured on {device}: {n}x{n} matmuls, a GELU, a tiny GPT's steps",
                       regions, *links)


@functools.lru_cache(maxsize=8)
def _measured(device_type: str, threads: int) -> DeviceSpeed:
    """This device measured once per process and thread count (on the CPU, a step's speed and
    its process time depend on the threads ``torch.set_num_threads`` allows)."""
    return measure_speed(device_type)


def device_speed(gpu=None) -> DeviceSpeed:
    """The :class:`DeviceSpeed` a prediction for ``gpu`` uses: a datasheet, or this device measured.

    A preset (or a :class:`course_lib.device.GPU` that is not live) is read from its datasheet
    (:func:`datasheet_speed`); the CPU (None, "cpu") and this kernel's GPU ("cuda", a live card)
    are measured once per process (:func:`measure_speed`) and the figures kept (on the CPU, once
    per number of threads).

    Args:
        gpu (str or GPU, optional): None or "cpu", a name of :data:`course_lib.device.GPUS`,
            "cuda", or a ``GPU``.

    Returns:
        DeviceSpeed: its ``basis`` says which.

    Raises:
        ValueError: as :func:`course_lib.device.resolve_gpu` and :func:`datasheet_speed` do.

    Example:
        >>> device_speed("T4").basis
        'from the datasheet'
    """
    card = resolve_gpu(gpu)
    if card is None:
        return _measured("cpu", torch.get_num_threads())
    if card.live:
        return _measured("cuda", 1)
    return datasheet_speed(card)


# --------------------------------------------------------------------------- the counts


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
    """One optimizer step of ``K`` micro-batches of one sequence, for ``K`` of 1 and 2, as a
    training script runs it (forward, ``loss / K``, backward, the optimizer's step), on one
    model and optimizer."""
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
    """``(per micro-batch, per optimizer step)`` operators of a tiny GPT of this structure,
    counted on the CPU after a first step: what :data:`OP_COUNTS` records."""
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


def step_ops(config: GPTConfig, mode: str = "none", precision: str = "fp32", *,
             foreach: bool = False) -> tuple[int, int]:
    """Operators one step of ``GPT(config)`` runs: ``(per micro-batch, per optimizer step)``.

    Read from :data:`OP_COUNTS`: counted on a tiny model of the same structure with 1 and 2
    micro-batches and 1 and 2 layers (both linear in layers; widths and batches change
    nothing), AdamW per tensor or multi-tensor as ``foreach`` says.

    Example:
        >>> step_ops(GPTConfig(n_layers=4))[0] > step_ops(GPTConfig(n_layers=2))[0]
        True
    """
    check_config(config)
    choice("mode", mode, CHECKPOINTING)
    precision_of(precision)
    return _step_ops(config, mode, precision, boolean("foreach", foreach))


def _step_ops(config: GPTConfig, mode: str, precision: str, foreach: bool) -> tuple[int, int]:
    key = (config.dropout > 0, config.attention, config.bias, mode, precision, foreach)
    one, two = (OP_COUNTS["counts"][op_count_key(n, *key)] for n in (1, 2))
    L = config.n_layers
    return tuple(a + (L - 1) * (b - a) for a, b in zip(one, two))


def _counted(mode: str) -> str:
    """The mode whose operators :func:`step_time` counts for ``mode``: ``sqrt`` segments rerun
    whole blocks, as ``blocks`` does."""
    return "blocks" if mode == "sqrt" else mode


def matmul_flops(config: GPTConfig, micro_batch_size: int, mode: str = "none", every: int = 1, *,
                 seq_len: int | None = None, precision: str = "fp32", gpu=None) -> tuple[int, int]:
    """``(flops, recomputed)`` of one micro-batch's forward, backward and recomputation
    (:func:`course_lib.prediction.checkpointed.step_flops`, 2 FLOPs per multiply-add); on the
    CPU the flash kernel's attention is counted as on a GPU (``FlopCounterMode`` counts it 0)."""
    check_config(config)
    positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    return _matmul_flops(config, micro_batch_size, mode, every, seq_len, precision_of(precision),
                         resolve_gpu(gpu))


def _matmul_flops(config, b, mode, every, seq_len, spec, card) -> tuple[int, int]:
    if card is None and attention_kernel(config, spec.compute, None) == "flash":
        card = GPUS["A100 80GB"]
    return checkpointed.step_flops(config, b, mode, every, seq_len=seq_len,
                                   dtype=spec.compute, gpu=card, autocast=spec.autocast)


def pointwise_bytes(config: GPTConfig, micro_batch_size: int, mode: str = "none",
                    every: int = 1, *, seq_len: int | None = None, precision: str = "fp32",
                    gpu=None) -> int:
    """Bytes the pointwise work of one micro-batch moves: forward, backward and recomputation.

    ``(FORWARD_PASSES + BACKWARD_PASSES) A + FORWARD_PASSES (A - A_mode)``: ``A`` the bytes a
    plain step saves, ``A_mode`` those ``mode`` keeps
    (:func:`course_lib.prediction.checkpointed.predict_kept_bytes`), in the compute dtype;
    :data:`FORWARD_PASSES`, :data:`BACKWARD_PASSES` are an assumption.
    """
    check_config(config)
    positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    return _pointwise_bytes(config, micro_batch_size, mode, every, seq_len,
                            precision_of(precision), resolve_gpu(gpu))


def _pointwise_bytes(config, b, mode, every, seq_len, spec, card) -> int:
    kw = dict(seq_len=seq_len, dtype=spec.compute, gpu=card, autocast=spec.autocast)
    plain = checkpointed.predict_kept_bytes(config, b, "none", 1, **kw)
    kept = plain if mode == "none" else checkpointed.predict_kept_bytes(config, b, mode, every,
                                                                        **kw)
    return (FORWARD_PASSES + BACKWARD_PASSES) * plain + FORWARD_PASSES * max(0, plain - kept)


def optimizer_bytes(n_params: int, precision: str = "fp32", state_bits: int = 32) -> int:
    """Bytes one AdamW step over ``n_params`` parameters reads and writes.

    ``7 s`` per parameter (:data:`ADAMW_VALUES`; ``s`` bytes per state value: 4 in fp32, 2 in
    pure bf16), plus ``2e + 8`` with fp32 master weights (40 B in fp16/bf16-mixed); 8- and
    4-bit states replace each state's ``2 s`` by :func:`low_bit_bytes_moved`.
    """
    spec = precision_of(precision)
    n = positive_int("n_params", n_params, maximum=MAX_COUNT)
    s, e = dtype_bytes(spec.state), dtype_bytes(spec.params)
    per = ADAMW_VALUES * s + (2 * e + 8 if spec.master else 0)
    if _bits(state_bits) != 32:  # two states, each 2 s in the plain count
        per += 2 * (low_bit_bytes_moved(state_bits) - 2 * s)
    return n * per


def _bits(state_bits) -> int:
    if isinstance(state_bits, bool) or state_bits not in (32, 8, 4):
        raise ValueError(f"state_bits must be one of (32, 8, 4), got {state_bits!r}")
    return state_bits


def low_bit_bytes_moved(state_bits: int) -> int:
    """Bytes the eager 8-/4-bit AdamW step moves per value of one state (``m`` or ``v``).

    Counted from torchao's step (``torchao/optim/quant_utils.py``): dequantise ``bits/8`` + 4,
    update 8, scale 12, ``bits`` search rounds of 40 (an estimate), round about 60; an upper
    bound where the compiled step fuses them.
    """
    if _bits(state_bits) == 32:
        raise ValueError("state_bits must be 8 or 4 here, got 32")
    return -(-state_bits // 8) + 4 + 8 + 12 + 40 * state_bits + 60


#: Operators per quantised tensor and state of the eager low-bit step: five per binary-search
#: round (an add, a gather, a compare, a where, an add), about 25 more to dequantise, scale,
#: round and update (counted from torchao 0.18's ``quant_utils``; an estimate).
LOW_BIT_OPS_PER_ROUND, LOW_BIT_OPS = 5, 25
#: torchao quantises a state tensor of at least this many elements (bitsandbytes' rule).
LOW_BIT_MIN_NUMEL = 4096


def transfer_seconds(nbytes: int, bytes_per_second: float) -> float:
    """Seconds to move ``nbytes`` over a link of ``bytes_per_second``: ``nbytes / bandwidth``.

    A lower bound: real copies reach less than a link's theoretical rate, from pinned memory,
    and less still from pageable memory (the driver stages them through a pinned buffer).

    Args:
        nbytes (int): bytes, from 0 to :data:`course_lib.validation.MAX_BYTES`.
        bytes_per_second (float): the link's bandwidth, a finite positive number.

    Returns:
        float: seconds.

    Raises:
        ValueError: ``nbytes`` negative, not an int or above
            :data:`course_lib.validation.MAX_BYTES`; ``bytes_per_second`` not a finite
            positive number.

    Example:
        >>> transfer_seconds(63_000_000_000, 63e9)  # a PCIe 5.0 x16 link for a second
        1.0
    """
    nbytes = integer("nbytes", nbytes, minimum=0, maximum=MAX_BYTES)  # numpy's ints too
    return nbytes / number("bytes_per_second", bytes_per_second, above=0.0)


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class StepTime:
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
        """Where the figures come from, one of :data:`BASES`."""
        return self.speed.basis


def step_time(config: GPTConfig, micro_batch_size: int, accumulation_steps: int = 1, *,
              mode: str = "none", every: int = 1, precision: str = "fp32",
              seq_len: int | None = None, gpu=None, speed: DeviceSpeed | None = None,
              utilisation: float | None = None, state_bits: int = 32,
              offload_activations: bool = False, offload_optimizer: bool = False,
              trained_params: int | None = None, extra_flops: int = 0, zero_stage: int = 0,
              world_size: int = 1) -> StepTime:
    """Predicted seconds of one optimizer step of ``K`` micro-batches of ``b`` sequences.

    The sum of five terms (module doc): ``K`` micro-batches' :func:`matmul_flops` over
    ``u R[compute dtype]``; their :func:`pointwise_bytes` over the bandwidth ``W``; their
    operators (:func:`step_ops`) at ``c`` each plus ``r`` per region; the optimizer's
    :func:`optimizer_bytes` over ``W`` (:data:`HOST_BANDWIDTH` offloaded) and its operators;
    link transfers (offloading, ZeRO), none overlapped (an upper bound).

    Keyword Args:
        mode (str): the checkpointing mode (:data:`course_lib.training.checkpointing.MODES`).
        every (int): its stride.
        precision (str): one of :data:`course_lib.prediction.engine.PRECISIONS`.
        seq_len (int, optional): tokens per sequence, at most ``config.seq_len``.
        gpu (str or GPU, optional): where it runs: None/"cpu", a preset name, a ``GPU``, "cuda".
        speed (DeviceSpeed, optional): the figures; default :func:`device_speed` of ``gpu``.
        utilisation (float, optional): ``u`` in (0, 1]; default ``speed.reached(compute dtype)``.
        state_bits (int): bits per optimizer state value: 32, 8 or 4. Below 32, each state
            tensor of at least :data:`LOW_BIT_MIN_NUMEL` elements adds the eager quantisation's
            operators: :data:`LOW_BIT_OPS_PER_ROUND` per bit and :data:`LOW_BIT_OPS`.
        offload_activations (bool): saved activations go to the host and back.
        offload_optimizer (bool): the optimizer steps on the host.
        trained_params (int, optional): parameters the optimizer steps (None: all; fewer with
            LoRA).
        extra_flops (int): FLOPs beyond the step's own (a chunked loss's second head matmul; LoRA's
            adapters less the frozen weights' gradients), any int as long as the total stays > 0.
        zero_stage (int): 0 to 3.
        world_size (int): GPUs of ZeRO, from 1 to 4096.

    Example:
        >>> t4 = step_time(GPTConfig(n_layers=2), 4, gpu="T4")
        >>> t4.basis, t4.seconds > t4.compute_seconds
        ('from the datasheet', True)
    """
    check_config(config)
    b = positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)
    K = positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    choice("mode", mode, ckpt.MODES)
    every = positive_int("every", every, maximum=MAX_COUNT)
    spec = precision_of(precision)
    seq_len = optional_positive_int("seq_len", seq_len, maximum=config.seq_len)
    if speed is None:
        speed = device_speed(gpu)
    elif not isinstance(speed, DeviceSpeed):
        raise ValueError(f"speed must be a DeviceSpeed or None, got {type(speed).__name__}")
    u = speed.reached(spec.compute) if utilisation is None else number("utilisation", utilisation, above=0,
                                                         maximum=1)
    for name, value in (("offload_activations", offload_activations),
                        ("offload_optimizer", offload_optimizer)):
        boolean(name, value)
    _bits(state_bits)
    P = gpt_param_count(config)
    trained = P if trained_params is None else positive_int("trained_params", trained_params,
                                                             maximum=MAX_COUNT)
    extra_flops = integer("extra_flops", extra_flops, minimum=-(2**62), maximum=2**62)
    zero_stage = integer("zero_stage", zero_stage, minimum=0, maximum=3)
    N = positive_int("world_size", world_size, maximum=4096)
    return _step_time(config, b, K, mode, every, precision, seq_len, resolve_gpu(gpu), speed,
                      u, state_bits, offload_activations, offload_optimizer, trained, P,
                      extra_flops, zero_stage, N)


@functools.lru_cache(maxsize=1024)
def _step_time(config, b, K, mode, every, precision, seq_len, gpu, speed, u, state_bits,
               offload_activations, offload_optimizer, trained, P, extra_flops, zero_stage,
               N) -> StepTime:
    """:func:`step_time` of checked arguments, cached: widgets call it on every slider move."""
    spec = precision_of(precision)
    L = config.n_layers
    flops, recomputed = _matmul_flops(config, b, mode, every, seq_len, spec, gpu)
    flops = K * flops + extra_flops
    if flops <= 0:
        raise ValueError(f"extra_flops must leave the step's FLOPs positive, got {extra_flops}")
    moved = K * _pointwise_bytes(config, b, mode, every, seq_len, spec, gpu)
    # operators: every block runs the same ones, so a mode checkpointing some blocks reruns
    # its per-block extra in those only; ``sqrt`` segments rerun whole blocks
    regions = ckpt.checkpointed_regions(L, mode, every)
    counted = _counted(mode)
    foreach = adamw_foreach(gpu)
    per_micro, per_step = _step_ops(config, "none", precision, foreach)
    if mode != "none":
        extra_ops = _step_ops(config, counted, precision, foreach)[0] - per_micro
        per_micro += round(extra_ops * sum(len(r) for r in regions) / L)
    launch = K * (per_micro * speed.op_seconds + len(regions) * speed.checkpoint_seconds(mode))
    shard = N if zero_stage >= 1 else 1
    opt_bytes = -(-optimizer_bytes(trained, precision, state_bits) // shard)
    if state_bits != 32:  # the eager quantisation's operators, per large state tensor
        tensors = (sum(n >= LOW_BIT_MIN_NUMEL for n in param_numels(config)) if trained == P
                   else 8 * L)  # LoRA: A and B beside each of a block's four linears
        per_step += 2 * tensors * (LOW_BIT_OPS_PER_ROUND * state_bits + LOW_BIT_OPS)
    opt_seconds = per_step * speed.op_seconds + (
        opt_bytes / (HOST_BANDWIDTH if offload_optimizer and speed.host_link else
                     speed.memory_bandwidth))
    link = 0.0
    pb = dtype_bytes(spec.params)
    if speed.host_link:  # a GPU: what leaves it crosses the host link
        if offload_activations:
            kept = checkpointed.predict_kept_bytes(config, b, mode, every, seq_len=seq_len,
                                           dtype=spec.compute, gpu=gpu, autocast=spec.autocast)
            link += transfer_seconds(2 * K * kept, speed.host_link)
        if offload_optimizer:
            link += transfer_seconds(2 * trained * pb, speed.host_link)
    if zero_stage and speed.peer_link:
        link += transfer_seconds((3 if zero_stage == 3 else 2) * P * pb, speed.peer_link)
    return StepTime(flops, K * recomputed, moved, opt_bytes,
                    K * per_micro + per_step,
                    compute_seconds=flops / (speed.flops(spec.compute) * u),
                    pointwise_seconds=moved / speed.memory_bandwidth,
                    launch_seconds=launch, optimizer_seconds=opt_seconds,
                    transfer_seconds=link, speed=speed, utilisation=float(u))


def step_seconds(config: GPTConfig, micro_batch_size: int, accumulation_steps: int = 1,
                 **kwargs) -> float:
    """:func:`step_time`'s ``seconds``: the one number planners compare.

    Args:
        config (GPTConfig): the model.
        micro_batch_size (int): ``b``.
        accumulation_steps (int): ``K``.
        **kwargs: :func:`step_time`'s keywords.

    Returns:
        float: seconds.

    Raises:
        ValueError: as :func:`step_time` does.
    """
    return step_time(config, micro_batch_size, accumulation_steps, **kwargs).seconds


# --------------------------------------------------------------------------- calibration


def calibrate(speed: DeviceSpeed, split, config: GPTConfig, micro_batch_size: int,
              accumulation_steps: int = 1, *, mode: str = "none", every: int = 1,
              precision: str = "fp32", seq_len: int | None = None, gpu=None,
              seconds: float | None = None) -> DeviceSpeed:
    """``speed`` with its matmul rate and memory bandwidth fitted to one measured step's split.

    ``split`` is the :class:`course_lib.measurement.timing.TimeSplit` of a step of this setting
    (:func:`course_lib.measurement.timing.profile_step`). The operators keep
    ``speed.op_seconds``; the matmul rate becomes the step's FLOPs (:func:`matmul_flops`) over
    its "matmul" and "attention" time, the bandwidth the bytes of :func:`pointwise_bytes` and
    :func:`optimizer_bytes` over the other classes' time less the operators' cost (floored at a
    tenth of it). On a busy CPU the profiler's wall times run up to twice too long: pass
    :func:`course_lib.measurement.timing.step_times`' time as ``seconds`` and the split gives
    only the shares. The calibrated model prices the other settings of the same model with the
    rates the step reached (lecture 05's companion compares both with measured steps).

    Args:
        speed (DeviceSpeed): the device's figures (:func:`device_speed`); its operator and
            region costs are kept.
        split (TimeSplit): the measured step, by kernel class.
        config (GPTConfig): the model that ran.
        micro_batch_size (int): ``b`` of that step.
        accumulation_steps (int): ``K`` of that step.
        mode (str): its checkpointing mode (:data:`course_lib.training.checkpointing.MODES`).
        every (int): its stride.
        precision (str): its precision (:data:`course_lib.prediction.engine.PRECISIONS`).
        seq_len (int, optional): its tokens per sequence.
        gpu (str or GPU, optional): whose kernels ran it: None for the CPU's, "cuda" for this
            kernel's GPU (the saved bytes, hence the pointwise bytes, depend on them).
        seconds (float, optional): the step's measured time; None: the split's total.

    Returns:
        DeviceSpeed: measured, with the fitted rate and bandwidth and a ``source`` that says so.

    Raises:
        ValueError: naming ``speed`` or ``split`` (not a DeviceSpeed or a TimeSplit, or a split
            with no matmul or no other time), or a setting :func:`step_time` refuses.

    Example:
        >>> from course_lib.measurement.timing import TimeSplit
        >>> split = TimeSplit({"matmul": 0.02, "attention": 0.0, "fused kernel": 0.0,
        ...                    "other pointwise": 0.05, "optimizer": 0.01}, "cpu")
        >>> cpu = datasheet_speed("T4")
        >>> fitted = calibrate(cpu, split, GPTConfig(n_layers=2), 4)
        >>> t = step_time(GPTConfig(n_layers=2), 4, speed=fitted)
        >>> round(t.compute_seconds, 6), round(t.seconds, 6)
        (0.02, 0.08)
    """
    from course_lib.measurement.timing import TimeSplit

    if not isinstance(speed, DeviceSpeed):
        raise ValueError(f"speed must be a DeviceSpeed, got {type(speed).__name__}")
    if not isinstance(split, TimeSplit):
        raise ValueError(f"split must be a TimeSplit (profile_step), got {type(split).__name__}")
    spec = precision_of(precision)
    plain = step_time(config, micro_batch_size, accumulation_steps, mode=mode, every=every,
                      precision=precision, seq_len=seq_len, gpu=gpu, speed=speed,
                      utilisation=1.0)
    by_class = {name: number(f"split.seconds[{name!r}]", split.seconds.get(name, 0.0),
                             minimum=0.0, maximum=1e6) for name in split.seconds}
    matmul = by_class.get("matmul", 0.0) + by_class.get("attention", 0.0)
    rest = sum(by_class.values()) - matmul
    if matmul <= 0 or rest <= 0:
        raise ValueError(f"split must hold matmul and other time, got {split.seconds!r:.120}")
    if seconds is not None:  # the split's shares of the measured time
        scale = number("seconds", seconds, above=0.0, maximum=1e6) / (matmul + rest)
        matmul, rest = matmul * scale, rest * scale
    operators = plain.launch_seconds + (plain.optimizer_seconds
                                        - plain.optimizer_bytes / speed.memory_bandwidth)
    moving = max(rest - operators, rest / 10)
    rate = plain.flops / matmul
    rates = {torch.float32: speed.fp32_flops, torch.float16: speed.fp16_flops,
             torch.bfloat16: speed.bf16_flops}
    rates[spec.compute] = min(rate, MAX_FLOPS)
    return DeviceSpeed(speed.name, rates[torch.float32], rates[torch.float16],
                       rates[torch.bfloat16],
                       min((plain.pointwise_bytes + plain.optimizer_bytes) / moving, MAX_BANDWIDTH),
                       speed.op_seconds, True,
                       f"{speed.source}; rates fitted to a measured {mode} step by kernel class "
                       f"({split.clock} time)", speed.region_seconds, speed.host_link,
                       speed.peer_link, 1.0)


__all__ = ["UTILISATION", "FP32_UTILISATION", "OP_SECONDS", "HOST_BANDWIDTH", "FORWARD_PASSES", "BACKWARD_PASSES",
           "ADAMW_VALUES", "CHECKPOINTING", "BASES", "DeviceSpeed", "datasheet_speed",
           "measure_speed", "device_speed", "calibrate", "step_ops", "matmul_flops",
           "pointwise_bytes", "optimizer_bytes", "low_bit_bytes_moved", "LOW_BIT_OPS_PER_ROUND",
           "LOW_BIT_OPS",
           "LOW_BIT_MIN_NUMEL", "transfer_seconds", "StepTime", "step_time", "step_seconds"]
