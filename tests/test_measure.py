"""course_lib.measurement.memory: the live-tensor tracker, peak_memory, saved tensors and the step breakdown,
checked against byte counts derived by hand and against autograd's own saved-tensor hooks."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st
from torch.utils.checkpoint import checkpoint

from course_lib.measurement.memory import (
    CATEGORIES,
    LiveTensorTracker,
    peak_memory,
    resident_bytes,
    saved_bytes,
    saved_table,
    saved_tensors,
    step_breakdown,
    training_step,
)
from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.units import storage_bytes, storage_key


def _hook_saved_bytes(fn, params=()) -> int:
    """Independent count: distinct non-parameter storages autograd packs while ``fn()`` runs."""
    weights = {storage_key(p) for p in params}
    packed = []

    def pack(t):
        if storage_key(t) not in weights:
            packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, storage_bytes(packed)


# --------------------------------------------------------------------------- the tracker

def test_tracker_counts_new_storages_exactly_and_views_once():
    with LiveTensorTracker() as t:
        a = torch.empty(1000)                      # 4000 bytes
        v = a.view(10, 100)[2:5]                   # a view: nothing new
        b = torch.empty(10, dtype=torch.float64)   # 80 bytes
        assert t.live == 4080
        del a, v
        assert t.live == 80                        # the view kept it alive until now
    assert t.peak == 4080
    del b


def test_tracker_ignores_work_on_tensors_that_existed_before():
    old = torch.randn(1000)
    with LiveTensorTracker() as t:
        old.mul_(2)                # in place on a foreign storage
        old[:10].add_(1)           # a view of it
        old.detach()
        torch._foreach_mul_([old], 2.0)
        new = old * 2              # a real allocation
    assert t.peak == t.live == 4000
    del new


def test_tracker_counts_resized_storages_and_python_literals():
    with LiveTensorTracker() as t:
        d = torch.empty(0)
        d.resize_(100)                    # 0 -> 400 bytes in place
        lit = torch.tensor([1.0, 2.0])    # built outside the dispatcher, then lifted
        assert t.live == 400 + 8
    del d, lit


def test_tracker_forgets_frees_after_it_exits():
    with LiveTensorTracker() as t:
        x = torch.empty(256)
    del x
    assert t.live == 1024 and t.peak == 1024


@given(st.lists(st.tuples(st.integers(0, 4096), st.booleans()), min_size=1, max_size=30))
@settings(max_examples=40, deadline=None)
def test_tracker_peak_is_the_maximum_of_running_live_bytes(ops):
    """Allocate tensors of random sizes, freeing some right away: peak == max prefix sum, live >= 0."""
    kept, live, peak = [], 0, 0
    with LiveTensorTracker() as t:
        for n, keep in ops:
            x = torch.empty(n, dtype=torch.uint8)
            live += n
            peak = max(peak, live)
            if keep:
                kept.append(x)
            else:
                del x
                live -= n
            assert t.live == live >= 0
    assert t.peak == peak
    del kept


# --------------------------------------------------------------------------- peak_memory

@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_peak_memory_refuses_a_device_this_machine_lacks():
    for kind in ("mps",) + (() if torch.cuda.is_available() else ("cuda",)):
        with pytest.raises(ValueError, match=f"device='{kind}', but this machine has no"):
            peak_memory(lambda: None, device=kind)


def test_peak_memory_of_simple_work_is_derived_by_hand():
    def work():
        a = torch.empty(1000)          # 4000
        b = torch.empty(500)           # 2000 -> 6000
        del a
        c = torch.empty(2000)          # 8000 -> live 10000
        return b, c

    assert peak_memory(work, device="cpu") == 10_000
    assert peak_memory(lambda: None, device="cpu") == 0


def test_peak_memory_counts_a_forward_pass_without_the_parameters():
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    x = torch.randn(8, 64)
    # addmm's output only: the weight's transpose is a view of a parameter.
    assert peak_memory(lambda: model(x), device="cpu") == 8 * 32 * 4


@pytest.mark.parametrize("device", ["gpu", "tpu", 3, "cuda:x"])
def test_peak_memory_rejects_bad_devices(device):
    with pytest.raises(ValueError, match="device"):
        peak_memory(lambda: None, device=device)


def test_peak_memory_rejects_non_callables():
    with pytest.raises(ValueError, match="fn"):
        peak_memory(torch.empty(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_peak_memory_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA"):
        peak_memory(lambda: None, device="cuda")


@pytest.mark.gpu
def test_allocator_and_tracker_agree_up_to_block_rounding():
    def work():
        a = torch.empty(1000, device="cuda")
        b = torch.empty(3000, device="cuda")
        return a, b

    allocator = peak_memory(work, device="cuda")
    tracker = peak_memory(work, device="cpu")  # the tracker follows CUDA tensors too
    assert tracker == 16_000
    assert tracker <= allocator <= tracker + 2 * 512


# --------------------------------------------------------------------------- saved tensors

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.GELU(), nn.Linear(8, 4))


def test_saved_tensors_of_a_small_mlp_row_by_row():
    model = _mlp()
    x = torch.randn(5, 16)
    out = model(x)
    rows = saved_tensors(out, model.parameters())
    found = {(r.op, r.name, r.shape, r.is_parameter) for r in rows}
    # The first Linear keeps no weight: its input needs no gradient.
    assert found == {
        ("addmm", "mat1", (5, 16), False),
        ("relu", "result", (5, 32), False),
        ("addmm", "mat1", (5, 32), False), ("addmm", "mat2", (32, 8), True),
        ("gelu", "self", (5, 8), False),
        ("addmm", "mat1", (5, 8), False), ("addmm", "mat2", (8, 4), True),
    }
    # ReLU keeps its output, which is also the next Linear's input: one storage, two rows.
    relu = next(r for r in rows if r.op == "relu")
    second = next(r for r in rows if r.op == "addmm" and r.shape == (5, 32))
    assert relu.storage_id == second.storage_id
    assert saved_bytes(out, model.parameters()) == (5 * 16 + 5 * 32 + 5 * 8 + 5 * 8) * 4


def test_saved_table_lists_rows_in_forward_order_with_a_letter_per_storage():
    model = _mlp()
    out = model(torch.randn(5, 16))
    lines = saved_table(out, model.parameters()).splitlines()
    assert lines[0].split() == ["kept", "by", "slot", "shape", "dtype", "bytes", "storage"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1], r[-1]) for r in rows] == [
        ("Addmm", "mat1", "A"), ("Relu", "result", "B"), ("Addmm", "mat1", "B"),
        ("Gelu", "self", "C"), ("Addmm", "mat1", "D")]  # GELU keeps its input, not its output
    assert rows[0][-2] == f"{5 * 16 * 4:,}"
    with_params = saved_table(out, model.parameters(), parameters=True).splitlines()
    assert len(with_params) == len(lines) + 2 and sum("param" in x for x in with_params) == 2
    with pytest.raises(ValueError, match="parameters"):
        saved_table(out, parameters=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_bytes_equals_what_autograd_packs(dtype, attention, dropout):
    cfg = GPTConfig(vocab_size=50, seq_len=12, d_model=24, n_heads=3, n_layers=2,
                    dropout=dropout, attention=attention)
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    x, y = (t.clone() for t in random_tokens(cfg, 2))
    (_, loss), packed = _hook_saved_bytes(lambda: model(x, y), model.parameters())
    # Hooks never see the 0-d float64 that autograd wraps around 1/sqrt(d) (8 bytes a layer).
    scalars = 8 * cfg.n_layers if attention == "explicit" else 0
    assert saved_bytes(loss, model.parameters()) == packed + scalars
    with_params = saved_bytes(loss, model.parameters(), include_parameters=True)
    assert with_params > packed


def test_saved_tensors_lists_custom_functions_and_nothing_after_backward():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = checkpoint(lin, x, use_reentrant=True).sum()   # a custom autograd.Function
    rows = saved_tensors(out)
    assert [(r.node, r.shape) for r in rows] == [("CheckpointFunctionBackward", (2, 4))]
    out.backward()
    assert saved_tensors(out) == []


@pytest.mark.parametrize("bad", [torch.randn(3), 3.0, None])
def test_saved_tensors_needs_a_graph(bad):
    with pytest.raises(ValueError, match="output"):
        saved_tensors(bad)


# --------------------------------------------------------------------------- one training step

def _fresh(cfg, dtype=torch.float32):
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2, dropout=0.1,
                attention="explicit")


def test_training_step_updates_weights_and_clears_gradients():
    model, opt = _fresh(CFG)
    before = model.blocks[0].mlp.fc.weight.detach().clone()
    loss = training_step(model, opt, *random_tokens(CFG, 2))
    assert isinstance(loss, float) and loss > 0
    assert not torch.equal(before, model.blocks[0].mlp.fc.weight)
    assert all(p.grad is None for p in model.parameters())


def test_step_breakdown_agrees_with_peak_memory_and_sorts_every_byte():
    x, y = (t.clone() for t in random_tokens(CFG, 2))
    model, opt = _fresh(CFG)
    measured = peak_memory(lambda: training_step(model, opt, x, y), device="cpu")
    model, opt = _fresh(CFG)
    params = sum(p.numel() * 4 for p in model.parameters())
    bd = step_breakdown(model, opt, x, y)
    assert bd.peak == measured
    assert set(bd.at_peak) == set(CATEGORIES)
    assert bd.at_peak["parameters"] == bd.baseline["parameters"] == params
    assert bd.total == params + measured          # the timeline's peak is the tracker's
    assert all(v >= 0 for series in bd.series.values() for v in series)
    # After the step: AdamW's m and v (2 x params) and a 4-byte step per parameter tensor.
    n_tensors = len(list(model.parameters()))
    assert bd.series["optimizer_state"][-1] == 2 * params + 4 * n_tensors
    assert bd.series["gradients"][-1] == 0        # zero_grad(set_to_none=True)
    assert max(bd.series["gradients"]) == params  # every gradient existed at once
    assert bd.series["activations"][-1] == 0
    assert "table" in dir(bd) and "optimizer_state" in bd.table()


def test_step_breakdown_activations_are_the_saved_bytes():
    x, y = (t.clone() for t in random_tokens(CFG, 2))
    model, opt = _fresh(CFG)
    _, loss = model(x, y)
    inputs = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    saved = saved_bytes(loss, model.parameters()) - inputs  # the inputs existed before the step
    scalars = 8 * CFG.n_layers  # 1/sqrt(d): wrapped by autograd outside the dispatcher, unseen
    del loss
    bd = step_breakdown(model, opt, x, y)
    assert max(bd.series["activations"]) == saved - scalars


def test_step_breakdown_counts_existing_optimizer_state_as_baseline():
    x, y = random_tokens(CFG, 2)
    model, opt = _fresh(CFG)
    training_step(model, opt, x, y)
    bd = step_breakdown(model, opt, x, y)
    assert bd.baseline["optimizer_state"] == bd.at_peak["optimizer_state"] > 0


def test_step_breakdown_rejects_bad_arguments():
    model, opt = _fresh(CFG)
    x, y = random_tokens(CFG, 2)
    with pytest.raises(ValueError, match="model"):
        step_breakdown(lambda a, b: a, opt, x, y)
    with pytest.raises(ValueError, match="optimizer"):
        step_breakdown(model, None, x, y)


def test_resident_bytes_rejects_bad_arguments():
    model, opt = _fresh(CFG)
    for bad_model, match in ((lambda x: x, "model must be a torch.nn.Module"),
                             (nn.ReLU(), "at least one parameter")):
        with pytest.raises(ValueError, match=match):
            resident_bytes(bad_model, opt)
    with pytest.raises(ValueError, match="optimizer"):
        resident_bytes(model, {"lr": 1e-3})


def test_saved_tensors_skips_checkpointed_regions_without_recomputing():
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(8, 8)
    calls = []

    def region(t):
        calls.append(1)
        return lin(t).relu()

    x = torch.randn(4, 8, requires_grad=True)
    y = checkpoint(region, x, use_reentrant=False).sum()
    assert len(calls) == 1
    assert saved_tensors(y, lin.parameters()) == []
    assert len(calls) == 1, "listing saved tensors must not recompute the region"
    plain = region(x).sum()
    assert saved_bytes(plain, lin.parameters()) == 2 * 4 * 8 * 4  # input and relu output, fp32


# --------------------------------------------------------------------------- attention kernels

@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_saved_measures_what_each_kernel_keeps_as_predicted(dropout, dtype):
    """FlashAttention keeps its output and a log-sum-exp per row; the math kernel the s x s maps."""
    from test_kernels import asked  # PyTorch's dispatcher, asked directly

    from course_lib.measurement import memory
    from course_lib.model import kernels
    from course_lib.prediction import activations

    cfg = GPTConfig(vocab_size=16, seq_len=64, d_model=32, n_heads=4, dropout=dropout)
    chosen = memory.sdpa_saved(cfg, 2, dtype)
    assert chosen.kernel == kernels.sdpa_kernel(cfg, dtype) == asked(cfg, dtype, 2, 64, "cpu")
    for kernel in ("math", "flash") if dropout == 0 else ("math",):
        got = memory.sdpa_saved(cfg, 2, dtype, kernel=kernel)
        predicted = activations.attention_core_saved(cfg, 2, 64, dtype, kernel=kernel)
        assert got.kernel == kernel
        assert got.saved_bytes == activations.total_bytes(predicted)
        probs = 2 * 4 * 64 * 64 * 4  # fp32 inside the math kernel, even for bf16 inputs
        maps = 3 if dropout else 1  # with dropout its mask and the dropped probabilities too
        assert got.square_bytes == (maps * probs if kernel == "math" else 0)
        if kernel == "flash":
            assert {r.name for r in got.tensors} == {"query", "key", "value", "output",
                                                     "logsumexp"}


def test_sdpa_saved_refuses_what_cannot_run_here():
    from course_lib.measurement import memory

    cfg = GPTConfig(vocab_size=16, seq_len=64, d_model=32, n_heads=4)
    for kwargs, name in ((dict(kernel="efficient"), "does not run here"),
                         (dict(kernel="xformers"), "kernel"), (dict(dtype=torch.int64), "dtype"),
                         (dict(seed=-1), "seed")):
        with pytest.raises(ValueError, match=name):
            memory.sdpa_saved(cfg, 2, **kwargs)
    with pytest.raises(ValueError, match="batch_size"):
        memory.sdpa_saved(cfg, 0)
    with pytest.raises(ValueError, match="too large"):
        memory.sdpa_saved(GPTConfig(seq_len=2**15, d_model=64, n_heads=4), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_attention_kernel_per_capability_is_the_one_predicted(dtype):
    """On this GPU, the kernel SDPA runs for the course GPT is the one the engine's rules pick for
    its compute capability, and it keeps what they say (exact bytes, before the allocator's
    rounding)."""
    from course_lib.device import live_gpu
    from course_lib.measurement import memory
    from course_lib.model import kernels
    from course_lib.prediction import activations

    gpu = live_gpu()
    if dtype == torch.bfloat16 and gpu.capability < (8, 0):
        pytest.skip("bf16 needs compute capability 8.0")
    cfg = GPTConfig(vocab_size=16, seq_len=256, d_model=256, n_heads=4)
    got = memory.sdpa_saved(cfg, 2, dtype, device="cuda")
    assert got.kernel == kernels.sdpa_kernel(cfg, dtype, gpu)
    predicted = activations.attention_core_saved(cfg, 2, 256, dtype, gpu)
    assert got.saved_bytes == activations.total_bytes(predicted)
    assert (got.square_bytes > 0) == (got.kernel == "math")
