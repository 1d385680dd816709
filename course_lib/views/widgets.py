"""Thin ipywidgets views: controls over one figure that a drawing function redraws.

Every widget of the course is a :func:`live_plot`: one matplotlib ``Figure`` on its own Agg canvas
(pyplot's inline backend would build and render a new figure twice per change), sent to an
``ipywidgets.Image`` as a PNG, with only APIs common to ipywidgets 7 (Colab) and 8.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable

import ipywidgets as widgets
import numpy as np
from IPython.core.interactiveshell import InteractiveShell
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from course_lib.units import GiB, MiB
from course_lib.validation import function, integer, number

#: The widest or tallest figure ``live_plot`` draws, in inches.
MAX_INCHES = 50


def _check_figsize(figsize) -> tuple[float, float]:
    """``(width, height)`` as floats, if ``figsize`` is two positive inches up to MAX_INCHES."""
    try:
        width, height = (number("figsize", x, above=0.0, maximum=MAX_INCHES) for x in figsize)
    except (TypeError, ValueError):
        raise ValueError(f"figsize must be two positive numbers, at most {MAX_INCHES} (inches), "
                         f"got {figsize!r:.80}") from None
    return width, height


def chosen_values(controls: dict) -> dict:
    """The controls' values by keyword; a control left without a value (None) is refused."""
    values = {name: control.value for name, control in controls.items()}
    for name, value in values.items():
        if value is None:
            options = getattr(controls[name], "options", None) or ()
            labels = [o[0] if isinstance(o, tuple) else o for o in options]
            raise ValueError(f"{name} must be one of {labels}, got None: choose one"
                             if labels else f"{name} must have a value, got None")
    return values


def check_figure(name: str, fig) -> Figure:
    """``fig`` if it is a matplotlib ``Figure``, else a ValueError naming ``name``."""
    if not isinstance(fig, Figure):
        raise ValueError(f"{name} must be a matplotlib Figure, got {type(fig).__name__}")
    return fig


def agg_figure(figsize) -> Figure:
    """A Figure of ``figsize`` inches (checked) on its own Agg canvas, without pyplot."""
    fig = Figure(figsize=_check_figsize(figsize))
    FigureCanvasAgg(fig)  # one canvas, one renderer: its text-metric cache outlives a redraw
    return fig


def unit_of(nbytes: int) -> tuple[int, str]:
    """``(bytes per unit, name)`` to show ``nbytes`` in: GiB from 2 GiB on, else MiB."""
    return (GiB, "GiB") if nbytes >= 2 * GiB else (MiB, "MiB")


def show_error(exc: Exception) -> None:
    """How a widget reports bad input: one line, no traceback (a ValueError without its type)."""
    kind = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
    print(f"⚠ {kind}{exc}")


def _legend_texts(legend) -> tuple:
    """The texts of a legend in the background (none for no legend or an animated one)."""
    still = legend is not None and not legend.get_animated()
    return tuple(t.get_text() for t in legend.get_texts()) if still else ()


class _Backgrounds(OrderedDict):
    """The still (not animated) part of a figure, rendered, for its last ``size`` states."""

    def __init__(self, size: int = 8):
        super().__init__()
        self.size = size

    @staticmethod
    def key(fig: Figure) -> tuple:
        """What a draw commonly changes besides animated artists (a bar's height must be)."""
        parts: list = [tuple(fig.get_size_inches()), fig.dpi]
        for ax in fig.axes:
            texts = (ax.xaxis.label, ax.yaxis.label, ax.title, ax._left_title, ax._right_title)
            parts += [ax.viewLim.bounds, ax.get_xscale(), ax.get_yscale(),
                      *(t.get_text() for t in texts if not t.get_animated()),
                      tuple(ax.get_xticks()), tuple(ax.get_yticks())]
            parts += [tuple(getattr(axis.get_major_formatter(), "seq", ()))
                      for axis in (ax.xaxis, ax.yaxis)]
            parts += [(t.get_text(), t.get_position(), str(t.get_color()), getattr(t, "xy", None))
                      for t in ax.texts if not t.get_animated()]
            parts += [(line.get_xydata().tobytes(), str(line.get_color()), line.get_linestyle(),
                       line.get_linewidth()) for line in ax.lines if not line.get_animated()]
            parts.append(_legend_texts(ax.get_legend()))
        parts += [t.get_text() for t in fig.texts if not t.get_animated()]
        parts += [_legend_texts(legend) for legend in fig.legends]
        return tuple(parts)


def nice_ceiling(x: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten >= ``x`` (few limits: backgrounds reused)."""
    x = number("x", x, above=0.0)
    power = 10.0 ** math.floor(math.log10(x))
    return float(next(s * power for s in (1, 2, 5, 10) if s * power >= x * (1 - 1e-12)))


def render_png(fig: Figure, backgrounds: _Backgrounds | None = None) -> bytes:
    """The figure as PNG bytes; with ``backgrounds``, only animated artists are drawn (blitting)."""
    animated = [] if backgrounds is None else fig.findobj(lambda a: a.get_animated())
    buffer = io.BytesIO()
    if not animated:
        # zlib level 1: flat colours compress almost as well as at level 6, in less time
        fig.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
        return buffer.getvalue()
    canvas = fig.canvas
    key = backgrounds.key(fig)
    if key in backgrounds:
        backgrounds.move_to_end(key)  # now the most recently used
        canvas.restore_region(backgrounds[key])
    else:
        canvas.draw()  # everything but the animated artists
        backgrounds[key] = canvas.copy_from_bbox(fig.bbox)
        if len(backgrounds) > backgrounds.size:
            backgrounds.popitem(last=False)  # the least recently used
    for artist in sorted(animated, key=lambda a: a.get_zorder()):
        fig.draw_artist(artist)
    return _png_bytes(np.asarray(canvas.buffer_rgba()))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_bytes(rgba: np.ndarray) -> bytes:
    """Opaque pixels as a PNG without row filters, in half Pillow's time (ISO/IEC 15948)."""
    height, width = rgba.shape[:2]
    rows = np.zeros((height, 1 + 3 * width), np.uint8)  # each row: its filter byte (0), RGB
    rows[:, 1:].reshape(height, width, 3)[...] = rgba[..., :3]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(rows, 1)) + _chunk(b"IEND", b""))


def live_plot(draw: Callable[..., None], controls: dict[str, widgets.Widget], *,
              figsize: tuple[float, float] = (7.0, 3.5), columns: int = 3,
              setup: Callable | None = None) -> widgets.VBox:
    """Controls over a figure that ``draw(fig, **values)`` redraws on every change.

    ``draw`` draws on the cleared ``fig`` it is given (``fig.subplots()``), never through pyplot;
    an exception shows its message in place of the figure. With ``setup(fig) -> artists``, called
    once, ``draw(artists, **values)`` only sets their data, and the artists marked
    ``set_animated(True)`` are drawn over a kept picture of the rest (blitting; see
    ``benchmarks/widget_latency.py``); place the axes with ``fig.subplots_adjust``.

    Args:
        draw (callable): ``draw(fig, **values)``; with ``setup``, ``draw(artists, **values)``.
        controls (dict): each keyword of ``draw`` -> the widget that sets it.
        figsize (tuple): inches.
        columns (int): controls per row.
        setup (callable, optional): ``setup(fig) -> artists``.
    Returns:
        ipywidgets.VBox: with ``redraw()``, ``figure``, ``image``, ``output``, ``controls``,
            ``artists`` and ``backgrounds``.
    Raises:
        ValueError: naming the argument, for a bad value.
    Example:
        >>> import ipywidgets as widgets
        >>> def setup(fig):
        ...     return fig.subplots().bar(["n"], [0])
        >>> def draw(bars, n):
        ...     bars[0].set_height(n)
        >>> box = live_plot(draw, {"n": widgets.IntSlider(value=3)}, setup=setup)
        >>> box.artists[0].get_height()
        3
    """
    function("draw", draw)
    if not isinstance(controls, dict) or not all(
            isinstance(k, str) and isinstance(w, widgets.Widget) for k, w in controls.items()):
        raise ValueError(f"controls must be a dict of widgets by keyword, got {controls!r}")
    if not controls:
        raise ValueError("controls must name at least one widget")
    columns = integer("columns", columns, minimum=1, maximum=12)
    function("setup", setup, optional=True)
    fig = agg_figure(figsize)
    image = widgets.Image(format="png")
    out = widgets.Output()
    artists = setup(fig) if setup is not None else None
    backgrounds = _Backgrounds() if setup is not None else None

    def redraw(change=None) -> None:
        if setup is None:
            fig.clear()
        with out:
            if InteractiveShell.initialized():  # outside IPython it would print escape codes
                out.clear_output(wait=True)
            try:
                draw(fig if setup is None else artists, **chosen_values(controls))
                png = render_png(fig, backgrounds)
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
    box.artists, box.backgrounds = artists, backgrounds
    redraw()
    return box
