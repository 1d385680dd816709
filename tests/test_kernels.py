"""course_lib.model.kernels: the attention kernel, dtypes and allocation sizes PyTorch picks per target.

The expected kernels are written out from the filters of PyTorch's
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (the order cuDNN > flash >
memory-efficient > math on sm90, flash > memory-efficient > math elsewhere; flash
needs 16-bit and sm80+; memory-efficient takes bf16 only from sm80; cuDNN takes any
dropout, as an H200 with PyTorch 2.11 showed), case by case, not computed by the same code.
"""

import dataclasses
import itertools

import pytest
import torch

from course_lib.device import GPU, GPUS
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CFG = GPTConfig(vocab_size=64, seq_len=256, d_model=512, n_heads=8, attention="sdpa")  # d = 64



def asked(config, dtype, batch, seq, device="cuda"):
    """The kernel PyTorch's dispatcher (``torch._fused_sdp_choice``) picks for q, k, v laid out
    as the course GPT lays them out: head views of one QKV output that requires grad."""
    h, a = config.d_model, config.n_heads
    qkv = torch.zeros(batch, seq, 3 * h, device=device, dtype=dtype, requires_grad=True)
    q, k, v = (t.view(batch, seq, a, h // a).transpose(1, 2) for t in qkv.split(h, dim=2))
    choice = int(torch._fused_sdp_choice(q, k, v, None, config.dropout, True))
    return {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}[choice]


# (preset, dtype, dropout) -> kernel, for the course GPT with 64-wide heads
EXPECTED = {
    ("T4", F32, 0.0): "efficient", ("T4", F16, 0.0): "efficient", ("T4", BF16, 0.0): "math",
    ("T4", F32, 0.1): "efficient", ("T4", F16, 0.1): "efficient", ("T4", BF16, 0.1): "math",
    ("A100 80GB", F32, 0.0): "efficient", ("A100 80GB", F16, 0.0): "flash",
    ("A100 80GB", BF16, 0.0): "flash", ("A100 80GB", BF16, 0.1): "flash",
    ("L4", BF16, 0.1): "flash", ("L4", F32, 0.1): "efficient",
    ("H100 80GB", BF16, 0.0): "cudnn", ("H100 80GB", F16, 0.0): "cudnn",
    ("H100 80GB", BF16, 0.125): "cudnn", ("H100 80GB", BF16, 0.1): "cudnn",  # any dropout
    ("H100 80GB", F32, 0.0): "efficient", ("H200", BF16, 0.0): "cudnn",
}


@pytest.mark.parametrize("key", list(EXPECTED))
def test_kernel_per_preset_follows_pytorchs_filters(key):
    preset, dtype, dropout = key
    cfg = dataclasses.replace(CFG, dropout=dropout)
    assert kernels.sdpa_kernel(cfg, dtype, preset) == EXPECTED[key]


def test_head_size_limits():
    big = GPTConfig(vocab_size=64, seq_len=64, d_model=2048, n_heads=8, attention="sdpa")  # d=256
    assert kernels.sdpa_kernel(big, BF16, "A100 80GB") == "flash"      # flash: up to 256
    assert kernels.sdpa_kernel(big, BF16, "H100 80GB") == "cudnn"      # cuDNN: 256 on sm90
    mid = GPTConfig(vocab_size=64, seq_len=64, d_model=1600, n_heads=8, attention="sdpa")  # 200
    assert kernels.sdpa_kernel(mid, BF16, "H100 80GB") == "flash"      # cuDNN: <= 128 or 256
    assert kernels.sdpa_kernel(mid, BF16, "L4") == "efficient"         # sm89 trains flash <= 192
    odd = GPTConfig(vocab_size=64, seq_len=64, d_model=60, n_heads=2, attention="sdpa")  # d=30
    assert kernels.sdpa_kernel(odd, F16, "T4") == "math"               # not a multiple of 8
    assert kernels.sdpa_kernel(odd, F32, "T4") == "efficient"          # fp32 on sm75: alignment 1
    assert kernels.sdpa_kernel(odd, F32, "A100 80GB") == "math"        # sm80 fp32: multiple of 4
    old = GPU("K80", 12 * 2**30, (3, 7))
    assert kernels.sdpa_kernel(CFG, F16, old) == "math"


@pytest.mark.parametrize("dropout,dtype,batch,seq", itertools.product(
    [0.0, 0.1], [F32, BF16, F16], [1, 3], [16, 40]))
def test_cpu_kernel_is_the_one_pytorch_picks(dropout, dtype, batch, seq):
    cfg = GPTConfig(vocab_size=64, seq_len=64, d_model=32, n_heads=4, dropout=dropout,
                    attention="sdpa")
    assert kernels.sdpa_kernel(cfg, dtype) == asked(cfg, dtype, batch, seq, device="cpu")


def test_dtypes_and_allocation_sizes():
    t4 = GPUS["T4"]
    assert kernels.mask_dtype(BF16) == BF16 and kernels.mask_dtype(BF16, t4) == torch.bool
    assert kernels.stats_dtype(BF16) == BF16 and kernels.stats_dtype(BF16, t4) == F32
    assert kernels.stats_dtype(F32, t4) == F32
    assert kernels.autocast_softmax_dtype(F16) == F16
    assert kernels.autocast_softmax_dtype(F16, t4) == F32
    assert [kernels.allocated(n) for n in (0, 1, 513)] == [0, 1, 513]
    assert [kernels.allocated(n, t4) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    assert kernels.optimizer_steps_on_device(None) and not kernels.optimizer_steps_on_device(t4)


def test_bad_inputs():
    with pytest.raises(ValueError, match="dtype"):
        kernels.sdpa_kernel(CFG, torch.int8, "T4")
    with pytest.raises(ValueError, match="gpu"):
        kernels.sdpa_kernel(CFG, F16, "P100")


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_live_gpu_kernel_is_the_one_pytorch_picks(dropout):
    from course_lib.device import live_gpu, pick_dtype

    cfg = dataclasses.replace(CFG, dropout=dropout)
    for dtype in {F32, pick_dtype("cuda")}:
        assert kernels.sdpa_kernel(cfg, dtype, live_gpu()) == asked(cfg, dtype, 2, 128), dtype


def _adamw_picks_foreach(params) -> bool:
    """What torch.optim decides for an AdamW left at its default (``foreach=None``)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return _default_to_fused_or_foreach(params, differentiable=False)[1]


def test_adamw_default_implementation_per_device():
    assert kernels.adamw_foreach(None) is False and kernels.adamw_foreach("cpu") is False
    assert all(kernels.adamw_foreach(gpu) is True for gpu in GPUS)
    assert kernels.adamw_foreach(None) == _adamw_picks_foreach([torch.zeros(3)])
    with pytest.raises(ValueError, match="gpu"):
        kernels.adamw_foreach("P100")


@pytest.mark.gpu
def test_adamw_default_implementation_on_the_live_gpu():
    from course_lib.device import live_gpu

    assert kernels.adamw_foreach(live_gpu()) == _adamw_picks_foreach([torch.zeros(3, device="cuda")])
