"""Widgets stay quick on a first visit: the time model reads the operators of a step from a
recorded table (course_lib.prediction.time_model.OP_COUNTS), so that no setting, built or visited,
runs a model to count them."""

import contextlib
import io

import ipywidgets as widgets
import pytest

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig
from course_lib.prediction import time_model
from course_lib.prediction.predict import Step, predict
from course_lib.views import fit_views, ladder_view
from course_lib.views.widgets import live_plot

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=3, dropout=0.1)


@pytest.fixture(autouse=True)
def no_counting(monkeypatch):
    """Running a model to count operators fails the test."""
    def refused(*args, **kwargs):
        raise AssertionError("a model was run to count operators")
    monkeypatch.setattr(time_model, "count_step_ops", refused)
    monkeypatch.setattr(time_model, "_tiny_steps", refused)


def test_step_time_reads_the_counts_for_every_mode_and_precision():
    for mode in ("none", "sqrt", "blocks", "selective", "attention"):
        for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
            step = Step(SMALL, 2, 3, mode=mode, precision=precision, gpu="T4")
            assert predict(step).time.ops > 0


def test_gpu_explorer_counts_nothing_on_a_first_visit_to_a_card_or_length():
    gpus = fit_views._explorer_gpus(live=False)
    controls = {"gpu": widgets.Dropdown(options=list(gpus), value="T4"),
                "usable": widgets.IntSlider(value=90, min=50, max=100, step=5),
                "seq_len": widgets.SelectionSlider(options=fit_views._SEQ_LENS, value=1024),
                "effective_batch": widgets.SelectionSlider(options=fit_views._EFFECTIVE_BATCHES,
                                                           value=64)}
    with contextlib.redirect_stdout(io.StringIO()):
        live_plot(lambda fig, **values: fit_views._draw_explorer(fig, **values, gpus=gpus),
                  controls, setup=fit_views._setup_explorer, figsize=(9, 3.6))
        for name in [g for g in gpus if g != "T4"][:4]:
            controls["gpu"].value = name
        for seq_len in (256, 8192):  # a plan without checkpointing, and one with
            controls["seq_len"].value = seq_len


def test_ladder_counts_nothing_on_a_first_visit_to_a_card_or_model():
    box = ladder_view.ladder_explorer()
    with contextlib.redirect_stdout(io.StringIO()):
        for name in list(GPUS)[:4]:
            box.controls["gpu"].value = name
        for name in list(ladder_view.LADDER_MODELS)[:2]:
            box.controls["model"].value = name
