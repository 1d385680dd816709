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

Faster still, for a widget that redraws the same picture with other numbers: pass
``setup``. ``setup(fig)`` creates the axes and artists once and returns them (a dict, a
namespace, anything); on every change ``draw(artists, **values)`` only sets their data
(``set_height``, ``set_data``, ``set_text``, ``set_ylim``), as matplotlib's own animation API
does. Artists that ``setup`` marks ``set_animated(True)`` are then drawn over a stored picture
of the rest (blitting, :class:`Backgrounds`): the axes, ticks, labels and titles, most of a
redraw's time (laying out and rasterising text), are drawn only when they change
(``benchmarks/widget_latency.py`` times it).

Pitfall: ``draw`` must draw on the ``fig`` it is given (``fig.subplots()``,
``fig.subplots_adjust()``); a figure made with ``plt.subplots()`` inside it is not
the widget's and would be shown elsewhere, or not at all (ipywidgets 7).

Only APIs common to ipywidgets 7 (Colab) and 8 are used: ``observe(..., names="value")``,
``Output`` as a context manager, ``Image(value=<PNG bytes>)``.
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

from course_lib.validation import number

#: The widest or tallest figure ``live_plot`` draws, in inches.
MAX_INCHES = 50


def check_figsize(figsize) -> tuple[float, float]:
    """``figsize`` as two floats, if it is two positive numbers of inches, at most
    :data:`MAX_INCHES`.

    Args:
        figsize: what the caller passed.

    Returns:
        tuple: ``(width, height)``.

    Raises:
        ValueError: naming ``figsize``, for anything else (an int beyond float's range too).
    """
    try:
        ok = isinstance(figsize, tuple | list) and len(figsize) == 2 and all(
            number("figsize", x, above=0.0, maximum=MAX_INCHES) for x in figsize)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"figsize must be two positive numbers, at most {MAX_INCHES} (inches), "
                         f"got {figsize!r:.80}")
    return float(figsize[0]), float(figsize[1])


def check_chosen(controls: dict, values: dict) -> None:
    """Refuse a control left without a value (a menu set to ``None``), naming it.

    Args:
        controls (dict): keyword -> widget, as :func:`live_plot` takes them.
        values (dict): keyword -> the widget's value.

    Raises:
        ValueError: naming the first keyword whose value is None, with the control's options.
    """
    if not isinstance(controls, dict) or not isinstance(values, dict) or not set(values) <= set(
            controls):
        raise ValueError("controls and values must be dicts by keyword, values' keys among "
                         "controls'")
    for name, value in values.items():
        if value is None:
            options = getattr(controls[name], "options", None) or ()
            labels = [o[0] if isinstance(o, tuple) else o for o in options]
            raise ValueError(f"{name} must be one of {labels}, got None: choose one"
                             if labels else f"{name} must have a value, got None")


def check_figure(name: str, fig) -> Figure:
    """``fig`` if it is a matplotlib ``Figure``.

    Args:
        name (str): the caller's parameter, for the message.
        fig: what the caller passed.

    Returns:
        Figure: ``fig``.

    Raises:
        ValueError: naming ``name``, for anything else.
    """
    if not isinstance(fig, Figure):
        raise ValueError(f"{name} must be a matplotlib Figure, got {type(fig).__name__}")
    return fig


def show_error(exc: Exception) -> None:
    """How a widget reports bad input: one line, no traceback.

    A ``ValueError`` (the course's input checks) is printed as its message alone; any other
    exception with its type.

    Args:
        exc (Exception): what the widget's callback raised.
    """
    kind = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
    print(f"⚠ {kind}{exc}")


class Backgrounds:
    """The still part of a figure, rendered, for a few states of its axes (least recent dropped).

    An artist marked ``set_animated(True)`` is left out of a full draw; the rest, the
    background, is kept as pixels under a key made of what a ``draw`` function commonly
    changes besides animated artists: each axes' limits, scales, ticks, tick labels, axis
    labels and titles, its texts (with their colours and, for annotations, the point they
    point at), its lines (data, colour, style and width) and its legend's texts, and the
    figure's texts and legends' texts. Anything else that changes (a bar's height, say) must
    be animated. Text that changes with a few settings only is cheaper left in the background:
    each change of an animated text lays it out and rasterises every glyph again.

    Args:
        size (int): how many backgrounds are kept (least recently used dropped first).
    """

    def __init__(self, size: int = 8):
        self.size, self.saved = size, OrderedDict()

    @staticmethod
    def key(fig: Figure) -> tuple:
        """What the background of ``fig`` depends on, as a hashable key.

        Size, dpi, and per axes its limits, scales, ticks, tick labels, non-animated labels,
        texts, lines and legend texts; the figure's non-animated texts and legend texts.

        Args:
            fig (matplotlib.figure.Figure): the figure.

        Returns:
            tuple: a hashable key.
        """
        parts: list = [tuple(fig.get_size_inches()), fig.dpi]
        for ax in fig.axes:
            texts = (ax.xaxis.label, ax.yaxis.label, ax.title, ax._left_title, ax._right_title)
            parts += [ax.viewLim.bounds, ax.get_xscale(), ax.get_yscale(),
                      *(t.get_text() for t in texts if not t.get_animated()),
                      tuple(ax.get_xticks()), tuple(ax.get_yticks())]
            for axis in (ax.xaxis, ax.yaxis):
                formatter = axis.get_major_formatter()
                parts.append(tuple(getattr(formatter, "seq", ())))
            parts += [(t.get_text(), t.get_position(), str(t.get_color()), getattr(t, "xy", None))
                      for t in ax.texts if not t.get_animated()]
            parts += [(line.get_xydata().tobytes(), str(line.get_color()), line.get_linestyle(),
                       line.get_linewidth()) for line in ax.lines if not line.get_animated()]
            parts.append(Backgrounds._legend_texts(ax.get_legend()))
        parts += [t.get_text() for t in fig.texts if not t.get_animated()]
        parts += [Backgrounds._legend_texts(legend) for legend in fig.legends]
        return tuple(parts)

    @staticmethod
    def _legend_texts(legend) -> tuple:
        """The texts of a legend in the background (none for no legend or an animated one)."""
        if legend is None or legend.get_animated():
            return ()
        return tuple(t.get_text() for t in legend.get_texts())

    def get(self, key):
        """The background saved under ``key`` (now the most recently used), or None.

        Args:
            key (tuple): a :meth:`key`.

        Returns:
            The saved region (``canvas.copy_from_bbox``), or None.
        """
        if key in self.saved:
            self.saved.move_to_end(key)
        return self.saved.get(key)

    def put(self, key, region) -> None:
        """Save ``region`` under ``key``, dropping the least recently used beyond ``size``.

        Args:
            key (tuple): a :meth:`key`.
            region: the canvas region (``canvas.copy_from_bbox(fig.bbox)``).
        """
        self.saved[key] = region
        while len(self.saved) > self.size:
            self.saved.popitem(last=False)


def nice_ceiling(x: float) -> float:
    """The smallest of 1, 2 or 5 times a power of ten that is at least ``x``.

    An axis limit that moves in few steps, so that a widget's kept pictures of its axes
    (:class:`Backgrounds`) are reused as its numbers change.

    Args:
        x (float): a positive finite number.

    Returns:
        float: the limit.

    Raises:
        ValueError: if ``x`` is not a positive finite number.

    Example:
        >>> nice_ceiling(3.2), nice_ceiling(0.07), nice_ceiling(5)
        (5.0, 0.1, 5.0)
    """
    x = number("x", x, above=0.0)
    power = 10.0 ** math.floor(math.log10(x))
    for step in (1, 2, 5, 10):
        if step * power >= x * (1 - 1e-12):
            return float(step * power)
    raise AssertionError("unreachable")


def render_png(fig: Figure, backgrounds: Backgrounds | None = None) -> bytes:
    """The figure as PNG bytes, drawn once at its own size and dpi.

    With ``backgrounds`` and artists marked animated, only those are drawn, over the
    figure's still part, which is drawn in full when its :meth:`Backgrounds.key` is new
    (matplotlib's blitting, as its animations use it), and :func:`_png_bytes` encodes the
    pixels. zlib level 1: a chart of flat colours compresses almost as well as at the
    default level 6, in less time.

    Args:
        fig (matplotlib.figure.Figure): the figure (an Agg canvas for blitting).
        backgrounds (Backgrounds, optional): the cache of still parts; None draws everything.

    Returns:
        bytes: the PNG file.
    """
    animated = [] if backgrounds is None else fig.findobj(lambda a: a.get_animated())
    buffer = io.BytesIO()
    if not animated:
        fig.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
        return buffer.getvalue()
    canvas = fig.canvas
    key = backgrounds.key(fig)
    region = backgrounds.get(key)
    if region is None:
        canvas.draw()  # everything but the animated artists
        backgrounds.put(key, canvas.copy_from_bbox(fig.bbox))
    else:
        canvas.restore_region(region)
    for artist in sorted(animated, key=lambda a: a.get_zorder()):
        fig.draw_artist(artist)
    return _png_bytes(np.asarray(canvas.buffer_rgba()))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_bytes(rgba: np.ndarray) -> bytes:
    """An opaque picture as a PNG file: RGB, 8 bits, no row filter, zlib level 1.

    What a widget sends on every change. Pillow (which ``savefig`` and ``imsave`` use) tries
    four row filters on every row and keeps the best, which was half of the encoding time of a
    widget's picture and shrinks a chart of flat colours little: this writes the rows as they
    are (PNG filter type 0, ISO/IEC 15948 sections 9 and 11) in half the time, and the files
    come out smaller.

    Args:
        rgba (numpy.ndarray): ``uint8`` pixels, ``(height, width, 4)`` (the alpha channel is
            dropped: the figure is opaque) or ``(height, width, 3)``.

    Returns:
        bytes: the PNG file.

    Raises:
        ValueError: for anything but such an array.
    """
    if not (isinstance(rgba, np.ndarray) and rgba.dtype == np.uint8 and rgba.ndim == 3
            and rgba.shape[2] in (3, 4) and rgba.shape[0] and rgba.shape[1]):
        raise ValueError(f"rgba must be a uint8 array of shape (height, width, 3 or 4), got "
                         f"{getattr(rgba, 'dtype', type(rgba).__name__)} "
                         f"{getattr(rgba, 'shape', '')}")
    height, width = rgba.shape[:2]
    rows = np.zeros((height, 1 + 3 * width), np.uint8)  # each row: its filter byte (0), RGB
    rows[:, 1:].reshape(height, width, 3)[...] = rgba[..., :3]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(rows, 1)) + _chunk(b"IEND", b""))


def live_plot(draw: Callable[..., None], controls: dict[str, widgets.Widget], *,
              figsize: tuple[float, float] = (7.0, 3.5), layout: str | None = None,
              columns: int = 3, setup: Callable | None = None) -> widgets.VBox:
    """Controls over a figure that ``draw(fig, **values)`` redraws on every change.

    Args:
        draw (callable): ``draw(fig, **values)`` draws on the cleared figure; with ``setup``,
            ``draw(artists, **values)`` updates the artists ``setup`` made (the figure is
            not cleared).
        controls (dict): maps each keyword of ``draw`` to the widget that sets it.
        figsize (tuple): inches, at matplotlib's ``figure.dpi``.
        layout (str, optional): ``None``, ``"constrained"`` or ``"tight"``. ``None`` is fastest: the
            engines lay the figure out with a hidden extra draw, so ``draw`` (or ``setup``) places
            the axes with ``fig.subplots_adjust``.
        columns (int): controls per row.
        setup (callable, optional): ``setup(fig) -> artists``, called once, before the first
            ``draw``.

    Returns:
        A ``VBox`` with ``redraw()`` (tests and benchmarks call it), ``figure``, ``image``
        (the ``ipywidgets.Image`` holding the PNG), ``output`` (the ``ipywidgets.Output``
        holding what ``draw`` printed), ``controls``, ``artists`` (what ``setup``
        returned, else None) and ``backgrounds`` (the :class:`Backgrounds` of the figure with
        ``setup``, else None).

    Raises:
        ValueError: for no controls, an unknown layout, a figsize that is not two positive
            numbers, or a ``setup`` that is not callable.

    ``draw`` raising an exception shows its message in place of the figure.

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
    if not callable(draw):
        raise ValueError(f"draw must be a function draw(fig, **values), got {draw!r}")
    if not isinstance(controls, dict) or not all(
            isinstance(k, str) and isinstance(w, widgets.Widget) for k, w in controls.items()):
        raise ValueError(f"controls must be a dict of widgets by keyword, got {controls!r}")
    if not controls:
        raise ValueError("controls must name at least one widget")
    if layout is not None and layout not in ("constrained", "tight"):
        raise ValueError(f"layout must be None, 'constrained' or 'tight', got {layout!r}")
    figsize = check_figsize(figsize)
    if not isinstance(columns, int) or isinstance(columns, bool) or not 1 <= columns <= 12:
        raise ValueError(f"columns must be an int from 1 to 12, got {columns!r}")
    if setup is not None and not callable(setup):
        raise ValueError(f"setup must be callable or None, got {setup!r}")
    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)  # one canvas, one renderer: its text-metric cache outlives a redraw
    image = widgets.Image(format="png")
    out = widgets.Output()
    artists = setup(fig) if setup is not None else None
    backgrounds = Backgrounds() if setup is not None else None

    def redraw(change=None) -> None:
        values = {name: control.value for name, control in controls.items()}
        if setup is None:
            fig.clear()
        with out:
            if InteractiveShell.initialized():  # outside IPython it would print escape codes
                out.clear_output(wait=True)
            try:
                check_chosen(controls, values)
                draw(fig if setup is None else artists, **values)
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
