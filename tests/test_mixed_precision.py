"""course_lib.training.mixed_precision: MasterWeightAdamW is a torch.optim.AdamW that every tool takes."""

import copy

import pytest
import torch

from course_lib.measurement.memory import peak_memory, step_breakdown, training_step
from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.training.loop import make_grad_scaler, train
from course_lib.training.mixed_precision import MasterWeightAdamW

SMALL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


def _mixed(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    model = GPT(SMALL).to(dtype)
    return model, MasterWeightAdamW(model.parameters(), lr=1e-2)


def test_it_is_an_adamw_whose_parameters_are_the_fp32_master_weights():
    model, optimizer = _mixed()
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["params"] == optimizer.master
    assert all(m.dtype == torch.float32 and torch.equal(m.to(p.dtype), p)
               for m, p in zip(optimizer.master, model.parameters()))
    assert optimizer.defaults["foreach"] is None  # PyTorch's choice, which the engine predicts


def test_step_breakdown_files_the_master_weights_and_their_gradients(count_parameters):
    model, optimizer = _mixed()
    x, y = random_tokens(SMALL, 2)
    P = count_parameters(model)
    b = step_breakdown(model, optimizer, x, y)  # the first step: no m and v before it
    assert b.baseline["parameters"] == 2 * P and b.baseline["optimizer_state"] == 4 * P
    assert max(b.series["gradients"]) >= 4 * P  # the fp32 master gradients of the step
    assert b.at_peak["optimizer_state"] >= 4 * P
    # The same step's peak, measured without the breakdown's bookkeeping.
    model2, optimizer2 = _mixed()
    assert b.peak == peak_memory(lambda: training_step(model2, optimizer2, x, y), device="cpu")


def test_grad_scaler_unscales_the_fp32_master_gradients_of_an_fp16_model():
    model, optimizer = _mixed(torch.float16)
    x, y = random_tokens(SMALL, 4)
    scaler = make_grad_scaler("cpu", init_scale=2.0**8)
    log = train(model, optimizer, [(x, y)] * 3, micro_batch_size=2, accumulation_steps=2,
                grad_scaler=scaler, max_grad_norm=1.0)
    assert log.steps == 3 and not any(log.skipped)
    assert all(p.grad is None for p in model.parameters()) and all(
        m.grad is None for m in optimizer.master)
    plain = make_grad_scaler("cpu")  # why the master gradients are fp32: AdamW on the fp16 model
    plain.scale(model(x, y)[1]).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        plain.unscale_(torch.optim.AdamW(model.parameters()))


def test_state_dict_restores_the_master_weights_and_the_run_continues_identically():
    model, optimizer = _mixed()
    x, y = random_tokens(SMALL, 2)
    for _ in range(2):
        training_step(model, optimizer, x, y)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert [m.dtype for m in saved["master_weights"]] == [torch.float32] * len(optimizer.master)
    training_step(model, optimizer, x, y)

    restored, again = _mixed(seed=1)  # other weights, until loaded
    restored.load_state_dict(saved_model)
    again.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(again.master, saved["master_weights"]))
    training_step(restored, again, x, y)
    assert all(torch.equal(a, b) for a, b in zip(again.master, optimizer.master))
    assert all(torch.equal(a, b) for a, b in zip(restored.parameters(), model.parameters()))
    with pytest.raises(ValueError, match="state_dict must hold master weights"):
        again.load_state_dict({**saved, "master_weights": saved["master_weights"][:1]})


def test_zero_grad_clears_the_model_and_the_master_gradients():
    model, optimizer = _mixed()
    x, y = random_tokens(SMALL, 2)
    model(x, y)[1].backward()
    optimizer.prepare_grads()
    model(x, y)[1].backward()  # 16-bit gradients again, beside the fp32 ones
    optimizer.zero_grad(set_to_none=False)
    assert all(not t.grad.any() for t in (*model.parameters(), *optimizer.master))
    optimizer.zero_grad()
    assert all(t.grad is None for t in (*model.parameters(), *optimizer.master))


def test_a_closure_is_run_with_gradients_and_its_loss_returned():
    model, optimizer = _mixed()
    x, y = random_tokens(SMALL, 2)
    before = [m.clone() for m in optimizer.master]

    def closure():
        optimizer.zero_grad()
        loss = model(x, y)[1]
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss.item() > 0 and any(not torch.equal(a, b) for a, b in zip(before, optimizer.master))


def test_a_step_is_one_optimizer_step_for_the_profiler_whatever_optimizers_exist():
    # torch.optim wraps AdamW.step in a profiler record once any AdamW exists; step_ops counts
    # those records as operators, so a mixed-precision step must make exactly one.
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    model, optimizer = _mixed()
    x, y = random_tokens(SMALL, 2)
    model(x, y)[1].backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer.step()
        optimizer.zero_grad()
    names = [e.name for e in prof.events() if e.name.startswith("Optimizer.")]
    assert names == ["Optimizer.step#MasterWeightAdamW.step"]


def test_a_copy_keeps_its_own_master_weights_and_state():
    model, optimizer = _mixed()
    x, y = random_tokens(SMALL, 2)
    training_step(model, optimizer, x, y)
    twin = copy.deepcopy(optimizer)
    assert twin.param_groups[0]["params"] == twin.master  # the same tensors, copied once
    assert all(a is not b and torch.equal(a, b) for a, b in zip(twin.master, optimizer.master))
    assert twin.state[twin.master[0]]["step"] == 1
