"""course_lib.views.checkpoint_views: lecture 04's figures and its explorer."""

import matplotlib

matplotlib.use("Agg")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from course_lib.device import GPUS  # noqa: E402
from course_lib.measurement.timeline import Timeline  # noqa: E402
from course_lib.model.gpt import GPTConfig  # noqa: E402
from course_lib.prediction import checkpointed  # noqa: E402
from course_lib.prediction.predict import Step, predict  # noqa: E402
from course_lib.training import checkpointing as ckpt  # noqa: E402
from course_lib.views import checkpoint_views as views  # noqa: E402


def test_explore_predicts_the_setting_and_the_plain_step():
    s = views._explore("T4", 48, "blocks", 8, 6)
    config = GPTConfig(**views._GPT2_SMALL, n_layers=48)
    assert s.precision == "autocast-fp16"
    step = Step(config, 6, precision="autocast-fp16", gpu="T4")
    assert s.memory.step == replace(step, mode="blocks") and s.plain.step == step
    assert s.memory.peak == predict(replace(step, mode="blocks")).peak
    assert s.plain.total > s.gpu.capacity > s.memory.total
    assert 1 < s.flop_ratio < 4 / 3 and s.segments is None
    assert views._explore("A100 80GB", 24, "none").precision == "autocast-bf16"
    assert views._explore("T4", 24, "none").flop_ratio == 1.0


def test_explore_segments_clips_k_and_names_the_best_count():
    s = views._explore("T4", 12, "sqrt", 50, 2)
    assert s.segments == 12
    config = GPTConfig(**views._GPT2_SMALL, n_layers=96)
    deep = views._explore("T4", 96, "sqrt", 32, 8)
    assert deep.best_segments == ckpt.best_segments(96, checkpointed.block_ratio(
        config, 8, dtype="fp16", gpu="T4", autocast=True))
    # at batch 8 the backward holds the peak (at batch 4 foreach AdamW's step would, for both)
    best = views._explore("T4", 96, "sqrt", deep.best_segments, 8)
    assert best.memory.total < views._explore("T4", 96, "blocks", 1, 8).memory.total


@pytest.mark.parametrize("kwargs,name", [
    (dict(gpu="V100"), "gpu"), (dict(layers=0), "layers"), (dict(layers=97), "layers"),
    (dict(mode="selective"), "mode"), (dict(segments=0), "segments"),
    (dict(batch_size=0), "batch_size"),
])
def test_explorer_names_a_bad_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        views.explorer(**kwargs)


def test_explorer_redraws_for_every_control():
    box = views.explorer()
    first = box.image.value
    assert "every block checkpointed" in box.artists["title"].get_text()
    for name, value in (("mode", "sqrt"), ("segments", 5), ("layers", 96),
                        ("batch_size", 16), ("gpu", "H100 80GB")):
        before = box.image.value
        box.controls[name].value = value
        assert box.image.value != before, name
    assert box.image.value != first
    title = box.artists["title"].get_text()
    assert "H100 80GB" in title and "5 segments" in title
    # the card's own label, wrapped before its nvidia-smi figure
    assert box.artists["card_text"].get_text() == (
        "H100 80GB: 79.10 GiB as PyTorch reports it\n(nvidia-smi: 81,559 MiB)")
    assert box.artists["card"].get_ydata()[0] == GPUS["H100 80GB"].total_memory / 2**30
    assert set(box.controls["gpu"].options) == set(GPUS)


def test_plots_draw_and_label_what_they_are_given():
    fig = Figure()
    ax = fig.subplots()
    views.plot_timelines(ax, {"none": Timeline([0, 1, 2], [0, 2**20, 0], unit="event")})
    assert ax.get_legend().get_texts()[0].get_text() == "none: peak 1.00 MiB"
    fig = Figure()
    ax = fig.subplots()
    depths = [4, 16, 64]
    measured = {"none": [4 * 2**20, 16 * 2**20, 64 * 2**20], "per-block": [2**20] * 3}
    views.plot_depths(ax, depths, measured)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == "none: slope 1.00, 1.00 at 16-64" and len(labels) == 2


@pytest.mark.parametrize("call,name", [
    (lambda ax: views.plot_timelines(ax, {}), "timelines"),
    (lambda ax: views.plot_timelines(ax, {"x": [1, 2]}), "timelines"),
    (lambda ax: views.plot_depths(ax, [1, 2], {}), "measured"),
    (lambda ax: views.plot_depths(ax, [1], {"a": [1]}), "depths"),
    (lambda ax: views.plot_depths(ax, [1, 2], {"a": [1, 0]}), "measured"),
])
def test_plots_name_a_bad_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call(Figure().subplots())
