"""Thin ipywidgets views: controls over one figure that a drawing function redraws.

Every widget in the course is built with :func:`live_plot`. The widget owns one
matplotlib ``Figure`` for its whole life; on every change of a control it clears
the figure and calls ``draw(fig, **values)``, a function that calls one pure
``course_lib`` function and draws the result on ``fig``. The figure is rendered
once to a PNG that goes to an ``ipywidgets.Image``; what ``draw`` prints, and the
message for a bad value, go to an ``Output`` below it.

Why not ``plt.show()`` inside an ``Output``, the usual recipe: the inline backend
builds a new pyplot figure on every change and, with its default
``bbox_inches="tight"``, renders it twice (once to measure it, once to draw it).
That was most of each redraw (``benchmarks/widget_latency.py``). A figure that
lives as long as the widget keeps its Agg renderer, and with it matplotlib's cache
of text metrics; it is drawn once per change, without pyplot, so nothing is left
for the inline backend to show at the end of the cell or to leak.

Pitfall: ``draw`` must draw on the ``fig`` it is given (``fig.subplots()``,
``fig.subplots_adjust()``); a figure made with ``plt.subplots()`` inside it is not
the widget's and would be shown elsewhere, or not at all (ipywidgets 7).

Only APIs common to ipywidgets 7 (Colab) and 8 are used: ``observe(..., names="value")``,
``Output`` as a context manager, ``Image(value=<PNG bytes>)``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import ipywidgets as widgets
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: The widest or tallest figure ``live_plot`` draws, in inches.
MAX_INCHES = 50


def show_error(exc: Exception) -> None:
    """How a widget reports bad input: one line, no traceback."""
    kind = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
    print(f"⚠ {kind}{exc}")


def render_png(fig: Figure) -> bytes:
    """The figure as PNG bytes, drawn once at its own size and dpi.

    zlib level 1: a chart of flat colours compresses almost as well as at the
    default level 6, in less time.
    """
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
    return buffer.getvalue()


def live_plot(draw: Callable[..., None], controls: dict[str, widgets.Widget], *,
              figsize: tuple[float, float] = (7.0, 3.5), layout: str | None = None,
              columns: int = 3) -> widgets.VBox:
    """Controls over a figure that ``draw(fig, **values)`` redraws on every change.

    ``controls`` maps each keyword of ``draw`` to the widget that sets it. ``figsize``
    (inches, at matplotlib's ``figure.dpi``) and ``layout`` (``None``, ``"constrained"``
    or ``"tight"``; ``None`` is fastest, as the engines lay the figure out with a hidden
    extra draw, so ``draw`` places the axes with ``fig.subplots_adjust``) are those of
    the widget's one ``Figure``. ``draw`` raising an exception shows its
    message in place of the figure.

    The returned box has ``redraw()`` (tests and benchmarks call it), ``figure``,
    ``image`` (the ``ipywidgets.Image`` holding the PNG), ``output`` (the
    ``ipywidgets.Output`` holding what ``draw`` printed) and ``controls``.
    """
    if not callable(draw):
        raise ValueError(f"draw must be a function draw(fig, **values), got {draw!r}")
    if not isinstance(controls, dict) or not all(
            isinstance(k, str) and isinstance(w, widgets.Widget) for k, w in controls.items()):
        raise ValueError(f"controls must be a dict of widgets by keyword, got {controls!r}")
    if not controls:
        raise ValueError("controls must name at least one widget")
    if layout is not None and layout not in ("constrained", "tight"):
        raise ValueError(f"layout must be None, 'constrained' or 'tight', got {layout!r}")
    if not (isinstance(figsize, (tuple, list)) and len(figsize) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                    and math.isfinite(x) and 0 < x <= MAX_INCHES for x in figsize)):
        raise ValueError(f"figsize must be two positive numbers, at most {MAX_INCHES} (inches), "
                         f"got {figsize!r}")
    if not isinstance(columns, int) or isinstance(columns, bool) or not 1 <= columns <= 12:
        raise ValueError(f"columns must be an int from 1 to 12, got {columns!r}")
    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)  # one canvas, one renderer: its text-metric cache outlives a redraw
    image = widgets.Image(format="png")
    out = widgets.Output()

    def redraw(change=None) -> None:
        values = {name: control.value for name, control in controls.items()}
        fig.clear()
        with out:
            out.clear_output(wait=True)
            try:
                draw(fig, **values)
                png = render_png(fig)
            except Exception as exc:  # a bad value must show a message, not kill the view
                image.layout.display = "none"
                show_error(exc)
                return
        image.value = png
        image.layout.display = None

    for control in controls.values():
        control.observe(redraw, names="value")
    items = list(controls.values())
    rows = [widgets.HBox(items[i:i + columns]) for i in range(0, len(items), columns)]
    box = widgets.VBox([*rows, image, out])
    box.redraw, box.figure, box.image, box.output, box.controls = redraw, fig, image, out, controls
    redraw()
    return box
