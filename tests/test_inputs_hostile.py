"""Hostile inputs to the public functions and widgets of course_lib, each with its exact outcome:
a ValueError naming the caller's parameter (never an OverflowError, AttributeError, a torch
RuntimeError or a message about an internal name), numpy and torch integers taken as their value,
a maximum for every size, and nothing changed by a refused call."""

import dataclasses
import time

import ipywidgets
import numpy as np
import pytest
import torch

from course_lib import units
from course_lib.measurement import memory, timing
from course_lib.model import fused, gpt, toy_data
from course_lib.model.gpt import GPT, GPTConfig
from course_lib.planning import fit, fit_ladder, guard, planner
from course_lib.prediction import activations, formulas, step_setup, time_model
from course_lib.training import accumulation, checkpointing, levers, loop
from course_lib.views import (
    activation_views,
    calculator,
    checkpoint_views,
    fit_views,
    ladder_view,
    playground,
    step_views,
    widgets,
)

CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=1)
BEYOND_FLOAT = 10**400


def _model_and_batch(batch=4):
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = gpt.random_tokens(CFG, batch)
    return model, x, y


# --- a saved storage has a size of at least 0 ------------------------------------------------

@pytest.mark.parametrize("shape, match", [((-1,), r"shape must be an int in \[0, "),
                                          ((2.0,), "shape must be an int, got 2.0"),
                                          ((True,), "shape must be an int, got True"),
                                          (5, "shape must be a tuple of ints >= 0, got 5"),
                                          ((2**41,), r"shape must be an int in \[0, ")])
def test_a_saved_storage_refuses_a_shape_that_is_no_size(shape, match):
    with pytest.raises(ValueError, match=match):
        activations.Saved("op", "input", shape, torch.float32)


def test_a_saved_storage_takes_sizes_and_dtype_names_as_their_values():
    saved = activations.Saved("op", "input", (np.int64(2), torch.tensor(3)), "bf16")
    assert saved.shape == (2, 3) and type(saved.shape[0]) is int
    assert saved.dtype == torch.bfloat16 and saved.nbytes == 12
    with pytest.raises(ValueError, match="kind must be one of"):
        activations.Saved("op", "input", (1,), torch.float32, "weights")


# --- ints beyond float's range ----------------------------------------------------------------

@pytest.mark.parametrize("call, name", [
    (lambda v: units.format_bytes(v), "n"),
    (lambda v: units.format_bytes(-v), "n"),
    (lambda v: widgets.nice_ceiling(v), "x"),
    (lambda v: calculator.calculator_figure(v), "billions"),
    (lambda v: step_views.record_accumulation_step(*_model_and_batch(), 2, lr=v), "lr"),
])
def test_ints_beyond_float_range_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number"):
        call(BEYOND_FLOAT)


def test_format_bytes_keeps_exact_ints_and_checks_precision():
    assert units.format_bytes(2**60) == "1073741824.00 GiB"
    assert units.format_bytes(5, np.int64(1)) == "5 B"
    with pytest.raises(ValueError, match="precision"):
        units.format_bytes(5, 13)


def test_a_zero_dimensional_tensor_is_not_a_shape():
    with pytest.raises(ValueError, match="shape must be a sequence of ints, got tensor"):
        units.tensor_bytes(torch.tensor(3))


# --- devices torch does not know --------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda d: fused.example(d),
    lambda d: fused.backend(d),
    lambda d: time_model.measure_speed(d),
    lambda d: playground.measure_step_cost(CFG, 1, 1, device=d),
])
@pytest.mark.parametrize("device", ["gpu", 0, np.int64(0), -1, None])
def test_a_device_torch_does_not_know_is_refused_naming_device(call, device):
    with pytest.raises(ValueError, match=r"^device must be a (torch\.device|device such as) "):
        call(device)


def test_the_fused_example_needs_a_floating_dtype():
    with pytest.raises(ValueError, match="dtype must be a floating-point dtype, got torch.int64"):
        fused.example("cpu", torch.int64)


# --- models, optimizers and batches of the wrong kind -----------------------------------------

@pytest.mark.parametrize("cls", [gpt.CausalSelfAttention, gpt.MLP, gpt.Block, GPT])
@pytest.mark.parametrize("config", [None, 3, "small", {"d_model": 8}])
def test_the_model_classes_refuse_anything_but_a_config(cls, config):
    with pytest.raises(ValueError, match="^config must be a course_lib.model.gpt.GPTConfig, got "):
        cls(config)


@pytest.mark.parametrize("fn", [memory.training_step, memory.step_breakdown])
def test_a_step_names_the_callers_model_optimizer_and_batch(fn):
    model, x, y = _model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [((None, opt, x, y), "^model must be a torch.nn.Module, got NoneType"),
             ((model, "adam", x, y), "^optimizer must be a torch.optim.Optimizer, got str"),
             ((model, opt, 3, y), "^inputs must be a torch.Tensor, got int"),
             ((model, opt, x, None), "^targets must be a torch.Tensor, got NoneType"),
             ((model, opt, x.float(), y), "^inputs must hold integers"),
             ((model, opt, x, y[:, :3]), "^targets must be int64 of inputs's shape"),
             ((model, opt, x + 100, y), r"^inputs must hold token ids in \[0, 16\)")]
    before = [p.detach().clone() for p in model.parameters()]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(*args)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_step_refuses_an_on_phase_that_cannot_be_called():
    model, x, y = _model_and_batch()
    with pytest.raises(ValueError, match="^on_phase must be callable or None, got 3"):
        memory.training_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y,
                              on_phase=3)


def test_micro_batch_loss_names_inputs_and_targets_not_idx():
    model, x, y = _model_and_batch()
    with pytest.raises(ValueError, match="^model must be a torch.nn.Module, got int"):
        accumulation.micro_batch_loss(3, x, y, total_tokens=32)
    with pytest.raises(ValueError, match="^inputs must be a torch.Tensor, got list"):
        accumulation.micro_batch_loss(model, [1], y, total_tokens=32)
    with pytest.raises(ValueError, match="^targets must be a torch.Tensor, got int"):
        accumulation.micro_batch_loss(model, x, 3, total_tokens=32)
    y = y.clone()
    y[0, 0] = -1
    with pytest.raises(ValueError, match=r"^targets must hold token ids in \[0, 16\) or "
                                         r"ignore_index \(-100\)"):
        accumulation.micro_batch_loss(model, x, y, total_tokens=32)


def test_train_names_batches_and_refuses_a_batch_without_tokens_before_it_steps():
    model, x, y = _model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    cases = [([x], "^batches must yield \\(inputs, targets\\) pairs, got Tensor"),
             ([(x, "y")], "^batches' targets must be a torch.Tensor, got str"),
             ([(x.float(), y)], "^batches' inputs must hold integers"),
             ([(x, torch.full_like(y, -100))], "^batches must hold at least one target token")]
    for batches, match in cases:
        with pytest.raises(ValueError, match=match):
            loop.train(model, opt, batches, micro_batch_size=2, accumulation_steps=2)
    with pytest.raises(ValueError, match="^optimizer must be a torch.optim.Optimizer, got list"):
        loop.train(model, [], [(x, y)], micro_batch_size=4)
    with pytest.raises(ValueError, match="^model must be a torch.nn.Module, got str"):
        loop.train("gpt", opt, [(x, y)], micro_batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_step_through_refuses_what_it_cannot_record():
    model, x, y = _model_and_batch()
    cases = [((3, x, y, 2), {}, "^model must be a course_lib.model.gpt.GPT, got int"),
             ((model, None, y, 2), {}, "^inputs must be a torch.Tensor, got NoneType"),
             ((model, x, None, 2), {}, "^targets must be a torch.Tensor, got NoneType"),
             ((model, x, y, 2), {"mode": ["right"]}, "^mode must be one of"),
             ((model, x, y, 2), {"lr": -1}, "^lr must be a finite number > 0.0, got -1.0"),
             ((model, x, y, 2), {"lr": 11}, "^lr must be a finite number <= 10.0, got 11.0")]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            step_views.record_accumulation_step(*args, **kwargs)
    with pytest.raises(ValueError, match="^model must be a course_lib.model.gpt.GPT, got Linear"):
        step_views._parameter_groups(torch.nn.Linear(2, 2))


# --- numpy and torch ints: their value, used ---------------------------------------------------

@pytest.mark.parametrize("size", [np.int64(2), np.int32(2), torch.tensor(2)])
def test_numpy_and_torch_ints_are_used_as_ints(size):
    # they used to pass validation and crash in torch.split
    assert planner.measure_peak(CFG, size) == planner.measure_peak(CFG, 2)
    assert units.format_bytes(size) == "2 B"


# --- a maximum for every size -----------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: time_model.measure_speed("cpu", matmul_size=16385),
     r"^matmul_size must be an int in \[16, 16,384\], got 16385"),
    (lambda: time_model.measure_speed("cpu", matmul_size=0),
     r"^matmul_size must be an int in \[16, 16,384\], got 0"),
    (lambda: time_model.measure_speed("cpu", repeats=101),
     "^repeats must be a positive int of at most 100, got 101"),
    (lambda: playground.measure_step_cost(CFG, 1, 1, steps=1001),
     "^steps must be a positive int of at most 1,000, got 1001"),
    (lambda: playground.measure_step_cost(CFG, 1, 1, steps=BEYOND_FLOAT),
     "^steps must be a positive int of at most 1,000, got 1000"),
])
def test_timing_sizes_have_a_maximum_named_by_the_caller(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- messages that name the caller's parameter --------------------------------------------------

def _step_views_tradeoff():
    return step_views.tradeoff(CFG, 2, 2, gpu="T4")


@pytest.mark.parametrize("call, match", [
    (lambda: calculator.zero_figure(10**9, gpus=["T4", 1]), "^gpus must be one of"),
    (lambda: checkpoint_views.loglog_slope(3, [1, 2]), "^depths must be a list or tuple, got 3"),
    (lambda: checkpoint_views.loglog_slope([1, 2], "ab"), "^values must be a list or tuple"),
    (lambda: checkpoint_views.loglog_slope([1, BEYOND_FLOAT], [1, 2]),
     "^depths must be a finite number"),
    (lambda: guard.check_budget(BEYOND_FLOAT, 10**9), "^needed must be a StepMemory or an int"),
    (lambda: guard.check_budget(-1, 10**9), "^needed must be a StepMemory or an int"),
    (lambda: ladder_view.ladder_figure(fit_ladder.ladder(CFG, "T4", batch_size=2), figsize=3),
     "^figsize must be two positive numbers"),
    (lambda: ladder_view.ladder_figure(fit_ladder.ladder(CFG, "T4", batch_size=2), fig=3),
     "^fig must be a matplotlib Figure, got int"),
    (lambda: fit_views.setup_explorer("fig"), "^fig must be a matplotlib Figure, got str"),
    (lambda: step_views.tradeoff_figure(_step_views_tradeoff(), "x", figsize=(BEYOND_FLOAT, 1)),
     "^figsize must be two positive numbers"),
    (lambda: step_views.tradeoff_figure(3, "x"), "^t must be a Tradeoff"),
    (lambda: step_views._memory_top(CFG, None), "^t must be a Tradeoff"),
    (lambda: step_views._memory_top(CFG, _step_views_tradeoff(), 2**30),
     "^largest must be a positive int of at most 16,777,216"),
    (lambda: widgets.live_plot(lambda a, x: None, {"x": ipywidgets.IntSlider()},
                               figsize=(BEYOND_FLOAT, 2)), "^figsize must be two positive"),
    (lambda: memory.saved_tensors(_loss(), params=3), "^params must be an iterable of tensors"),
    (lambda: memory.saved_bytes(_loss(), params=[1]), "^params must be an iterable of tensors"),
    (lambda: formulas.model_state_bytes(GPT(CFG), master_params=3),
     "^master_params must be an iterable of tensors"),
    (lambda: planner.choices(3), "^options must be a non-empty list of Candidates"),
    (lambda: planner.time_ratios(CFG, 2, 3), "^policies must be a list or tuple, got 3"),
    (lambda: planner.time_ratios(CFG, 2, ["blocks"]), r"^policies must be \(mode, every\) pairs"),
    (lambda: time_model.matmul_flops(CFG, 2, "everything"), "^mode must be one of"),
    (lambda: timing.split_by_class("gpu"), "^events must be a profiler's events"),
    (lambda: timing.split_by_class([1, 2]), "^events must be a profiler's events"),
    (lambda: gpt.check_batch(GPT(CFG), *gpt.random_tokens(CFG, 2), ignore_index=BEYOND_FLOAT),
     "^ignore_index must be an int in"),
    (lambda: activation_views.oom_widget(gpu=["T4"]), "^gpu must be one of"),
    (lambda: step_views.step_through(3), "^recordings must map modes of"),
    (lambda: step_views.step_through({"right": 3}), "^recordings must map modes of"),
])
def test_messages_name_the_callers_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _loss():
    model, x, y = _model_and_batch()
    return model(x, y)[1]


def test_the_playground_view_names_its_first_values():
    pg = playground.Playground(CFG, samples=16)
    with pytest.raises(ValueError, match=r"^micro_batch_size must be one of sizes \[1, 2\], got 4"):
        step_views.playground_view(pg, sizes=(1, 2), micro_batch_size=4)
    with pytest.raises(ValueError, match="^accumulation_steps must be a positive int"):
        step_views.playground_view(pg, accumulation_steps=1.5)
    with pytest.raises(ValueError, match="^sizes must be 1 to 16 ascending ints from 1 to"):
        step_views.playground_view(pg, sizes=(1, 2**30), micro_batch_size=1)


def test_the_tradeoff_explorer_refuses_a_speed_and_choices_of_the_wrong_kind():
    speed = time_model.device_speed("T4")
    with pytest.raises(ValueError, match="^speed must be a DeviceSpeed"):
        step_views.tradeoff_explorer({"tiny": CFG}, speed=3)
    with pytest.raises(ValueError, match="^model must be one of"):
        step_views.tradeoff_explorer({"tiny": CFG}, speed=speed, model=["tiny"])
    with pytest.raises(ValueError, match="^gpu must be one of"):
        step_views.tradeoff_explorer({"tiny": CFG}, speed=speed, gpu=["T4"])


# --- a deadline that holds on a loaded machine ----------------------------------------------------

def test_within_seconds_stops_the_work_at_the_first_op_past_its_limit():
    timing.within_seconds(lambda: torch.ones(2) + 1, 1.0)  # the dispatch machinery, warmed up
    model, x, y = _model_and_batch()

    def endless():
        while True:
            model(x, y)[1].backward()

    start = time.perf_counter()
    with pytest.raises(timing.TimeLimitExceeded, match="^the step was stopped after 0.1"):
        timing.within_seconds(endless, 0.1, what="the step")
    assert time.perf_counter() - start < 0.5
    assert timing.within_seconds(lambda: 3, 1.0)[0] == 3
    for bad, match in ((0, "^seconds must be a finite number > 0.0"),
                       (BEYOND_FLOAT, "^seconds must be a finite number"),
                       (3601, "^seconds must be a finite number <= 3600.0")):
        with pytest.raises(ValueError, match=match):
            timing.within_seconds(lambda: None, bad)
    with pytest.raises(ValueError, match="^fn must be callable"):
        timing.within_seconds(3, 1.0)


def test_the_measure_button_holds_its_limit_when_the_prediction_is_far_too_low(monkeypatch,
                                                                               capsys):
    # A machine busy with other work: the prediction (from a speed 1000x too high) says the
    # step is quick; GPT-2 124M on this CPU is not. The button used to trust the prediction and
    # block for minutes; one step, timed against the limit, stops it.
    real = time_model.device_speed("T4")
    fast = dataclasses.replace(real, name="this CPU", fp32_flops=1e18, fp16_flops=1e18,
                               bf16_flops=1e18, memory_bandwidth=1e15, op_seconds=1e-12)
    gpt2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
    box = step_views.tradeoff_explorer({"GPT-2 124M": gpt2}, speed=fast)
    monkeypatch.setattr(step_views, "MEASURE_LIMIT_SECONDS", 0.8)
    timing.within_seconds(lambda: torch.ones(2) + 1, 1.0)  # the dispatch machinery, warmed up
    start = time.perf_counter()
    box.measure()
    took = time.perf_counter() - start
    message = _printed(capsys)
    assert message.startswith("not measured: the first step of GPT-2 124M took more than 267 ms "
                              "here (predicted ")
    assert not box.measured and took < 0.8 + 3.0, took  # the old button: minutes


def _printed(capsys):
    """What a widget printed (outside a kernel, an ``Output`` passes it to stdout)."""
    return capsys.readouterr().out.replace("\x1b[2K", "").strip()


def test_the_measure_button_reports_a_menu_left_empty(capsys):
    box = step_views.tradeoff_explorer({"tiny": CFG}, speed=time_model.device_speed("T4"))
    box.view.controls["model"].value = None
    capsys.readouterr()
    box.measure()
    message = _printed(capsys).splitlines()[-1]
    assert message.startswith("⚠ model must be one of ['tiny'], got None: choose one")
    assert not box.measured


# --- widgets: a clear message for a menu set to None, never "KeyError: None" ----------------------

def _shown(capsys):
    return _printed(capsys).splitlines()[-1]


def _recordings():
    model, x, y = _model_and_batch()
    return {m: step_views.record_accumulation_step(model, x, y, 2, m) for m in step_views.LOOPS}


@pytest.mark.parametrize("make, view_of, name", [
    (lambda: activation_views.oom_widget(), lambda b: b, "gpu"),
    (lambda: ladder_view.ladder_explorer(), lambda b: b, "model"),
    (lambda: step_views.tradeoff_explorer({"tiny": CFG}, speed=time_model.device_speed("T4"),
                                          gpu="T4"), lambda b: b.view, "model"),
    (lambda: step_views.tradeoff_explorer({"tiny": CFG}, speed=time_model.device_speed("T4"),
                                          gpu="T4"), lambda b: b.view, "gpu"),
    (lambda: step_views.step_through(_recordings()), lambda b: b.view, "mode"),
    (lambda: checkpoint_views.explorer(), lambda b: b, "gpu"),
])
def test_a_menu_set_to_none_says_which_and_what_to_choose(make, view_of, name, capsys):
    view = view_of(make())
    capsys.readouterr()
    view.controls[name].value = None
    shown = _shown(capsys)
    assert shown.startswith(f"⚠ {name} must be one of [") and shown.rstrip().endswith(
        "got None: choose one"), shown
    assert "KeyError" not in shown and view.image.layout.display == "none"


def test_the_playground_button_shows_any_failure_as_a_message(monkeypatch):
    pg = playground.Playground(CFG, samples=16)
    box = step_views.playground_view(pg, sizes=(1, 2), steps=(1, 2), micro_batch_size=1,
                                     accumulation_steps=1)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(pg, "run", broken)
    box.train()  # what a click calls
    assert box.status.value == "⚠ RuntimeError: out of memory"


# --- the fit's search space: bounded in size, its cache in bytes ----------------------------------

def test_a_search_space_of_1024_by_1024_is_refused_before_it_is_built():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^widths and depths must make at most 32,768 pairs "
                                         r"\(len\(widths\) \* len\(depths\)\), got 1,024 \* 1,024"):
        fit.search_space(widths=list(range(64, 64 * 1025, 64)), depths=list(range(1, 1025)),
                         aspect_ratio=None)
    with pytest.raises(ValueError, match="^widths and depths must make at most 32,768 pairs"):
        fit.fit_model(10**9, widths=list(range(64, 64 * 1025, 64)), depths=list(range(1, 1025)))
    assert time.perf_counter() - start < 1.0


def test_the_search_space_cache_holds_at_most_its_bytes(monkeypatch):
    monkeypatch.setattr(fit, "_SPACES", type(fit._SPACES)())
    monkeypatch.setattr(fit, "MAX_CACHE_BYTES", 3000 * fit.CONFIG_BYTES)
    for first in range(64, 64 * 11, 64):  # ten spaces of 1,000 configurations each
        space = fit.search_space(widths=[first, 64 * 40], depths=list(range(1, 501)),
                                 aspect_ratio=None)
        assert len(space) == 1000
    assert sum(len(v) for v in fit._SPACES.values()) <= 3000 and len(fit._SPACES) == 3
    again = fit.search_space(widths=[64 * 10, 64 * 40], depths=list(range(1, 501)),
                             aspect_ratio=None)  # the most recent: from the cache
    assert [c.d_model for c in again] == [c.d_model for c in space]


def test_search_spaces_take_numpy_ints():
    a = fit.search_space(widths=[np.int64(768)], depths=[np.int64(12)], seq_len=np.int64(64),
                         aspect_ratio=None)
    assert a[0].d_model == 768 and type(a[0].d_model) is int and a[0].seq_len == 64


@pytest.mark.parametrize("call, match", [
    (lambda: calculator.calculator_figure(1e308), r"^billions must be a finite number <= "),
    (lambda: fused.reference(3.0, torch.zeros(4)), "^x and bias must be tensors, got float"),
    (lambda: checkpoint_views.explorer(batch_size=10**5),
     r"^batch_size must be an int in \[1, 32\], got 100000"),
])
def test_more_values_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_lora_rank_is_named_and_at_most_the_width():
    # a rank of 2**39 used to be refused as "numels", and a rank of 10**6 on a width of 8 priced
    with pytest.raises(ValueError, match=r"^lora_rank must be a positive int of at most 8, got "
                                         r"549755813888"):
        fit_ladder.ladder(CFG, "T4", lora_rank=2**39)
    with pytest.raises(ValueError, match="^plan.lora_rank must be a positive int of at most 8"):
        fit_ladder.predict_plan(CFG, 2, fit_ladder.Plan(lora_rank=10**6))
    with pytest.raises(ValueError, match="^plan.lora_rank must be a positive int of at most 8"):
        fit_ladder.plan_seconds(CFG, 2, fit_ladder.Plan(lora_rank=9), "T4")
    with pytest.raises(ValueError, match="^rank must be a positive int of at most 8, got 9"):
        levers.lora_parameter_count(CFG, 9)
    assert levers.lora_parameter_count(CFG, 8) == 16 * 8 * 8 * CFG.n_layers


@pytest.mark.parametrize("field, value", [("fp32_flops", BEYOND_FLOAT), ("tensor_flops", 1e308),
                                          ("memory_bandwidth", 2e15), ("fp32_flops", 0),
                                          ("fp32_flops", float("nan")), ("tensor_flops", "fast")])
def test_a_gpu_states_speeds_within_reason(field, value):
    from course_lib.device import GPU
    with pytest.raises(ValueError, match=f"^{field} must be a positive finite number of at most"):
        GPU("card", 2**34, (8, 0), **{field: value})


@pytest.mark.parametrize("field, value", [("fp32_flops", BEYOND_FLOAT), ("bf16_flops", 0.0),
                                          ("memory_bandwidth", float("nan")),
                                          ("op_seconds", 2.0), ("fp16_flops", None)])
def test_a_device_speed_states_speeds_within_reason(field, value):
    speed = time_model.device_speed("T4")
    with pytest.raises(ValueError, match=f"^{field} must be a finite number"):
        dataclasses.replace(speed, **{field: value})
    with pytest.raises(ValueError, match="^region_seconds must be a finite number >= 0.0"):
        dataclasses.replace(speed, region_seconds=(("blocks", -1.0),))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("call", [
    lambda d: gpt.random_tokens(CFG, 2, device=d),
    lambda d: toy_data.markov_tokens(2, 8, device=d),
    lambda d: step_setup.build(CFG, device=d),
    lambda d: planner.measure_peak(CFG, 2, device=d),
    lambda d: playground.measure_step_cost(CFG, 1, 1, device=d),
    lambda d: timing.step_times({"a": lambda: None}, device=d),
    lambda d: fused.example(d),
])
def test_a_device_this_machine_lacks_is_refused_naming_device(call):
    # torch raised an AssertionError ("Torch not compiled with CUDA enabled") or a RuntimeError
    with pytest.raises(ValueError, match=r"^device='cuda', but this machine has no CUDA device: "
                                         r"device must be one of \['cpu', 'meta'"):
        call("cuda")
    with pytest.raises(ValueError, match=r"^device='xla', but this machine has no xla"):
        call("xla")


def test_the_shared_checks_refuse_their_own_bad_arguments():
    model, x, y = _model_and_batch()
    with pytest.raises(ValueError, match="^names must be two str, got 3"):
        gpt.check_batch(model, x, y, names=3)
    with pytest.raises(ValueError, match="^controls and values must be dicts"):
        widgets.check_chosen([], {})
    with pytest.raises(ValueError, match="^controls and values must be dicts"):
        widgets.check_chosen({}, {"x": None})


def test_batches_are_refused_by_the_callers_names_not_idx():
    model, x, y = _model_and_batch()
    with pytest.raises(ValueError, match=r"^inputs must hold token ids in \[0, 16\)"):
        checkpointing.measure_kept_bytes(model, x + 100, y)
    with pytest.raises(ValueError, match="^inputs must hold integers"):
        accumulation.full_batch_gradients(model, x.float(), y)
    with pytest.raises(ValueError, match=r"^inputs must hold token ids in \[0, 16\)"):
        accumulation.full_batch_gradients(model, x + 100, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^batch's targets must hold token ids in \[0, 16\)"):
        playground._step_memory(model, opt, (x, y + 100), micro_batch_size=4)


def test_more_sizes_have_a_maximum():
    with pytest.raises(ValueError, match="^block must be a positive int of at most 1,152,921"):
        units.storage_bytes([torch.zeros(2)], block=2**61)
    with pytest.raises(ValueError, match="^micro_batch_size must be a positive int of at most 16,"):
        playground.measure_step_cost(CFG, 2**25, 1)
