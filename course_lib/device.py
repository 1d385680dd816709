"""Which device and which training dtype this kernel should use; the GPU presets.

:func:`pick_device` prefers CUDA, then MPS, then the CPU. :func:`pick_dtype` picks bf16 on GPUs
with native bf16 (Ampere and newer, and MPS where the OS supports it), fp16 with a
``GradScaler`` on older ones such as Colab's T4 (Micikevicius et al. 2018, "Mixed Precision
Training"), and fp32 on the CPU, whose runs are there to be quick and exact. :data:`GPUS` holds
the cards learners train on, so that every prediction can be made for a T4 or an H100 on a
laptop; :func:`live_gpu` reads the same facts from this kernel's GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .units import MiB, as_dtype, format_bytes
from .validation import MAX_BYTES, boolean, device as as_device, integer, number, text

_KINDS = ("cuda", "mps", "cpu")


def _mps_available() -> bool:
    """Whether this PyTorch has an MPS backend and the machine has its GPU."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def pick_device(prefer: str | None = None) -> torch.device:
    """The best available device: CUDA > MPS > CPU, or ``prefer`` if this machine has it.

    A device this machine lacks raises ``ValueError`` rather than falling back silently, so a
    notebook that needs a GPU says so.

    Args:
        prefer (str, optional): ``"cuda"``, ``"mps"``, ``"cpu"`` or ``None`` (the best one).

    Returns:
        torch.device: ``cuda``, ``mps`` or ``cpu`` (no index).
    Raises:
        ValueError: for a ``prefer`` not listed, or a device this machine lacks.

    Example:
        >>> pick_device("cpu")
        device(type='cpu')
    """
    if prefer is not None:
        if not isinstance(prefer, str) or prefer not in _KINDS:
            raise ValueError(f"prefer must be one of {_KINDS} or None, got {prefer!r}")
        if not {"cuda": torch.cuda.is_available(), "mps": _mps_available(), "cpu": True}[prefer]:
            raise ValueError(f"prefer={prefer!r} but this machine has no {prefer} device")
        return torch.device(prefer)
    return torch.device("cuda" if torch.cuda.is_available()
                        else "mps" if _mps_available() else "cpu")


#: The largest FLOP/s a :class:`GPU` may state (an H200's dense 16-bit tensor cores: about 1e15).
MAX_FLOPS = 1e18
#: The largest memory bandwidth a :class:`GPU` may state, in bytes/s (an H200: 4.8e12).
MAX_BANDWIDTH = 1e15


@dataclass(frozen=True)
class GPU:
    """A CUDA card as the memory engine and the time model see it.

    Attributes:
        name (str): what the course calls it ("T4", "H100 80GB"), or the driver's name.
        total_memory (int): bytes as PyTorch reports them (``get_device_properties().total_memory``,
            an OOM message's "total capacity"): the budget of every "does it fit" question, a
            few hundred MiB under ``nvidia-smi``'s "Total", which counts the driver's own memory.
        capability (tuple of int): ``(major, minor)``, each 0 to 99: 7.5 Turing (T4), 8.0 Ampere
            (A100), 8.9 Ada (L4), 9.0 Hopper. It decides the attention kernel and bf16's speed.
        free_memory (int, optional): bytes free when a live card was read (``mem_get_info``).
        live (bool): True when read from this kernel's GPU (:func:`live_gpu`).
        fp32_flops (float, optional): datasheet peak dense fp32 FLOP/s without tensor cores (PyTorch
            leaves TF32 off for matmuls by default).
        tensor_flops (float, optional): datasheet peak dense fp16/bf16 tensor-core FLOP/s.
        memory_bandwidth (float, optional): peak device-memory bandwidth, bytes/s (decimal).
        smi_memory (int, optional): ``nvidia-smi``'s "Total" in bytes, the figure learners see
            first; at least ``total_memory``; None for a live card.
        host_link (float, optional): bytes/s per direction to the host (its PCIe generation,
            :data:`PCIE_BYTES_PER_S`): what offloading pays.
        peer_link (float, optional): bytes/s per direction to its peers (NVLink, else PCIe): what
            ZeRO's gathers and reductions pay.
    """

    name: str
    total_memory: int
    capability: tuple[int, int]
    free_memory: int | None = None
    live: bool = False
    fp32_flops: float | None = None
    tensor_flops: float | None = None
    memory_bandwidth: float | None = None
    smi_memory: int | None = None
    host_link: float | None = None
    peer_link: float | None = None

    def __post_init__(self):
        text("name", self.name)
        if type(self.total_memory) is not int or not 1 <= self.total_memory <= MAX_BYTES:
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
        if self.smi_memory is not None:
            integer("smi_memory", self.smi_memory, minimum=self.total_memory, maximum=MAX_BYTES)

    @property
    def capacity(self) -> int:
        """Bytes a step may use: what was free when a live card was read, else the total."""
        return self.free_memory if self.live and self.free_memory is not None else self.total_memory

    @property
    def capacity_label(self) -> str:
        """:attr:`capacity` in words, e.g. ``"T4: 14.58 GiB as PyTorch reports it (nvidia-smi:
        15,360 MiB)"``."""
        if self.live and self.free_memory is not None:
            return (f"{self.name}: {format_bytes(self.free_memory)} free of "
                    f"{format_bytes(self.total_memory)} as PyTorch reports it")
        smi = "" if self.smi_memory is None else f" (nvidia-smi: {self.smi_memory // MiB:,} MiB)"
        return f"{self.name}: {format_bytes(self.total_memory)} as PyTorch reports it{smi}"

    @property
    def has_native_bf16(self) -> bool:
        """bf16 tensor cores: compute capability 8.0 and newer (not a T4)."""
        return self.capability >= (8, 0)


#: Host links, theoretical bytes/s per direction (PCI-SIG: 8, 16, 32 GT/s per lane, 128b/130b
#: encoding, x16): what a pinned-memory copy approaches.
PCIE_BYTES_PER_S = {"PCIe 3.0 x16": 15.75e9, "PCIe 4.0 x16": 31.5e9, "PCIe 5.0 x16": 63.0e9}
_PCIE3, _PCIE4, _PCIE5 = PCIE_BYTES_PER_S.values()
#: The GPU presets, by name. ``total_memory`` is the lowest figure PyTorch was seen to report
#: (published ``_CudaDeviceProperties`` and OOM messages; it moves by tens of MiB with the
#: driver, and a budget too high is an OOM): a Colab T4 14.58-14.75 GiB against nvidia-smi's
#: 15360 MiB, an H100 80GB 79.10 GiB against 81559 MiB. Speeds are NVIDIA's datasheet peaks,
#: never measured by the course, dense (the sparse tensor figures quoted first, halved), SXM
#: boards for the A100, H100 and H200: T4 FP32 8.1 TFLOPS, mixed FP16 65, 320 GB/s; L4 FP32
#: 30.3, FP16/BF16 242 sparse, 300 GB/s; A100 FP32 19.5, BF16/FP16 312, 1,555 GB/s (40GB) and
#: 2,039 GB/s (80GB); H100 and H200 FP32 67, BF16/FP16 1,979 sparse, 3.35 and 4.8 TB/s. Host
#: links are the boards' PCIe generation; peer links NVLink per direction (A100: 600 GB/s
#: bidirectional, H100 and H200: 900 GB/s), PCIe for the T4 and L4.
GPUS: dict[str, GPU] = {
    name: GPU(name, mib * MiB, cap, fp32_flops=fp32, tensor_flops=tensor, memory_bandwidth=bw,
              smi_memory=smi * MiB, host_link=host, peer_link=peer)
    for name, mib, smi, cap, fp32, tensor, bw, host, peer in [
        # name, MiB as PyTorch and nvidia-smi report, capability, FLOP/s, bytes/s, links
        ("T4", 14930, 15360, (7, 5), 8.1e12, 65e12, 320e9, _PCIE3, _PCIE3),
        ("L4", 22563, 23034, (8, 9), 30.3e12, 121e12, 300e9, _PCIE4, _PCIE4),
        ("A100 40GB", 40536, 40960, (8, 0), 19.5e12, 312e12, 1555e9, _PCIE4, 300e9),
        ("A100 80GB", 81050, 81920, (8, 0), 19.5e12, 312e12, 2039e9, _PCIE4, 300e9),
        ("H100 80GB", 80998, 81559, (9, 0), 67e12, 989e12, 3.35e12, _PCIE5, 450e9),
        ("H200", 143156, 143771, (9, 0), 67e12, 989e12, 4.8e12, _PCIE5, 450e9),
    ]
}


def live_gpu(device: torch.device | str | int = "cuda") -> GPU:
    """This kernel's GPU as a :class:`GPU`, with ``live=True`` and its free bytes read now.

    The datasheet speeds stay None: the driver does not report them. A machine without CUDA
    raises ``ValueError``.

    Args:
        device (torch.device or str or int): a CUDA device (``"cuda:1"``) or its index.

    Returns:
        GPU: name, total and free memory in bytes, compute capability.
    Raises:
        ValueError: for a ``device`` that is not CUDA, or a machine without CUDA.
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
    """What a prediction runs on: None for the CPU (None or "cpu"), a preset of :data:`GPUS` by
    name, this kernel's GPU for "cuda" (:func:`live_gpu`), or ``gpu`` itself if it is a GPU."""
    if gpu is None or isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, str) and gpu in ("cpu", "cuda", *GPUS):
        return None if gpu == "cpu" else live_gpu() if gpu == "cuda" else GPUS[gpu]
    raise ValueError(f"gpu must be None, 'cpu', 'cuda', a GPU or one of {list(GPUS)}, got {gpu!r}")


def _cuda_has_native_bf16(device: torch.device | str = "cuda") -> bool:
    """bf16 tensor cores: compute capability 8.0+ (False on a T4, 7.5, or without CUDA)."""
    device = _cuda_device(device)
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def pick_dtype(device: torch.device | str | GPU) -> torch.dtype:
    """The training dtype for ``device``: bf16 or fp16 on GPUs, fp32 on the CPU (module doc).

    Args:
        device (torch.device or str or GPU): the device to train on, or a card (a preset of
            :data:`GPUS`: a T4 gives fp16, Ampere and newer bf16).

    Returns:
        torch.dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
    Raises:
        ValueError: for a ``device`` that is not a cuda, mps or cpu device.

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
    """
    return as_dtype(dtype) == torch.float16


@dataclass(frozen=True)
class _Tolerance:
    """How far a measurement may stray on a kind of device, so that a check never stops "Run
    all" on a GPU over noise the CPU does not have."""

    #: relative excess of a measured peak over the prediction: 0 on the CPU (the tracker counts
    #: every byte), 5 % on CUDA (512-byte blocks, cuBLAS workspaces), 10 % on MPS (not modelled).
    memory: float
    #: relative spread allowed among peaks the theory says are equal: 1 % CPU, 5 % GPU.
    flat: float
    #: whether two identical runs are bitwise equal: not on CUDA and MPS, where atomics in some
    #: backward kernels add in another order each run (compare with a rerun there).
    deterministic: bool


_TOLERANCES = {"cpu": _Tolerance(0.0, 0.01, True), "cuda": _Tolerance(0.05, 0.05, False),
               "mps": _Tolerance(0.10, 0.05, False)}


def tolerance(device: torch.device | str) -> _Tolerance:
    """The slack a lecture's checks allow where the measurement ran: ``memory``, ``flat`` and
    ``deterministic``.

    Args:
        device (torch.device or str): ``"cpu"``, ``"cuda:0"``, ``"mps"``.

    Returns:
        _Tolerance: the rules of that kind of device.
    Raises:
        ValueError: for a ``device`` that is not a cpu, cuda or mps device.

    Example:
        >>> tolerance("cpu").memory, tolerance("cuda:0").memory
        (0.0, 0.05)
    """
    kind = as_device("device", device).type
    if kind not in _TOLERANCES:
        raise ValueError(f"device must be a cpu, cuda or mps device, got {device!r}")
    return _TOLERANCES[kind]
