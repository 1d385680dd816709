"""02-06: which kernels and dtypes PyTorch picks where a step runs, the rules the memory engine
follows, as pure functions of the target (``gpu=None`` for the CPU, or what
:func:`course_lib.device.resolve_gpu` takes):

=================================  ===========================  ==================================
rule                               CPU                          CUDA
=================================  ===========================  ==================================
dropout mask                       input's dtype (noise * x)    ``bool`` (fused ``native_dropout``)
LayerNorm mean and 1/std           input's dtype                fp32 for 16-bit input (acc. type)
``scaled_dot_product_attention``   flash; math with dropout     see :func:`sdpa_kernel`
softmax under ``torch.autocast``   stays 16-bit                 fp32 (CUDA's autocast fp32 list)
allocation                         exact bytes                  multiples of 512 bytes
AdamW's ``step`` counter           on the device (4 bytes)      on the host (not GPU memory)
AdamW's default implementation     per tensor                   multi-tensor: ``sqrt(v)`` of all
=================================  ===========================  ==================================

Sources: ``sdp_utils.cpp``, ``autocast_mode.cpp``, ``CUDACachingAllocator.cpp``
(``kMinBlockSize``), ``torch/optim/adam.py`` and ``optimizer.py`` (``_default_to_fused_or_foreach``).
"""

from __future__ import annotations

import torch

from course_lib.device import GPU, resolve_gpu
from course_lib.model.gpt import GPTConfig, check_config
from course_lib.units import as_dtype
from course_lib.validation import integer

#: The attention kernels ``F.scaled_dot_product_attention`` can pick.
SDPA_KERNELS = ("flash", "cudnn", "efficient", "math")
#: Bytes the CUDA caching allocator rounds every block up to.
CUDA_BLOCK = 512

_HALF = (torch.float16, torch.bfloat16)
#: The most elements a measurement allocates for q, k, v or the scores (1 GiB in fp32).
MAX_DETECT_ELEMENTS = 2**28


def _gpu(gpu) -> GPU | None:
    """``gpu`` as :func:`course_lib.device.resolve_gpu` takes it (fast for None and a GPU)."""
    return gpu if gpu is None or type(gpu) is GPU else resolve_gpu(gpu)


def mask_dtype(dtype, gpu: GPU | None = None) -> torch.dtype:
    """The dtype of the mask dropout saves on input of ``dtype``: bool on CUDA (the fused
    ``native_dropout``), ``dtype`` on the CPU (``F.dropout`` saves a scaled noise tensor).
    Args:
        dtype (torch.dtype or str): the input's dtype.
        gpu (GPU or str, optional): what :func:`course_lib.device.resolve_gpu` takes; None: the CPU.
    Returns:
        torch.dtype: the mask's dtype.
    """
    dtype = as_dtype(dtype)
    return torch.bool if _gpu(gpu) is not None else dtype


def stats_dtype(dtype, gpu: GPU | None = None) -> torch.dtype:
    """The dtype of LayerNorm's saved mean and 1/std for input of ``dtype``: fp32 on CUDA for
    16-bit input (its accumulation type), ``dtype`` on the CPU.
    Args:
        dtype (torch.dtype or str): the input's dtype.
        gpu (GPU or str, optional): what :func:`course_lib.device.resolve_gpu` takes; None: the CPU.
    Returns:
        torch.dtype: the statistics' dtype.
    """
    dtype = as_dtype(dtype)
    return torch.float32 if _gpu(gpu) is not None and dtype in _HALF else dtype


def allocated(nbytes: int, gpu: GPU | None = None) -> int:
    """Bytes a tensor of ``nbytes`` takes: exact on the CPU, ``ceil(nbytes / 512) * 512`` on CUDA
    (the caching allocator's :data:`CUDA_BLOCK`); a zero-byte tensor takes nothing."""
    if type(nbytes) is not int or nbytes < 0:  # planners call it with plain ints, often
        nbytes = integer("nbytes", nbytes, minimum=0)
    if gpu is None or nbytes == 0 or _gpu(gpu) is None:
        return nbytes
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


def optimizer_steps_on_device(gpu: GPU | None = None) -> bool:
    """Whether AdamW's per-tensor ``step`` counters are device memory (see the table)."""
    return _gpu(gpu) is None


def adamw_foreach(gpu: GPU | None = None) -> bool:
    """Whether a default ``torch.optim.AdamW`` runs the multi-tensor ("foreach") code, which holds
    ``sqrt(v)`` of the whole group at once: yes when every parameter is on CUDA."""
    return _gpu(gpu) is not None


def autocast_softmax_dtype(dtype, gpu: GPU | None = None) -> torch.dtype:
    """The output dtype of ``softmax`` on ``dtype`` input under ``torch.autocast`` (see the table)."""
    dtype = as_dtype(dtype)
    return torch.float32 if _gpu(gpu) is not None else dtype


def _prefers_cudnn(gpu: GPU) -> bool:
    # PyTorch puts cuDNN attention first on sm90 and sm100 with cuDNN newer than 9.15
    # (check_prefer_cudnn_attention); presets assume the cuDNN the current wheels ship.
    if gpu.live and torch.cuda.is_available() and (torch.backends.cudnn.version() or 0) <= 91500:
        return False
    return gpu.capability[0] in (9, 10) and gpu.capability[1] == 0


def _runs(kernel: str, gpu: GPU, config: GPTConfig, dtype: torch.dtype) -> bool:
    """Whether SDPA's filters (``sdp_utils.cpp``) let ``kernel`` run the course GPT on ``gpu``."""
    d, half, capability = config.d_head, dtype in _HALF, gpu.capability
    if kernel == "cudnn":
        limit = 256 if capability[0] in (9, 10) and d == 256 else 128  # backward: d <= 128, or 256
        return half and (8, 0) <= capability <= (12, 1) and d % 8 == 0 and d <= limit
    if kernel == "flash":
        if not (half and (8, 0) <= capability <= (12, 1) and d <= 256):
            return False
        if capability in ((8, 6), (8, 7), (8, 8), (8, 9), (12, 0), (12, 1)):  # training limits
            return d <= 192 or (config.dropout == 0 and d > 224)
        return True
    sm80 = capability >= (8, 0)  # the memory-efficient kernel
    if not (5, 0) <= capability <= (12, 1):
        return False
    if dtype not in ((torch.float16, torch.float32, torch.bfloat16) if sm80
                     else (torch.float16, torch.float32)):
        return False
    # minimum_gemm_alignment: tensor cores need 128-bit rows (8 halves, 4 floats on sm80+).
    return d % (8 if half and capability >= (7, 0) else 4 if sm80 else 1) == 0


def _sdpa_dtype(dtype) -> torch.dtype:
    """``dtype`` if q, k and v can have it (fp32, fp16, bf16)."""
    dtype = as_dtype(dtype)
    if dtype not in (torch.float32, *_HALF):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def sdpa_kernel(config: GPTConfig, dtype, gpu=None) -> str:
    """The kernel ``F.scaled_dot_product_attention`` runs for the course GPT in training.

    PyTorch takes the first kernel whose filters pass (``sdp_utils.cpp``):

    * **CPU**: flash, or "math" with dropout (the reference: fp32 inside, ``s x s`` scores).
    * **cuDNN** (first on sm90/sm100, H100 and H200): 16-bit, head size a multiple of 8 up to
      128, with or without dropout (measured with PyTorch 2.11 and cuDNN 9.19 on an H200).
    * **flash**: 16-bit on compute capability 8.0 to 12.1, head size up to 256 (192 in
      training on sm86/89/120).
    * **efficient**: capability 5.0+, fp16 or fp32 (bf16 from 8.0), head size a multiple of
      the tensor-core row. So a T4 (7.5) has no kernel but math for bf16.
    * **math**: everything else.

    Args:
        config (GPTConfig): the model (its head size and dropout).
        dtype (torch.dtype or str): q, k and v's dtype: fp32, fp16 or bf16.
        gpu (GPU or str, optional): what :func:`course_lib.device.resolve_gpu` takes; None: the CPU.
    Returns:
        str: one of :data:`SDPA_KERNELS`.

    Example:
        >>> cfg = GPTConfig(d_model=256, n_heads=4, dropout=0.0, attention="sdpa")
        >>> sdpa_kernel(cfg, torch.bfloat16, "T4"), sdpa_kernel(cfg, torch.float16, "T4")
        ('math', 'efficient')
    """
    check_config(config)
    dtype = _sdpa_dtype(dtype)
    gpu = _gpu(gpu)
    if gpu is None:
        return "math" if config.dropout > 0 else "flash"
    order = ("cudnn", "flash", "efficient") if _prefers_cudnn(gpu) else ("flash", "efficient")
    return next((kernel for kernel in order if _runs(kernel, gpu, config, dtype)), "math")


def forced_kernel(kernel: str | None, config: GPTConfig, dtype, gpu=None) -> str | None:
    """``kernel`` if ``torch.nn.attention.sdpa_kernel`` can force it for the course GPT here.

    Math runs everywhere, flash on the CPU without dropout, on a GPU each fused kernel whose
    :func:`sdpa_kernel` filters pass; prediction and measurement refuse alike by this rule.
    """
    if kernel is not None and kernel not in SDPA_KERNELS:
        raise ValueError(f"kernel must be one of {SDPA_KERNELS} or None, got {kernel!r}")
    chosen, gpu, dtype = sdpa_kernel(config, dtype, gpu), _gpu(gpu), as_dtype(dtype)
    if kernel in (None, "math", chosen):
        return kernel
    d, p = config.d_head, config.dropout
    if gpu is None or not _runs(kernel, gpu, config, dtype):  # the CPU's one fused kernel: chosen
        where = "the CPU" if gpu is None else gpu.name
        raise ValueError(f"kernel={kernel!r} does not run here ({where}, {str(dtype)[6:]}, head "
                         f"size {d}, dropout {p}): PyTorch runs {chosen!r} there")
    return kernel


def attention_kernel(config: GPTConfig, dtype, gpu=None) -> str:
    """"explicit" for the hand-written attention, else :func:`sdpa_kernel`.
    Args:
        config, dtype, gpu: as :func:`sdpa_kernel`.
    Returns:
        str: ``"explicit"`` or one of :data:`SDPA_KERNELS`.
    """
    if check_config(config).attention == "explicit":
        as_dtype(dtype)
        resolve_gpu(gpu)
        return "explicit"
    return sdpa_kernel(config, dtype, gpu)
