"""course_lib.views.policy_views: lecture 05's figures read well, and its planner widget redraws."""

import itertools

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from course_lib.model.gpt import GPTConfig
from course_lib.planning import planner
from course_lib.prediction.predict import Step, predict
from course_lib.units import MiB
from course_lib.views import policy_views

CONFIG = GPTConfig(vocab_size=40, seq_len=32, d_model=32, n_heads=4, n_layers=4,
                   attention="explicit")
STEP = Step(CONFIG, 4, first_step=True)


def _axes(size=(6.8, 3.6)):
    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _texts_readable(fig):
    """Every text at least FONT points; no two texts of an axes overlap."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        texts = [t for t in ax.texts if t.get_text()]
        texts += [t for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
        assert all(t.get_fontsize() >= policy_views._FONT for t in texts)
        boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_text()]
        for a, b in itertools.combinations(boxes, 2):
            assert policy_views._overlap(a, b) == 0, (a, b)


def test_labels_of_crowded_points_do_not_overlap():
    fig, ax = _axes()
    points = [(8.9, 1.40), (20.3, 1.27), (20.5, 1.25), (26.3, 1.20), (28.5, 1.46),
              (30.3, 1.51), (37.8, 1.0), (26.3, 1.21)]
    ax.set(xlim=(0, 42), ylim=(0.9, 1.65))
    for x, y in points:
        ax.plot(x, y, "o")
    texts = policy_views._place_labels(ax, points, [f"policy/{i}" for i in range(len(points))])
    assert len(texts) == len(points)
    _texts_readable(fig)
    inside = ax.get_window_extent(fig.canvas.get_renderer())
    for t in texts:
        box = t.get_window_extent(fig.canvas.get_renderer())
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 <= inside.y1


def _crossed(box, line, renderer):
    """Whether a line of the axes runs through a display box (its path sampled a pixel apart)."""
    xy = line.axes.transData.transform(line.get_xydata())
    for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:]):
        for t in np.linspace(0, 1, int(np.hypot(x1 - x0, y1 - y0)) + 2):
            if box.contains(x0 + t * (x1 - x0), y0 + t * (y1 - y0)):
                return True
    return False


def test_labels_keep_off_lines_markers_and_the_legend():
    # The frontier's shape in lecture 05 on a CPU: the label of the point beside the line went
    # onto the line, against the next point; a label must cross no drawn line, cover no marker
    # of any series and stay clear of the legend.
    fig, ax = _axes()
    points = [(37.8 * MiB, 1.0, "none"), (9.0 * MiB, 1.42, "blocks/1"),
              (20.5 * MiB, 1.245, "blocks/2"), (26.3 * MiB, 1.15, "blocks/3"),
              (20.3 * MiB, 1.19, "sqrt"), (28.5 * MiB, 1.29, "attention/1"),
              (30.3 * MiB, 1.64, "selective/1")]
    policy_views.draw_frontier(ax, points, {"none", "blocks/1", "sqrt", "blocks/3"})
    renderer = fig.canvas.get_renderer()
    drawn = [line for line in ax.lines if line.get_linestyle() not in ("None", "")]
    legend = ax.get_legend().get_window_extent(renderer)
    for text in ax.texts:
        box = text.get_window_extent(renderer)
        assert not any(_crossed(box, line, renderer) for line in drawn), text.get_text()
        assert policy_views._overlap(box, legend) == 0, text.get_text()
    fig, ax = _axes((5.6, 3.2))
    share = [1, 0.5, 1 / 3, 1 / 3, 1 / 3, 1 / 6]
    policy_views.draw_every_k(ax, share, [1, 0.6, 0.4, 0.4, 0.2, 0.2], share,
                              [f"every {k}" for k in range(1, 7)])
    renderer = fig.canvas.get_renderer()
    markers = [ax.transData.transform(xy) for line in ax.lines if line.get_marker() != "None"
               for xy in line.get_xydata()]
    for text in ax.texts:
        box = text.get_window_extent(renderer)
        assert not any(_crossed(box, line, renderer) for line in ax.lines[:1]), text.get_text()
        assert not any(box.contains(*xy) for xy in markers), text.get_text()


def test_points_that_coincide_get_one_label():
    # Every 3rd and every 4th of 6 blocks checkpoint the same two: one point, one label.
    fig, ax = _axes((5.6, 3.2))
    share = [1, 0.5, 1 / 3, 1 / 3, 1 / 3, 1 / 6]
    policy_views.draw_every_k(ax, share, [1, 0.6, 0.4, 0.4, 0.2, 0.2], share,
                              [f"every {k}" for k in range(1, 7)])
    assert sorted(t.get_text() for t in ax.texts) == [
        "every 1", "every 2", "every 3, every 4", "every 5", "every 6"]


def test_the_lecture_figures_draw_readable_text():
    fig, ax = _axes((6.4, 3.2))
    policy_views.draw_question(ax, (0, 38 * MiB), (24.7, 9 * MiB))
    _texts_readable(fig)
    fig, ax = _axes((5.6, 3.2))
    share = [1, 0.5, 1 / 3, 1 / 3, 1 / 3, 1 / 6]
    policy_views.draw_every_k(ax, share, [1, 0.6, 0.4, 0.4, 0.2, 0.2], share,
                              [f"every {k}" for k in range(1, 7)])
    _texts_readable(fig)
    fig, ax = _axes((7.2, 2.6))
    policy_views.draw_policy_costs(ax, {"none": 4 * MiB, "full": 0, "save": 2 * MiB},
                                   {"none": "nothing", "full": "3 matmuls", "save": "add"})
    _texts_readable(fig)
    fig, ax = _axes()
    points = [(38 * MiB, 1.0, "none"), (9 * MiB, 1.4, "blocks/1"), (20 * MiB, 1.2, "blocks/2"),
              (30 * MiB, 1.5, "selective/1"), (20.3 * MiB, 1.13, "sqrt")]
    policy_views.draw_frontier(ax, points, {"none", "blocks/1", "sqrt"})
    _texts_readable(fig)


def test_planner_widget_shows_the_planners_choice_for_the_budget():
    box = policy_views.planner_widget(STEP)
    box.controls["budget"].value = 100
    bars, line, note, title = box.artists
    plain = predict(STEP).peak.step_peak
    assert title.get_text().startswith("the planner picks none") and len(bars) == len(
        planner.choices(planner.candidates(STEP)))
    first = box.image.value
    box.controls["budget"].value = 50
    plan = planner.plan_checkpointing(STEP, int(plain * 0.5))
    assert title.get_text().startswith(f"the planner picks {plan.label}: ")
    assert f"+{plan.recompute_fraction:.1%} FLOPs" in title.get_text()
    assert box.image.value != first and line.get_xdata()[0] == pytest.approx(
        int(plain * 0.5) / MiB)
    assert sum(b.get_edgecolor() == (0, 0, 0, 1) for b in bars) == 1  # the choice, outlined
    box.controls["budget"].value = 10
    assert title.get_text().startswith("nothing fits")
    assert all(t.get_fontsize() >= policy_views._FONT for t in box.figure.axes[0].get_yticklabels())
    with pytest.raises(TypeError, match="step"):
        policy_views.planner_widget(CONFIG)
