"""Widgets stay quick on a first visit: what does not change with a control is counted once, when
the widget is built (course_lib.prediction.time_model.count_ops), and no later move of a menu
runs a tiny model to count its operators again."""

import contextlib
import io

import ipywidgets as widgets
import pytest

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig
from course_lib.prediction import time_model
from course_lib.views import fit_views, ladder_view
from course_lib.views.widgets import live_plot

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=3, dropout=0.1)


def _counted() -> int:
    """How many times a tiny model has been run to count operators in this process."""
    return time_model._ops.cache_info().misses


def test_count_ops_keeps_what_step_time_asks_for():
    time_model.count_ops([SMALL], modes=["sqrt", "selective"], precisions=["bf16-mixed"])
    before = _counted()
    for mode in ("none", "sqrt", "blocks", "selective"):
        fresh = time_model.step_time(SMALL, 2, 3, mode=mode, precision="bf16-mixed", gpu="T4")
        assert fresh.ops > 0
    assert _counted() == before  # nothing counted again


@pytest.mark.parametrize("bad", [
    dict(configs="gpt"), dict(configs=[SMALL], modes=["fast"]),
    dict(configs=[SMALL], precisions=["fp8"]), dict(configs=[SMALL], precisions={"fp32"})])
def test_count_ops_names_a_bad_argument(bad):
    with pytest.raises(ValueError, match="configs|modes|precisions"):
        time_model.count_ops(**bad)


def test_gpu_explorer_counts_nothing_on_a_first_visit_to_a_card_or_length():
    gpus = fit_views.explorer_gpus(live=False)
    controls = {"gpu": widgets.Dropdown(options=list(gpus), value="T4"),
                "usable": widgets.IntSlider(value=90, min=50, max=100, step=5),
                "seq_len": widgets.SelectionSlider(options=fit_views.SEQ_LENS, value=1024),
                "effective_batch": widgets.SelectionSlider(options=fit_views.EFFECTIVE_BATCHES,
                                                           value=64)}
    with contextlib.redirect_stdout(io.StringIO()):
        live_plot(lambda fig, **values: fit_views.draw_explorer(fig, **values, gpus=gpus),
                  controls, setup=fit_views.setup_explorer, figsize=(9, 3.6))
        before = _counted()
        for name in [g for g in gpus if g != "T4"][:4]:
            controls["gpu"].value = name
        for seq_len in (256, 8192):  # a plan without checkpointing, and one with
            controls["seq_len"].value = seq_len
    assert _counted() == before


def test_ladder_counts_nothing_on_a_first_visit_to_a_card_or_model():
    box = ladder_view.ladder_explorer()
    before = _counted()
    with contextlib.redirect_stdout(io.StringIO()):
        for name in list(GPUS)[:4]:
            box.controls["gpu"].value = name
        for name in list(ladder_view.LADDER_MODELS)[:2]:
            box.controls["model"].value = name
    assert _counted() == before
