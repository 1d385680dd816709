"""course_lib.views.widgets.live_plot: one figure per widget, a PNG per change, messages for bad input."""

import io

import ipywidgets as widgets
import pytest
from PIL import Image

from course_lib.views.widgets import live_plot, render_png


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(data)).size


def _box(**kwargs):
    figures = []

    def draw(fig, n, label):
        figures.append(fig)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n == 13:
            raise ZeroDivisionError("unlucky")
        ax = fig.subplots()
        ax.bar(["a", "b"], [n, 2 * n])
        ax.set_title(label)
        print(f"drew n={n}")

    n = widgets.IntSlider(value=1, min=-5, max=20)
    label = widgets.Dropdown(options=["x", "y"], value="x")
    return live_plot(draw, {"n": n, "label": label}, **kwargs), n, label, figures


def test_first_view_is_a_png_of_the_figure_size():
    box, *_ = _box(figsize=(4, 2))
    assert _png_size(box.image.value) == (400, 200)  # inches x 100 dpi
    assert box.image.layout.display is None


def test_every_change_redraws_the_same_figure_with_new_pixels():
    box, n, label, figures = _box()
    first = box.image.value
    n.value = 7
    assert box.image.value != first
    after_n = box.image.value
    label.value = "y"
    assert box.image.value != after_n
    assert len(figures) == 3 and all(f is box.figure for f in figures)
    assert len(box.figure.axes) == 1  # cleared before each draw, not drawn over


def test_a_bad_value_shows_its_message_instead_of_the_figure(capsys):
    box, n, _, _ = _box()
    capsys.readouterr()
    n.value = -1
    shown = capsys.readouterr().out
    assert "⚠ n must be >= 0, got -1" in shown and "Traceback" not in shown
    assert box.image.layout.display == "none"
    n.value = 13
    assert "⚠ ZeroDivisionError: unlucky" in capsys.readouterr().out  # not a ValueError: named
    n.value = 2
    assert "drew n=2" in capsys.readouterr().out
    assert box.image.layout.display is None


@pytest.mark.parametrize("kwargs, message", [
    ({"controls": {}}, "controls must name at least one widget"),
    ({"figsize": (0, 3)}, "figsize must be two positive numbers"),
    ({"figsize": (4,)}, "figsize must be two positive numbers"),
    ({"figsize": 5}, "figsize must be two positive numbers"),
])
def test_wrong_arguments_name_the_parameter(kwargs, message):
    controls = kwargs.pop("controls", {"n": widgets.IntSlider()})
    with pytest.raises(ValueError, match=message):
        live_plot(lambda fig, n: None, controls, **kwargs)


def test_render_png_draws_the_figure_at_its_dpi():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 1.5), dpi=80)
    fig.subplots().plot([0, 1])
    assert _png_size(render_png(fig)) == (240, 120)


def test_setup_makes_the_artists_once_and_draw_only_updates_them():
    made = []

    def setup(fig):
        made.append(fig)
        ax = fig.subplots()
        return {"bars": ax.bar(["a", "b"], [0, 0]), "title": ax.set_title("")}

    def draw(artists, n):
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        for bar, height in zip(artists["bars"], (n, 2 * n)):
            bar.set_height(height)
        artists["title"].set_text(f"n = {n}")

    n = widgets.IntSlider(value=1, min=-5, max=20)
    box = live_plot(draw, {"n": n}, setup=setup)
    first = box.image.value
    n.value = 4
    assert made == [box.figure] and len(box.figure.axes) == 1  # not cleared, not rebuilt
    assert [b.get_height() for b in box.artists["bars"]] == [4, 8]
    assert box.artists["title"].get_text() == "n = 4" and box.image.value != first
    n.value = -1  # a bad value: its message, then the next good value draws again
    assert box.image.layout.display == "none"
    n.value = 2
    assert box.image.layout.display is None and box.artists["bars"][1].get_height() == 4
    with pytest.raises(ValueError, match="setup must be callable"):
        live_plot(draw, {"n": n}, setup="bars")


def test_animated_artists_are_drawn_over_the_kept_background():
    import numpy as np

    def setup(fig):
        ax = fig.subplots()
        ax.set_ylim(0, 10)
        bars = ax.bar(["a", "b"], [0, 0])
        title = ax.text(0.5, 9, "", ha="center")
        for artist in (*bars, title):
            artist.set_animated(True)
        return bars, title, ax

    def draw(artists, n):
        bars, title, ax = artists
        bars[0].set_height(n)
        bars[1].set_height(n / 2)
        title.set_text(f"n = {n}")
        ax.set_ylim(0, 10 if n < 10 else 20)  # a new background when the axes change

    n = widgets.IntSlider(value=3, min=0, max=15)
    box = live_plot(draw, {"n": n}, setup=setup, figsize=(3, 2))
    for value in (5, 12, 4):
        n.value = value
        blitted = np.asarray(Image.open(io.BytesIO(box.image.value)).convert("RGB"), dtype=float)
        for artist in box.figure.findobj(lambda a: a.get_animated()):
            artist.set_animated(False)
        full = np.asarray(Image.open(io.BytesIO(render_png(box.figure))).convert("RGB"),
                          dtype=float)
        for artist in (*box.artists[0], box.artists[1]):
            artist.set_animated(True)
        assert blitted.shape == full.shape
        assert np.abs(blitted - full).mean() < 0.5  # the same picture, to antialiasing
    assert len(box.backgrounds) == 2  # two states of the axes, each drawn in full once


def test_nice_ceiling_moves_in_few_steps():
    from course_lib.views.widgets import nice_ceiling

    assert [nice_ceiling(x) for x in (0.07, 1, 1.01, 3.2, 5, 7, 99, 1e9 + 1)] == [
        0.1, 1.0, 2.0, 5.0, 5.0, 10.0, 100.0, 2e9]
    assert len({nice_ceiling(x / 10) for x in range(1, 1001)}) == 10  # 0.1 .. 100: ten limits
    for bad in (0, -1, float("inf"), "3"):
        with pytest.raises(ValueError, match="x must be"):
            nice_ceiling(bad)
