"""Lecture 01's figures and calculator: model states against the memory PyTorch reports."""

import matplotlib.colors as mcolors
import pytest
from hypothesis import given, strategies as st
from matplotlib.text import Text

from course_lib.device import GPUS
from course_lib.model.zoo import PRESETS
from course_lib.prediction.formulas import TrainingMemory, training_memory
from course_lib.units import GiB
from course_lib.views import calculator as calc

P7 = PRESETS["Llama 2 7B"].published_params


def _label_boxes(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return [Text.get_window_extent(t, renderer) for t in fig.axes[0].texts  # the text, no leader
            if t.get_text().split(":")[0] in GPUS]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_states_figure_stacks_the_parts_and_labels_every_gpu_without_overlap():
    mixed = training_memory(P7, precision="bf16-mixed")
    fig = calc.states_figure({"weights": TrainingMemory(2 * P7, 0, 0, 0), "train": mixed},
                             title="question")
    ax = fig.axes[0]
    stacks = [p for p in ax.patches]
    # four parts x two bars, in stacking order; the second bar's tops add up to the total
    assert len(stacks) == 8
    second = stacks[1::2]
    assert second[-1].get_y() + second[-1].get_height() == pytest.approx(mixed.total / GiB)
    assert [round(p.get_height() * GiB) for p in second] == [
        mixed.parameters, mixed.master_weights, mixed.optimizer_state, mixed.gradients]
    labels = [t.get_text() for t in ax.texts if ":" in t.get_text()]
    # each card's own label, PyTorch's figure over nvidia-smi's, smallest card first
    assert labels[0] == "T4: 14.58 GiB as PyTorch reports it\n(nvidia-smi: 15,360 MiB)"
    assert "A100 80GB: 79.15 GiB as PyTorch reports it\n(nvidia-smi: 81,920 MiB)" in labels
    assert labels == [g.capacity_label.replace(" (", "\n(") for g in sorted(
        GPUS.values(), key=lambda g: g.total_memory)]
    boxes = _label_boxes(fig)
    assert len(boxes) == len(GPUS)
    assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert ax.get_ylim()[1] >= GPUS["H200"].total_memory / GiB


def test_states_figure_rejects_what_it_cannot_draw():
    with pytest.raises(ValueError, match="bars must be a dict"):
        calc.states_figure({"x": 3})
    with pytest.raises(ValueError, match="bars must be a dict"):
        calc.states_figure({})
    with pytest.raises(ValueError, match="^gpus must be one of"):
        calc.states_figure({"x": training_memory(10)}, gpus=["V100"])
    with pytest.raises(ValueError, match="title must be a str"):
        calc.states_figure({"x": training_memory(10)}, title=3)
    with pytest.raises(ValueError, match="gpus"):
        calc.states_figure({"x": training_memory(10)}, gpus=[])
    with pytest.raises(ValueError, match="figsize"):
        calc.states_figure({"x": training_memory(10)}, figsize=(0, 3))


def test_labels_of_close_cards_spread_even_when_every_line_is_at_the_bottom():
    view = calc.calculator().view
    view.controls["billions"].value = 1000.0  # 16 TB: every GPU line sits near zero
    fig = view.figure
    boxes = _label_boxes(fig)
    assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert "fit on none of these GPUs" in fig.texts[0].get_text()


@given(st.lists(st.floats(0, 1), min_size=1, max_size=8))
def test_spread_keeps_labels_a_gap_apart_in_order(fractions):
    fractions = sorted(fractions)
    placed = calc._spread(fractions, 0.1)
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(placed, placed[1:]))
    assert placed[-1] <= 1.0


def test_zero_figure_draws_each_stage_against_the_formula():
    fig = calc.zero_figure(P7)
    sizes = calc.WORLD_SIZES
    lines = [line for line in fig.axes[0].get_lines() if len(line.get_xdata()) == len(sizes)]
    assert len(lines) == 4
    for stage, line in enumerate(lines):
        assert list(line.get_ydata()) == pytest.approx([training_memory(
            P7, precision="bf16-mixed", zero_stage=stage, world_size=n).total / GiB
            for n in sizes])
    assert len(_label_boxes(fig)) == len(GPUS)
    with pytest.raises(ValueError, match="n_params"):
        calc.zero_figure(0)


def test_states_figure_per_param_divides_by_the_parameters():
    rows = {"fp32": training_memory(1000), "mixed": training_memory(1000, precision="bf16-mixed"),
            "pure": training_memory(1000, precision="bf16")}
    fig = calc.states_figure(rows, per_param=1000)
    tops = [t.get_text() for t in fig.axes[0].texts]
    assert tops == ["16 bytes", "16 bytes", "8 bytes"]
    with pytest.raises(ValueError, match="per_param"):
        calc.states_figure(rows, per_param=0)
    with pytest.raises(ValueError, match="bars must be a dict"):
        calc.states_figure({"x": 1}, per_param=10)
    with pytest.raises(ValueError, match="gpus must be None"):
        calc.states_figure(rows, per_param=1000, gpus=["T4"])


def test_activations_figure_gives_each_recipe_against_the_first():
    fig = calc.activations_figure({"fp32": {"float32": 4 * 2**20},
                                   "bf16": {"bfloat16": 2 * 2**20, "int64": 2**18}})
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("(1.000x)" in t for t in texts) and any("(0.562x)" in t for t in texts)
    with pytest.raises(ValueError, match="saved must be a dict"):
        calc.activations_figure({"fp32": {"float32": -1}})


def test_calculator_turns_the_lines_of_fitting_gpus_green_and_follows_its_menus():
    box = calc.calculator("Llama 2 7B")
    view, menu = box.view, box.children[0]
    title = view.artists["title"]
    assert title.get_text().endswith("model states 100.4 GiB per GPU: fit on H200")
    green = mcolors.to_hex(calc._FITS)
    colours = {card.name: mcolors.to_hex(line.get_color())
               for card, line in zip(view.artists["cards"], view.artists["lines"])}
    assert [name for name, c in colours.items() if c == green] == ["H200"]
    first = view.image.value
    view.controls["precision"].value = "bf16"  # pure bf16: 8 bytes/param, 50.2 GiB
    assert view.image.value != first and "H100 80GB" in title.get_text()
    view.controls["zero_stage"].value = 3
    view.controls["world_size"].value = 4
    assert "ZeRO stage 3 on 4 GPUs" in title.get_text()
    menu.value = PRESETS["Llama 2 70B"].published_params / 1e9
    assert view.controls["billions"].value == menu.value
    view.controls["billions"].value = view.controls["billions"].options[0][1]
    assert menu.value is None  # a size off the presets is custom
    assert view.output.outputs == ()


def test_calculator_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="preset must be one of"):
        calc.calculator("Llama 9")
