"""course_lib.views.fit_views: the figures of lecture 06 draw what the engine and the planner say, on the
figure they are given, and refuse bad input naming it."""

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from course_lib.device import GPU, GPUS
from course_lib.model.gpt import GPTConfig
from course_lib.prediction import engine, time_model
from course_lib.prediction.predict import Step, predict
from course_lib.units import GiB, MiB
from course_lib.views import fit_views

SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)


def _axes(figsize=(8, 3)):
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def test_unit_of_switches_to_gib_at_two_gib():
    assert fit_views.unit_of(0) == (MiB, "MiB")
    assert fit_views.unit_of(2 * GiB - 1) == (MiB, "MiB")
    assert fit_views.unit_of(2 * GiB) == (GiB, "GiB")


def test_draw_steps_stacks_every_category_to_the_total():
    steps = {"fp32": predict(Step(SMALL, 4)).peak,
             "bf16-mixed, 2 x 2": predict(Step(SMALL, 2, 2, precision="bf16-mixed")).peak}
    fig, ax = _axes()
    scale, unit = fit_views.draw_steps(ax, steps, budget=MiB, measured={"fp32": 123_456})
    assert (scale, unit) == (MiB, "MiB")
    for row, memory in zip((1, 0), steps.values()):
        bars = [p for p in ax.patches if abs(p.get_y() + p.get_height() / 2 - row) < 1e-9]
        assert sum(p.get_width() for p in bars) == pytest.approx(memory.total / MiB)
        assert len(bars) == len(engine.breakdown_rows(memory))
    ticks = dict(zip(ax.get_yticks(), (t.get_text() for t in ax.get_yticklabels())))
    assert ticks == {1: "fp32", 0: "bf16-mixed, 2 x 2"}  # the first label on top
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    assert names[0] == "parameters" and names[-2:] == ["measured", "budget"]
    fig.canvas.draw()


@pytest.mark.parametrize("kwargs,name", [
    (dict(steps={}), "steps"), (dict(steps={"a": 3}), "steps"),
    (dict(budget=0), "budget"), (dict(measured={"other": 5}), "measured"),
    (dict(measured={"a": -5}), "measured"), (dict(ax="axes"), "ax")])
def test_draw_steps_names_a_bad_argument(kwargs, name):
    _, ax = _axes()
    args = dict(ax=ax, steps={"a": predict(Step(SMALL)).peak}) | kwargs
    with pytest.raises(ValueError, match=name):
        fit_views.draw_steps(args.pop("ax"), args.pop("steps"), **args)


def test_draw_timeline_draws_the_curve_and_three_labelled_lines():
    fig, ax = _axes()
    fit_views.draw_timeline(ax, [0, 1, 2], [5 * MiB, 6 * MiB, 5 * MiB], clock_unit="event",
                            budget=7 * MiB, predicted=6 * MiB, resident=5 * MiB,
                            budget_label="budget 7 MiB")
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["allocated", "budget 7 MiB", "predicted peak", "model states (between steps)"]
    assert "allocations and frees" in ax.get_xlabel()
    with pytest.raises(ValueError, match="one length"):
        fit_views.draw_timeline(ax, [0, 1], [MiB], clock_unit="µs", budget=MiB, predicted=MiB,
                                resident=MiB)


def test_explorer_offers_the_presets_and_this_gpu_only_with_cuda():
    assert fit_views._explorer_gpus(live=False) == dict(GPUS)


@pytest.mark.parametrize("live", [False, True])
def test_the_explorer_budgets_pytorchs_total_or_a_live_cards_free_memory(live, monkeypatch):
    t4 = GPUS["T4"]
    # a live card's speed is measured on it: without one here, a T4's datasheet stands in
    sheet = time_model.device_speed("T4")
    monkeypatch.setattr(time_model, "device_speed", lambda gpu: sheet)
    card = GPU("Tesla T4", t4.total_memory, (7, 5), free_memory=10 * GiB, live=True) if live else t4
    fig = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(fig)
    plan = fit_views._draw_explorer(fig, "card", 50, 256, 8, gpus={"card": card})
    memory = 10 * GiB if live else t4.total_memory  # free now, or all PyTorch reports
    assert plan.budget_bytes == memory // 2 and plan.peak_bytes <= memory // 2
    ax = fig.axes[0]
    assert [line.get_xdata()[0] for line in ax.get_lines()] == [memory / 2 / GiB, memory / GiB]
    capacity = ax.get_legend().get_texts()[1].get_text()
    assert capacity == ("Tesla T4: 10.00 GiB free of 14.58 GiB as PyTorch reports it" if live
                        else "T4: 14.58 GiB as PyTorch reports it\n(nvidia-smi: 15,360 MiB)")
    fig.canvas.draw()


def test_the_explorer_draws_a_plan_that_fits_its_budget(capsys):
    fig = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(fig)
    plan = fit_views._draw_explorer(fig, "T4", 90, 1024, 64, gpus=GPUS)
    budget = GPUS["T4"].total_memory * 90 // 100
    assert plan.budget_bytes == budget and plan.peak_bytes <= budget
    # a T4 has no bf16 tensor cores: fp16 mixed precision or fp32, whichever fits the larger
    # model (with foreach AdamW, the master weights' step can cost more bytes than fp32's)
    assert plan.step.precision in ("fp16-mixed", "fp32")
    out = capsys.readouterr().out
    assert out.startswith("T4: the largest GPT that trains in 90% of its memory, 13.12 GiB")
    assert f"checkpoint : {plan.label} " in out and "trained naively" in out
    fig.canvas.draw()


def test_the_explorer_widget_opens_on_its_settings_and_names_a_bad_one(capsys):
    box = fit_views.explorer_widget(gpu="A100 80GB", seq_len=2048, effective_batch=32)
    assert {name: c.value for name, c in box.controls.items()} == dict(
        gpu="A100 80GB", usable=90, seq_len=2048, effective_batch=32)
    assert capsys.readouterr().out.startswith("A100 80GB: the largest GPT that trains in 90%")
    for kwargs, name in ((dict(gpu="K80"), "gpu"), (dict(seq_len=1000), "seq_len"),
                         (dict(effective_batch=3), "effective_batch")):
        with pytest.raises(ValueError, match=name):
            fit_views.explorer_widget(**kwargs)


def test_draw_largest_puts_each_plan_beside_its_step():
    from course_lib.planning import fit

    space = dict(space=fit.search_space(seq_len=32, vocab_size=64, widths=range(16, 129, 16),
                                        depths=range(1, 9), head_size=16, aspect_ratio=None),
                 effective_batch=4)
    fits = {"fp32": fit.fit_model(2 * MiB, precisions=("fp32",), **space),
            "bf16": fit.fit_model(2 * MiB, precisions=("bf16",), **space)}
    fig = Figure(figsize=(10, 3.4))
    FigureCanvasAgg(fig)
    fit_views.draw_largest(fig, fits, budget=2 * MiB)
    left, right = fig.axes
    assert [p.get_width() for p in left.patches] == [f.n_params / 1e6 for f in fits.values()]
    assert right.get_xlabel() == "its predicted step (MiB)"
    fig.canvas.draw()
    with pytest.raises(ValueError, match="fits"):
        fit_views.draw_largest(Figure(), {"a": 1}, budget=MiB)
