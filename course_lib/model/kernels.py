"""Which kernels and dtypes PyTorch picks where a step runs: the rules the memory engine follows.

The same model saves different tensors on the CPU, on a T4 and on an H100. What
decides it, in bytes that matter, is collected here as pure functions of the
target (``gpu=None`` for the CPU, or a :class:`course_lib.device.GPU`):

=================================  ===========================  ==================================
rule                               CPU                          CUDA
=================================  ===========================  ==================================
dropout mask                       input's dtype (noise * x)    ``bool`` (fused ``native_dropout``)
LayerNorm mean and 1/std           input's dtype                fp32 for 16-bit input (acc. type)
``scaled_dot_product_attention``   flash; math with dropout     see :func:`sdpa_kernel`
softmax under ``torch.autocast``   stays 16-bit                 fp32 (CUDA's autocast fp32 list)
allocation                         exact bytes                  multiples of 512 bytes
AdamW's ``step`` counter           on the device (4 bytes)      on the host (not GPU memory)
AdamW's default implementation     per tensor (``foreach``      multi-tensor (``foreach=True``):
                                   False): ``sqrt(v)`` of one   ``sqrt(v)`` of every parameter
                                   parameter at a time          of the group at once
=================================  ===========================  ==================================

Sources: ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (kernel
filters and their order), ``aten/src/ATen/autocast_mode.cpp`` (autocast op
lists per device), ``c10/cuda/CUDACachingAllocator.cpp`` (``kMinBlockSize =
512``: every block is rounded up to it, and ``max_memory_allocated`` counts the
rounded sizes), ``torch/optim/adam.py`` (``step`` is a CPU tensor unless
``capturable`` or ``fused``), ``torch/optim/optimizer.py`` (``_default_to_fused_or_foreach``:
foreach when every parameter is on CUDA).
"""

from __future__ import annotations

import torch

from course_lib.device import GPU, resolve_gpu
from course_lib.model.gpt import GPTConfig, check_config
from course_lib.units import as_dtype
from course_lib.validation import available_device as as_device, integer, positive_int

#: The attention kernels ``F.scaled_dot_product_attention`` can pick, and "explicit" for the
#: course GPT's hand-written attention (``config.attention == "explicit"``).
SDPA_KERNELS = ("flash", "cudnn", "efficient", "math")
ATTENTION_KERNELS = ("explicit", *SDPA_KERNELS)
#: Bytes the CUDA caching allocator rounds every block up to.
CUDA_BLOCK = 512

_HALF = (torch.float16, torch.bfloat16)
#: The most elements :func:`detect_sdpa_kernel` allocates for its q, k, v (1 GiB in fp32).
MAX_DETECT_ELEMENTS = 2**28


def _gpu(gpu) -> GPU | None:
    """``gpu`` as :func:`course_lib.device.resolve_gpu` takes it (fast for None and a GPU)."""
    return gpu if gpu is None or type(gpu) is GPU else resolve_gpu(gpu)


def mask_dtype(dtype, gpu: GPU | None = None) -> torch.dtype:
    """The dtype of the mask dropout saves on input of ``dtype``: bool on CUDA, ``dtype`` on the CPU.

    On the CPU ``F.dropout`` multiplies by a scaled noise tensor of the input's
    dtype and saves it; on CUDA the fused ``native_dropout`` saves a ``bool`` mask.

    Args:
        dtype (torch.dtype or str): the dropout's input dtype.
        gpu (str or GPU, optional): None for the CPU, or what :func:`course_lib.device.resolve_gpu`
            takes (a name of :data:`course_lib.device.GPUS`, "cuda", a ``GPU``).

    Returns:
        torch.dtype: ``torch.bool`` (1 byte per element) on CUDA, ``dtype`` on the CPU.

    Raises:
        ValueError: naming ``dtype`` (not a dtype :func:`course_lib.units.as_dtype` takes) or
            ``gpu`` (not one :func:`course_lib.device.resolve_gpu` takes).
    """
    dtype = as_dtype(dtype)
    return torch.bool if _gpu(gpu) is not None else dtype


def stats_dtype(dtype, gpu: GPU | None = None) -> torch.dtype:
    """The dtype of LayerNorm's saved mean and 1/std for input of ``dtype``: fp32 on CUDA for
    16-bit input (the accumulation type), the input's dtype on the CPU."""
    dtype = as_dtype(dtype)
    return torch.float32 if _gpu(gpu) is not None and dtype in _HALF else dtype


def allocated(nbytes: int, gpu: GPU | None = None) -> int:
    """Bytes a tensor of ``nbytes`` takes: exact on the CPU, ``ceil(nbytes / 512) * 512`` on CUDA
    (the caching allocator's :data:`CUDA_BLOCK`); a zero-byte tensor takes nothing."""
    if type(nbytes) is not int:
        nbytes = integer("nbytes", nbytes, minimum=0)
    if nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if gpu is None or nbytes == 0 or _gpu(gpu) is None:
        return nbytes
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


def optimizer_steps_on_device(gpu: GPU | None = None) -> bool:
    """Whether AdamW's per-tensor ``step`` counters are device memory: yes on the CPU; on CUDA
    they stay on the host unless ``capturable=True`` or ``fused=True``."""
    return _gpu(gpu) is None


def adamw_foreach(gpu: GPU | None = None) -> bool:
    """Whether ``torch.optim.AdamW`` left at its default runs the multi-tensor ("foreach") code.

    PyTorch picks at the first ``step()`` (``_default_to_fused_or_foreach``): multi-tensor
    when every parameter is a CUDA tensor, which holds ``sqrt(v)`` for the whole group at once
    (4 more bytes per fp32 parameter than the CPU's per-tensor loop).

    Example:
        >>> adamw_foreach(None), adamw_foreach("T4")
        (False, True)
    """
    return _gpu(gpu) is not None


def autocast_softmax_dtype(dtype, gpu: GPU | None = None) -> torch.dtype:
    """The output dtype of ``softmax`` on ``dtype`` input under ``torch.autocast``: fp32 on CUDA
    (softmax is on CUDA's fp32 list), unchanged on the CPU."""
    dtype = as_dtype(dtype)
    return torch.float32 if _gpu(gpu) is not None else dtype


def _prefers_cudnn(gpu: GPU) -> bool:
    # PyTorch puts cuDNN attention first on sm90 and sm100 with cuDNN newer than 9.15
    # (check_prefer_cudnn_attention); presets assume the cuDNN the current wheels ship.
    if gpu.live and torch.cuda.is_available():
        version = torch.backends.cudnn.version() or 0
        if version <= 91500:
            return False
    return gpu.capability[0] in (9, 10) and gpu.capability[1] == 0


def _cudnn_ok(gpu: GPU, d: int, half: bool) -> bool:
    major = gpu.capability[0]
    limit = 256 if major in (9, 10) and d == 256 else 128  # backward: d <= 128, or exactly 256
    return half and (8, 0) <= gpu.capability <= (12, 1) and d % 8 == 0 and d <= limit


def _flash_ok(gpu: GPU, d: int, dropout: float, half: bool) -> bool:
    if not (half and (8, 0) <= gpu.capability <= (12, 1) and d <= 256):
        return False
    if gpu.capability in ((8, 6), (8, 7), (8, 8), (8, 9), (12, 0), (12, 1)):  # training limits
        return d <= 192 or (dropout == 0 and d > 224)
    return True


def _efficient_ok(gpu: GPU, d: int, dtype: torch.dtype) -> bool:
    sm80 = gpu.capability >= (8, 0)
    if not (5, 0) <= gpu.capability <= (12, 1):
        return False
    if dtype not in ((torch.float16, torch.float32, torch.bfloat16) if sm80
                     else (torch.float16, torch.float32)):
        return False
    half = dtype in _HALF
    # minimum_gemm_alignment: tensor cores need 128-bit rows (8 halves, 4 floats on sm80+).
    if sm80:
        align = 8 if half else 4
    elif gpu.capability >= (7, 0):
        align = 8 if half else 1
    else:
        align = 1
    return d % align == 0


def sdpa_kernel(config: GPTConfig, dtype, gpu=None) -> str:
    """The kernel ``F.scaled_dot_product_attention`` runs for the course GPT in training.

    The course GPT calls it with ``is_causal=True``, no mask, q, k, v split from
    one QKV projection, and ``dropout_p=config.dropout``. PyTorch tries the
    kernels in its priority order and takes the first whose filters pass
    (``sdp_utils.cpp``):

    * **CPU**: the flash kernel, except with dropout, which it does not implement:
      then "math", the reference kernel, which upcasts 16-bit inputs to fp32 and
      materialises the ``s x s`` scores.
    * **cuDNN** (first on sm90/sm100, H100 and H200): 16-bit, head size a multiple
      of 8 up to 128, with or without dropout (measured with PyTorch 2.11 and cuDNN 9.19 on an
      H200: ``dropout=0.1`` runs cuDNN's kernel).
    * **flash**: 16-bit on compute capability 8.0 to 12.1, head size up to 256
      (on sm86/89/120 training allows up to 192).
    * **efficient** (memory-efficient): compute capability 5.0+, fp16 or fp32 (bf16
      only from 8.0), head size a multiple of the tensor-core row (8 halves; 4 floats
      on 8.0+). So a T4 (7.5) runs fp16 and fp32 here and has no kernel but math for bf16.
    * **math**: everything else, fp32 inside for 16-bit inputs.

    Args:
        config (GPTConfig): the course GPT's :class:`~course_lib.model.gpt.GPTConfig` (its head size
            and dropout).
        dtype: the dtype of q, k and v (under autocast: the autocast dtype).
        gpu (str or GPU, optional): None for the CPU, or what :func:`course_lib.device.resolve_gpu`
            takes.

    Returns:
        One of :data:`SDPA_KERNELS`.

    Raises:
        ValueError: for a dtype other than fp32, fp16 and bf16, or an unknown ``gpu``.

    Example:
        >>> cfg = GPTConfig(d_model=256, n_heads=4, dropout=0.0, attention="sdpa")
        >>> sdpa_kernel(cfg, torch.bfloat16, "T4"), sdpa_kernel(cfg, torch.float16, "T4")
        ('math', 'efficient')
    """
    check_config(config)
    dtype = as_dtype(dtype)
    if dtype not in (torch.float32, *_HALF):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    gpu = _gpu(gpu)
    p = config.dropout
    if gpu is None:
        return "math" if p > 0 else "flash"
    d, half = config.d_head, dtype in _HALF
    order = ("cudnn", "flash", "efficient") if _prefers_cudnn(gpu) else ("flash", "efficient")
    checks = {"cudnn": lambda: _cudnn_ok(gpu, d, half),
              "flash": lambda: _flash_ok(gpu, d, p, half),
              "efficient": lambda: _efficient_ok(gpu, d, dtype)}
    return next((kernel for kernel in order if checks[kernel]()), "math")


def forced_kernel(kernel: str | None, config: GPTConfig, dtype, gpu=None) -> str | None:
    """``kernel`` if ``torch.nn.attention.sdpa_kernel`` can force it for the course GPT here.

    Math runs everywhere, flash on the CPU without dropout, on a GPU each fused kernel whose
    :func:`sdpa_kernel` filters pass; prediction and measurement refuse alike by this rule.

    Example:
        >>> forced_kernel("efficient", GPTConfig(d_model=256, n_heads=4), torch.float16, "T4")
        'efficient'
    """
    if kernel is not None and kernel not in SDPA_KERNELS:
        raise ValueError(f"kernel must be one of {SDPA_KERNELS} or None, got {kernel!r}")
    chosen, gpu, dtype = sdpa_kernel(config, dtype, gpu), _gpu(gpu), as_dtype(dtype)
    if kernel in (None, "math", chosen):
        return kernel
    d, p = config.d_head, config.dropout
    runs = {"cudnn": lambda: _cudnn_ok(gpu, d, dtype in _HALF),
            "flash": lambda: _flash_ok(gpu, d, p, dtype in _HALF),
            "efficient": lambda: _efficient_ok(gpu, d, dtype)}
    if gpu is None or not runs[kernel]():  # on the CPU, the only fused kernel is the chosen one
        where = "the CPU" if gpu is None else gpu.name
        raise ValueError(f"kernel={kernel!r} does not run here ({where}, {str(dtype)[6:]}, head "
                         f"size {d}, dropout {p}): PyTorch runs {chosen!r} there")
    return kernel


def attention_kernel(config: GPTConfig, dtype, gpu=None) -> str:
    """"explicit" for the hand-written attention, else :func:`sdpa_kernel`.

    Args:
        config (GPTConfig): the course GPT's shape (its ``attention``).
        dtype (torch.dtype or str): the dtype of q, k and v.
        gpu (str or GPU, optional): None for the CPU, or what :func:`course_lib.device.resolve_gpu`
            takes (a name of :data:`course_lib.device.GPUS`, "cuda", a ``GPU``).

    Returns:
        str: ``"explicit"`` or one of :data:`SDPA_KERNELS`.

    Raises:
        ValueError: naming ``config``, ``dtype`` or ``gpu``, for a bad value (as
            :func:`sdpa_kernel`).
    """
    if check_config(config).attention == "explicit":
        as_dtype(dtype)
        resolve_gpu(gpu)
        return "explicit"
    return sdpa_kernel(config, dtype, gpu)


def detect_sdpa_kernel(config: GPTConfig, dtype, batch_size: int = 1,
                       seq_len: int | None = None, device: str = "cuda") -> str:
    """The kernel SDPA picks here, asked of PyTorch itself (``torch._fused_sdp_choice``).

    Builds q, k, v as the course GPT does (views of one QKV output that requires
    grad) on ``device`` and asks PyTorch's dispatcher which kernel it would run.
    The tests compare it with :func:`sdpa_kernel` (on the CPU always; on a GPU in
    the tests marked ``gpu``).

    Args:
        config (GPTConfig): the model (its width, heads and dropout).
        dtype (torch.dtype or str): fp32, fp16 or bf16.
        batch_size (int): sequences, a positive int.
        seq_len (int, optional): tokens per sequence, at most ``config.seq_len`` (None: that).
        device (str or torch.device): "cuda", "cpu" or a ``torch.device``. q, k and v hold at
            most :data:`MAX_DETECT_ELEMENTS` elements together (``batch_size * seq_len * 3 *
            d_model``).

    Returns:
        str: ``"math"``, ``"flash"``, ``"efficient"`` or ``"cudnn"``.

    Raises:
        ValueError: naming the argument; for ``device="cuda"`` without a CUDA device, or for
            more than :data:`MAX_DETECT_ELEMENTS` elements.
    """
    check_config(config)
    dtype = as_dtype(dtype)
    if dtype not in (torch.float32, *_HALF):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_DETECT_ELEMENTS)
    s = config.seq_len if seq_len is None else positive_int("seq_len", seq_len,
                                                            maximum=config.seq_len)
    device = as_device("device", device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but this machine has no CUDA device")
    h, a = config.d_model, config.n_heads
    if batch_size * s * 3 * h > MAX_DETECT_ELEMENTS:
        raise ValueError(f"batch_size * seq_len * 3 * d_model must be at most "
                         f"{MAX_DETECT_ELEMENTS:,} elements, got batch_size={batch_size}, "
                         f"seq_len={s}, d_model={h}")
    qkv = torch.zeros(batch_size, s, 3 * h, device=device, dtype=dtype, requires_grad=True)
    q, k, v = (t.view(batch_size, s, a, h // a).transpose(1, 2) for t in qkv.split(h, dim=2))
    choice = int(torch._fused_sdp_choice(q, k, v, None, config.dropout, True))
    return {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}.get(choice, "math")
