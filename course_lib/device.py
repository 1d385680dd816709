"""Which device and which training dtype this kernel should use.

The same notebook runs on a laptop CPU, on Apple silicon (MPS), on Colab's T4 and
on datacenter GPUs. :func:`pick_device` prefers CUDA, then MPS, then the CPU;
:func:`pick_dtype` chooses the 16-bit format for mixed precision:

* CUDA with native bf16 (Ampere and newer: A100, H100, L4): ``torch.bfloat16``.
  bf16 has fp32's exponent range, so no loss scaling is needed.
* CUDA without native bf16 (Turing, e.g. Colab's T4): ``torch.float16`` with a
  ``torch.amp.GradScaler``: fp16's 5-bit exponent underflows small gradients
  unless the loss is scaled up first (Micikevicius et al. 2018, "Mixed Precision
  Training").
* CPU: ``torch.float32``. CPU autocast exists, but the course's CPU runs are there
  to be quick and exact, not to imitate a GPU.
* MPS: ``torch.bfloat16`` where the OS supports it, else ``torch.float16``.

:data:`GPUS` holds the cards learners train on, as :class:`GPU` presets (memory
in bytes as the card reports it, compute capability), so that every prediction
of the course can be made for a T4 or an H100 on a laptop; :func:`live_gpu`
reads the same facts from the GPU of this kernel, and :func:`resolve_gpu` turns
what a learner passes (None, a preset name, "cuda", a ``GPU``) into one of them.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass

import torch

from .units import MiB, as_dtype, format_bytes
from .validation import MAX_BYTES, boolean, device as as_device, integer, number, text

_KINDS = ("cuda", "mps", "cpu")


def _in_colab() -> bool:
    """True inside Google Colab (its ``google.colab`` module is loaded)."""
    return "google.colab" in sys.modules


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def pick_device(prefer: str | None = None) -> torch.device:
    """The best available device: CUDA > MPS > CPU, or ``prefer`` if it is available.

    Asking for a device that this machine lacks raises ``ValueError`` rather than silently
    falling back, so a notebook that needs a GPU says so.

    Args:
        prefer (str, optional): ``"cuda"``, ``"mps"``, ``"cpu"`` or ``None`` (the best one).

    Returns:
        torch.device: ``cuda``, ``mps`` or ``cpu`` (no index).

    Raises:
        ValueError: naming ``prefer``, for another value or a device this machine lacks.

    Example:
        >>> pick_device("cpu")
        device(type='cpu')
    """
    if prefer is not None:
        if not isinstance(prefer, str) or prefer not in _KINDS:
            raise ValueError(f"prefer must be one of {_KINDS} or None, got {prefer!r}")
        available = {"cuda": torch.cuda.is_available(), "mps": _mps_available(), "cpu": True}
        if not available[prefer]:
            raise ValueError(f"prefer={prefer!r} but this machine has no {prefer} device")
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")

#: The largest FLOP/s a :class:`GPU` may state: 1e18 (an H200's dense 16-bit tensor cores do
#: about 1e15).
MAX_FLOPS = 1e18
#: The largest memory bandwidth a :class:`GPU` may state, in bytes/s: 1e15 (an H200: 4.8e12).
MAX_BANDWIDTH = 1e15


@dataclass(frozen=True)
class GPU:
    """A CUDA card as the memory engine sees it.

    The speed fields are optional and come last, so ``GPU(name, total_memory, capability)``
    still builds a card (without them a time prediction needs a measured speed,
    :func:`course_lib.prediction.time_model.measure_speed`).

    Attributes:
        name (str): what the course calls it ("T4", "H100 80GB") or the driver's name for a live
            card.
        total_memory (int): bytes of device memory as PyTorch reports it
            (``torch.cuda.get_device_properties(i).total_memory``, the "total capacity" of an
            out-of-memory message), from 1 to :data:`course_lib.validation.MAX_BYTES`. It is the
            budget every "does it fit" question about a preset is asked against; it is a few
            hundred MiB under ``nvidia-smi``'s "Total" (``smi_memory``), which counts memory the
            driver keeps for itself.
        capability (tuple of int): the compute capability ``(major, minor)``, each 0 to 99: 7.5
            is Turing (T4), 8.0 Ampere (A100), 8.9 Ada (L4), 9.0 Hopper (H100, H200). It decides
            the attention kernel and whether bf16 runs on tensor cores.
        free_memory (int, optional): bytes free when it was read (``torch.cuda.mem_get_info``),
            live cards only; at most ``total_memory``.
        live (bool): True when read from this kernel's GPU (:func:`live_gpu`), False for a preset.
        fp32_flops (float, optional): peak dense fp32 FLOP/s without tensor cores (what fp32
            matmuls get: PyTorch leaves TF32 off for matmuls by default), from the datasheet;
            None if unknown.
        tensor_flops (float, optional): peak dense fp16/bf16 tensor-core FLOP/s, without the 2:4
            sparsity that datasheets quote first (their sparse figure halved); None if unknown.
        memory_bandwidth (float, optional): peak device-memory bandwidth in bytes/s (decimal, as
            quoted).
        datasheet (str, optional): where the figures come from.
        host_link (float, optional): bytes/s per direction between the card and the host (its
            PCIe generation, :data:`PCIE_BYTES_PER_S`): what offloading pays; None if unknown.
        peer_link (float, optional): bytes/s per direction from the card to its peers (NVLink on
            SXM boards, else PCIe): what ZeRO's gathers and reductions pay; None if unknown.
        smi_memory (int, optional): ``nvidia-smi``'s "Total" in bytes (MiB x 2**20), printed
            beside ``total_memory`` because it is the figure learners see first; at least
            ``total_memory``. None for a live card (the driver's tool is not asked).

    Raises:
        ValueError: naming the field, for a non-str ``name`` or ``datasheet``, a ``total_memory``
            that is not a positive int of bytes, a ``capability`` that is not a pair of ints
            from 0 to 99, a ``free_memory`` outside ``[0, total_memory]``, a non-bool ``live``,
            or a speed that is not a positive finite number or None.
    """

    name: str
    total_memory: int
    capability: tuple[int, int]
    free_memory: int | None = None
    live: bool = False
    fp32_flops: float | None = None
    tensor_flops: float | None = None
    memory_bandwidth: float | None = None
    datasheet: str | None = None
    smi_memory: int | None = None
    host_link: float | None = None
    peer_link: float | None = None

    def __post_init__(self):
        text("name", self.name)
        if (not isinstance(self.total_memory, int) or isinstance(self.total_memory, bool)
                or not 1 <= self.total_memory <= MAX_BYTES):
            raise ValueError(f"total_memory must be a positive int of bytes (at most "
                             f"{MAX_BYTES:,}), got {self.total_memory!r}")
        cap = self.capability
        if not (isinstance(cap, tuple) and len(cap) == 2
                and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 99
                        for c in cap)):
            raise ValueError(f"capability must be a (major, minor) pair of ints from 0 to 99, "
                             f"got {cap!r}")
        if self.free_memory is not None:
            integer("free_memory", self.free_memory, minimum=0, maximum=self.total_memory)
        boolean("live", self.live)
        for name, maximum in (("fp32_flops", MAX_FLOPS), ("tensor_flops", MAX_FLOPS),
                              ("memory_bandwidth", MAX_BANDWIDTH), ("host_link", MAX_BANDWIDTH),
                              ("peer_link", MAX_BANDWIDTH)):
            value = getattr(self, name)
            try:
                ok = value is None or 0 < number(name, value) <= maximum
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{name} must be a positive finite number of at most "
                                 f"{maximum:.0e}, or None, got {value!r}")
        if self.datasheet is not None:
            text("datasheet", self.datasheet)
        if self.smi_memory is not None:
            integer("smi_memory", self.smi_memory, minimum=self.total_memory, maximum=MAX_BYTES)

    @property
    def capacity(self) -> int:
        """Bytes a training step may use here: what was free when a live card was read
        (``torch.cuda.mem_get_info``), else the total PyTorch reports. The course's one rule."""
        return self.free_memory if self.live and self.free_memory is not None else self.total_memory

    @property
    def capacity_label(self) -> str:
        """:attr:`capacity` in words, the course's one label for a card's memory line, e.g.
        ``"T4: 14.58 GiB as PyTorch reports it (nvidia-smi: 15,360 MiB)"``."""
        if self.live and self.free_memory is not None:
            return (f"{self.name}: {format_bytes(self.free_memory)} free of "
                    f"{format_bytes(self.total_memory)} as PyTorch reports it")
        smi = "" if self.smi_memory is None else f" (nvidia-smi: {self.smi_memory // MiB:,} MiB)"
        return f"{self.name}: {format_bytes(self.total_memory)} as PyTorch reports it{smi}"

    @property
    def has_native_bf16(self) -> bool:
        """bf16 tensor cores: compute capability 8.0 and newer (not a T4)."""
        return self.capability >= (8, 0)

    def peak_flops(self, dtype) -> float | None:
        """Datasheet peak dense matmul FLOP/s in ``dtype`` (bf16 on a T4 and fp32: the fp32
        rate, as PyTorch leaves TF32 off for matmuls); None where unknown."""
        dtype = as_dtype(dtype)
        if dtype == torch.float16 or (dtype == torch.bfloat16 and self.has_native_bf16):
            return self.tensor_flops
        if dtype in (torch.float32, torch.bfloat16):
            return self.fp32_flops
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")


#: The GPUs learners train on, by the name the widgets show. ``total_memory`` is what PyTorch
#: reports (``get_device_properties().total_memory``, an OOM message's "total capacity"),
#: read from published ``_CudaDeviceProperties`` and OOM messages; it varies by a few tens of
#: MiB with the driver, so the lowest figure seen is kept (a budget too high is an OOM). A
#: Colab T4 reports about 14.58-14.75 GiB against nvidia-smi's 15360 MiB, an A100 80GB about
#: 79.15-79.25 GiB against 81920 MiB, an H100 80GB 79.10-79.11 GiB in its OOM messages against
#: 81559 MiB (80998 MiB prints as 79.10 GiB). On a live card the budget is what
#: ``torch.cuda.mem_get_info()`` says is free (:func:`live_gpu`).
#: Speeds are NVIDIA's datasheet peaks (dense: the tensor figures with 2:4 sparsity halved),
#: SXM boards for the A100, H100 and H200; no run of the course measured them (see
#: :func:`course_lib.prediction.time_model.measure_speed` for this kernel's device). Host links are the
#: boards' PCIe generation (T4: 3.0, L4 and A100: 4.0, H100 and H200: 5.0, all x16, from the same
#: datasheets); peer links NVLink per GPU per direction (A100: 600 GB/s bidirectional, H100 and
#: H200: 900 GB/s), PCIe for the T4 and L4, which have no NVLink.
#: Host links, theoretical bandwidth per direction in bytes per second (PCI-SIG: 8, 16, 32
#: GT/s per lane with 128b/130b encoding, x16): what a pinned-memory copy approaches.
PCIE_BYTES_PER_S = {"PCIe 3.0 x16": 15.75e9, "PCIe 4.0 x16": 31.5e9, "PCIe 5.0 x16": 63.0e9}
_PCIE3, _PCIE4, _PCIE5 = PCIE_BYTES_PER_S.values()
_T4 = "NVIDIA T4 Tensor Core GPU datasheet: FP32 8.1 TFLOPS, mixed FP16 65 TFLOPS, 320 GB/s"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, FP16/BF16 242 TFLOPS with sparsity, 300 GB/s"
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5 TFLOPS, BF16/FP16 312 TFLOPS, "
         "{} GB/s")
_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, BF16/FP16 1,979 TFLOPS "
         "with sparsity, 3.35 TB/s")
_H200 = ("NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67 TFLOPS, BF16/FP16 1,979 TFLOPS "
         "with sparsity, 4.8 TB/s")
#: The GPU presets, by name: memory as PyTorch reports it, capability, datasheet rates and links.
GPUS: dict[str, GPU] = {
    "T4": GPU("T4", 14930 * MiB, (7, 5), fp32_flops=8.1e12, tensor_flops=65e12,
              memory_bandwidth=320e9, datasheet=_T4,
              smi_memory=15360 * MiB, host_link=_PCIE3, peer_link=_PCIE3),
    "L4": GPU("L4", 22563 * MiB, (8, 9), fp32_flops=30.3e12, tensor_flops=121e12,
              memory_bandwidth=300e9, datasheet=_L4,
              smi_memory=23034 * MiB, host_link=_PCIE4, peer_link=_PCIE4),
    "A100 40GB": GPU("A100 40GB", 40536 * MiB, (8, 0), fp32_flops=19.5e12, tensor_flops=312e12,
                     memory_bandwidth=1555e9, datasheet=_A100.format("1,555"),
                     smi_memory=40960 * MiB, host_link=_PCIE4, peer_link=300e9),
    "A100 80GB": GPU("A100 80GB", 81050 * MiB, (8, 0), fp32_flops=19.5e12, tensor_flops=312e12,
                     memory_bandwidth=2039e9, datasheet=_A100.format("2,039"),
                     smi_memory=81920 * MiB, host_link=_PCIE4, peer_link=300e9),
    "H100 80GB": GPU("H100 80GB", 80998 * MiB, (9, 0), fp32_flops=67e12, tensor_flops=989e12,
                     memory_bandwidth=3.35e12, datasheet=_H100,
                     smi_memory=81559 * MiB, host_link=_PCIE5, peer_link=450e9),
    "H200": GPU("H200", 143156 * MiB, (9, 0), fp32_flops=67e12, tensor_flops=989e12,
                memory_bandwidth=4.8e12, datasheet=_H200,
                smi_memory=143771 * MiB, host_link=_PCIE5, peer_link=450e9),
}


def live_gpu(device: torch.device | str | int = "cuda") -> GPU:
    """This kernel's GPU as a :class:`GPU`: name, total and free memory, compute capability.

    The datasheet speeds are not filled in (``None``): the driver does not report them.

    Args:
        device (torch.device or str or int): a CUDA device: ``"cuda"``, ``"cuda:1"``, a
            ``torch.device`` or an index (an int from 0 to 1023).

    Returns:
        GPU: with ``live=True`` and ``free_memory`` read now, in bytes.

    Raises:
        ValueError: naming ``device`` for anything else, or if this machine has no CUDA device.
    """
    device = _cuda_device(device)
    if not torch.cuda.is_available():
        raise ValueError("this machine has no CUDA device; pass a preset of GPUS instead, "
                         f"one of {list(GPUS)}")
    props = torch.cuda.get_device_properties(device)
    free, _ = torch.cuda.mem_get_info(device)
    return GPU(props.name, int(props.total_memory), (props.major, props.minor),
               free_memory=int(free), live=True)


def _cuda_device(device) -> torch.device:
    """``device`` (a CUDA device string, ``torch.device`` or index) as a CUDA ``torch.device``."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{integer('device', device, minimum=0, maximum=1023)}"
    device = as_device("device", device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device ('cuda', 'cuda:0' or an index), "
                         f"got {device}")
    return device


def resolve_gpu(gpu) -> GPU | None:
    """What a prediction runs on: None for the CPU, else a :class:`GPU`.

    Args:
        gpu (str or GPU, optional): None or "cpu" (the CPU's kernels), a name of :data:`GPUS`,
            "cuda" (this kernel's GPU, :func:`live_gpu`), or a :class:`GPU`.

    Returns:
        GPU or None: the card (``gpu`` itself when it is one), or None for the CPU.

    Raises:
        ValueError: for an unknown name, or "cuda" on a machine without CUDA.

    Example:
        >>> resolve_gpu("T4").capability, resolve_gpu("cpu")
        ((7, 5), None)
    """
    if gpu is None or isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, str) and gpu == "cpu":
        return None
    if isinstance(gpu, str) and gpu == "cuda":
        return live_gpu()
    if isinstance(gpu, str) and gpu in GPUS:
        return GPUS[gpu]
    raise ValueError(f"gpu must be None, 'cpu', 'cuda', a GPU or one of {list(GPUS)}, got {gpu!r}")


def _cuda_has_native_bf16(device: torch.device | str = "cuda") -> bool:
    """bf16 tensor cores: compute capability 8.0+ (False on a T4, 7.5, or without CUDA)."""
    device = _cuda_device(device)
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def pick_dtype(device: torch.device | str | GPU) -> torch.dtype:
    """The training dtype for ``device``: bf16 or fp16 on GPUs, fp32 on the CPU (see module doc).

    ``device`` may also be a :class:`GPU` (a preset of :data:`GPUS`): ``GPUS["T4"]`` gives
    ``torch.float16``, Ampere and newer ``torch.bfloat16``; a live CUDA device, by its capability.

    Args:
        device (torch.device or str or GPU): the device to train on, or a card.

    Returns:
        torch.dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.

    Raises:
        ValueError: naming ``device``, for something that is not a device, or a device type
            other than cuda, mps or cpu.

    Example:
        >>> pick_dtype(GPUS["T4"]), pick_dtype(GPUS["A100 80GB"]), pick_dtype("cpu")
        (torch.float16, torch.bfloat16, torch.float32)
    """
    if isinstance(device, GPU):
        return torch.bfloat16 if device.has_native_bf16 else torch.float16
    device = as_device("device", device)
    if device.type == "cuda":
        return torch.bfloat16 if _cuda_has_native_bf16(device) else torch.float16
    if device.type == "mps":
        try:
            torch.ones(1, dtype=torch.bfloat16, device=device)
            return torch.bfloat16
        except (RuntimeError, TypeError):
            return torch.float16
    if device.type == "cpu":
        return torch.float32
    raise ValueError(f"device must be a cuda, mps or cpu device, got {device}")


def needs_grad_scaler(dtype: torch.dtype) -> bool:
    """fp16 training needs loss scaling; bf16 and fp32 do not.

    fp16's 5-bit exponent flushes small gradients to zero unless the loss is scaled up first
    (Micikevicius et al. 2018, "Mixed Precision Training").

    Args:
        dtype (torch.dtype or str): the training dtype or one of its names (``"fp16"``).

    Returns:
        bool: True for ``torch.float16`` only.

    Raises:
        ValueError: naming ``dtype``, as :func:`course_lib.units.as_dtype` does.
    """
    return as_dtype(dtype) == torch.float16


@dataclass(frozen=True)
class Tolerance:
    """How far a measurement on a device may stray from its prediction or from itself.

    The one place where the lectures' checks read their slack, so that a check never stops
    "Run all" on a GPU over noise that the CPU does not have.

    Attributes:
        memory (float): relative excess of a measured peak over the engine's prediction. 0 on
            the CPU, where the live-tensor tracker counts every byte the prediction counts; 5 %
            on CUDA, where the caching allocator rounds blocks to 512 bytes and cuBLAS and the
            kernels take workspaces; 10 % on MPS, whose allocator the engine does not model.
        flat (float): relative spread allowed among peaks that the theory says are equal
            (memory "flat in K"): 1 % on the CPU, 5 % on a GPU.
        deterministic (bool): whether two identical runs give bitwise equal results. True on
            the CPU; False on CUDA and MPS, where atomics in some backward kernels (flash
            attention's among them) add in a different order each run. Where it is False,
            compare a run with a plain rerun of itself, not with a bitwise equality.
    """

    memory: float
    flat: float
    deterministic: bool


_TOLERANCES = {"cpu": Tolerance(0.0, 0.01, True), "cuda": Tolerance(0.05, 0.05, False),
               "mps": Tolerance(0.10, 0.05, False)}


def tolerance(device: torch.device | str) -> Tolerance:
    """The slack a lecture's checks allow on ``device`` (see :class:`Tolerance`).

    Args:
        device (torch.device or str): where the measurement ran (``"cpu"``, ``"cuda:0"``,
            ``"mps"``).

    Returns:
        Tolerance: the memory, flatness and determinism rules of that kind of device.

    Raises:
        ValueError: naming ``device``, for anything but a CPU, CUDA or MPS device.

    Example:
        >>> tolerance("cpu")
        Tolerance(memory=0.0, flat=0.01, deterministic=True)
        >>> tolerance("cuda:0").memory
        0.05
    """
    kind = as_device("device", device).type
    if kind not in _TOLERANCES:
        raise ValueError(f"device must be a cpu, cuda or mps device, got {device!r}")
    return _TOLERANCES[kind]


@dataclass(frozen=True)
class DeviceInfo:
    """What :func:`describe` found: the device, its training dtype (:func:`pick_dtype`), whether
    that needs a ``GradScaler``, its name, its memory in bytes (CUDA only) and versions."""

    device: torch.device
    dtype: torch.dtype
    grad_scaler: bool
    name: str
    total_memory: int | None
    in_colab: bool
    torch_version: str

    def summary(self) -> str:
        """The six lines :func:`print_summary` prints (device, memory, dtype, versions)."""
        mem = format_bytes(self.total_memory) if self.total_memory else "n/a (host memory)"
        dtype = str(self.dtype).replace("torch.", "")
        scaler = " with GradScaler" if self.grad_scaler else ""
        lines = [
            f"device        : {self.device} ({self.name})",
            f"device memory : {mem}",
            f"training dtype: {dtype}{scaler}",
            f"torch         : {self.torch_version}",
            f"python        : {platform.python_version()}",
            f"running in    : {'Google Colab' if self.in_colab else 'local Jupyter / Python'}",
        ]
        return "\n".join(lines)


def describe(device: torch.device | str | None = None) -> DeviceInfo:
    """A :class:`DeviceInfo` for ``device`` (default: :func:`pick_device`)."""
    device = pick_device() if device is None else as_device("device", device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but this machine has no CUDA device")
    if device.type not in _KINDS:
        raise ValueError(f"device must be a cuda, mps or cpu device, got {device}")
    dtype = pick_dtype(device)
    total = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total = props.name, int(props.total_memory)
    elif device.type == "mps":
        name = "Apple GPU (MPS)"
    else:
        name = platform.processor() or platform.machine() or "CPU"
    return DeviceInfo(
        device=device,
        dtype=dtype,
        grad_scaler=needs_grad_scaler(dtype),
        name=name,
        total_memory=total,
        in_colab=_in_colab(),
        torch_version=torch.__version__,
    )


def print_summary(device: torch.device | str | None = None) -> DeviceInfo:
    """Print the one-screen summary of :func:`describe` and return the info.

    Args:
        device (torch.device or str, optional): as for :func:`describe`.

    Returns:
        DeviceInfo: what was printed.

    Raises:
        ValueError: as :func:`describe` does.
    """
    info = describe(device)
    print(info.summary())
    return info
