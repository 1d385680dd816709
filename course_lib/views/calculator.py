"""01: model states (``TrainingMemory``) against a GPU's memory as PyTorch reports it: the
figures of lecture 01 and its calculator. Each card is a line labelled right of the axes, the
labels spread apart where cards are close (an A100 80GB and an H100 80GB differ by 32 MiB)."""

from __future__ import annotations

import ipywidgets as widgets
from IPython import get_ipython
from matplotlib.figure import Figure

from course_lib.device import GPU, GPUS
from course_lib.model.zoo import PRESETS
from course_lib.prediction.formulas import MAX_PARAMS, OPTIMIZERS, TrainingMemory, training_memory
from course_lib.units import GB, MEMORY_CATEGORIES, GiB, MiB, format_bytes
from course_lib.validation import choice, items, positive_int, text
from course_lib.views.widgets import agg_figure, live_plot, nice_ceiling, render_png

_PARTS = {name: c for name, c in MEMORY_CATEGORIES.items()  # the four model states
          if name in TrainingMemory.__dataclass_fields__}
_PRECISIONS = {"fp32": "fp32", "bf16-mixed (fp32 master)": "bf16-mixed",  # menu label -> value
               "fp16-mixed (fp32 master)": "fp16-mixed", "autocast (fp32 model)": "autocast-bf16",
               "pure bf16": "bf16"}
#: The numbers of data-parallel GPUs the calculator and the ZeRO figure offer.
WORLD_SIZES = tuple(2**i for i in range(11))
# the axes (figure fractions): room above for the title and legend, right for the GPU labels
_AXES = (0.08, 0.13, 0.50, 0.62)
_LABEL_X = 1.04   # the column of GPU labels, in axes fractions
_LABEL_PT = 8     # their font size
_FITS, _SHORT = "#1a7f37", "#6e7781"


def _gpus(gpus) -> list[GPU]:
    cards = [g if isinstance(g, GPU) else GPUS[choice("gpus", g, tuple(GPUS))]
             for g in items("gpus", tuple(GPUS) if gpus is None else gpus, min_len=1, max_len=12)]
    return sorted(cards, key=lambda g: g.capacity)


def _spread(fractions: list[float], gap: float) -> list[float]:
    """Label heights near ascending ``fractions``, ``gap`` apart, inside [0, 1] if there is room."""
    placed = []
    for f in fractions:
        placed.append(max(f, placed[-1] + gap) if placed else max(f, 0.0))
    top = 1.0
    for i in reversed(range(len(placed))):
        placed[i] = min(placed[i], top)
        top = placed[i] - gap
    return placed


def _new_figure(figsize) -> Figure:
    """A Figure on its own Agg canvas, which a notebook shows as a PNG when a cell returns it."""
    fig = agg_figure(figsize)
    shell = get_ipython()
    if shell is not None:  # the inline backend shows only pyplot's figures
        shell.display_formatter.formatters["image/png"].for_type(Figure, render_png)
    return fig


def _setup_lines(fig, ax, cards: list[GPU], animated: bool) -> dict:
    """A line per GPU and its label right of the axes; only the lines are ever animated."""
    lines = [ax.axhline(g.capacity / GiB, color=_SHORT, ls="--", lw=1, animated=animated)
             for g in cards]
    labels = [ax.annotate(g.capacity_label.replace(" (", "\n(", 1), xy=(1.0, g.capacity / GiB),
                          xycoords=("axes fraction", "data"), xytext=(_LABEL_X, 0.5),
                          textcoords="axes fraction", va="center", fontsize=_LABEL_PT,
                          color=_SHORT, annotation_clip=False,
                          arrowprops=dict(arrowstyle="-", color=_SHORT, lw=0.6,
                                          shrinkA=0, shrinkB=2, relpos=(0, 0.5)))
              for g in cards]
    return {"cards": cards, "lines": lines, "labels": labels}


def _place_labels(fig, ax, a: dict, fits=None) -> None:
    """Put each GPU label at its line's height (spread apart) and colour what fits."""
    to_axes = ax.transAxes.inverted()
    heights = [to_axes.transform(ax.transData.transform((0, g.capacity / GiB)))[1]
               for g in a["cards"]]
    axes_inches = fig.get_size_inches()[1] * ax.get_position().height
    gap = 2.8 * _LABEL_PT / 72 / axes_inches  # two lines each
    for label, line, y, card in zip(a["labels"], a["lines"], _spread(heights, gap), a["cards"]):
        label.set_position((_LABEL_X, y))
        if fits is not None:
            ok = fits(card)
            colour = _FITS if ok else _SHORT
            label.set_color(colour)
            label.arrow_patch.set_color(colour)
            line.set_color(colour)
            line.set_linestyle("-" if ok else "--")


def _setup_bars(fig, names: list[str], animated: bool, rect: tuple = _AXES) -> dict:
    ax = fig.add_axes(rect)
    x = range(len(names))
    bars = {part: ax.bar(x, [0] * len(names), width=0.55, color=colour, label=label)
            for part, (label, colour) in _PARTS.items()}
    ax.set_xticks(list(x), names, fontsize=9)
    ax.set(xlim=(-0.6, len(names) - 0.4), ylabel="GiB per GPU")
    ax.tick_params(axis="y", labelsize=8)
    legend = fig.legend(loc="lower left", bbox_to_anchor=(rect[0] - 0.01, 0.765), ncol=2,
                        fontsize=8, frameon=False, handlelength=1.2, columnspacing=1.2)
    title = fig.text(0.01, 0.985, "", va="top", fontsize=10)
    for artist in (*[p for c in bars.values() for p in c], legend, title):
        artist.set_animated(animated)
    return {"fig": fig, "ax": ax, "bars": bars, "legend": legend, "title": title}


def _set_bars(a: dict, states: list[TrainingMemory], scale: float = GiB) -> float:
    """Stack each bar's parts in ``scale`` bytes (one bar: sizes in the legend); the tallest."""
    bottoms = [0.0] * len(states)
    for (part, (label, _)), texts in zip(_PARTS.items(), a["legend"].get_texts()):
        for i, (patch, m) in enumerate(zip(a["bars"][part], states)):
            height = getattr(m, part) / scale
            patch.set_y(bottoms[i])
            patch.set_height(height)
            bottoms[i] += height
        if len(states) == 1:
            texts.set_text(f"{label}: {getattr(states[0], part) / GiB:,.1f} GiB")
    return max(bottoms)


def states_figure(bars: dict, *, gpus=None, per_param: int | None = None, title: str = "",
                  figsize: tuple = (8.4, 4.4)) -> Figure:
    """Model states as stacked bars against the memory of ``gpus``, shown as a cell's value; with
    ``per_param``, in bytes per parameter: what each recipe keeps, byte by byte.

    Args:
        bars (dict): label -> ``TrainingMemory``, one to six.
        gpus (list, optional): names of :data:`course_lib.device.GPUS` or ``GPU`` s, drawn as
            labelled lines; None for all of them (none with ``per_param``).
        per_param (int, optional): the parameters the bars count, from 1.
        title (str): the figure's title (two lines at most read well).
        figsize (tuple): inches.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas.
    Raises:
        ValueError: naming ``bars``, ``gpus``, ``per_param`` or ``title``, for a bad value.
    Example:
        >>> fig = states_figure({"fp32": training_memory(10),
        ...                      "bf16-mixed": training_memory(10, precision="bf16-mixed"),
        ...                      "bf16": training_memory(10, precision="bf16")}, per_param=10)
        >>> [label.get_text() for label in fig.axes[0].texts]  # above each bar
        ['16 bytes', '16 bytes', '8 bytes']
    """
    if not (isinstance(bars, dict) and 1 <= len(bars) <= 6 and all(
            isinstance(k, str) and isinstance(v, TrainingMemory) for k, v in bars.items())):
        raise ValueError(f"bars must be a dict of one to six labels to TrainingMemory, "
                         f"got {bars!r:.200}")
    scale = GiB
    if per_param is not None:
        scale = positive_int("per_param", per_param, maximum=MAX_PARAMS)
        if gpus is not None:
            raise ValueError("gpus must be None with per_param: bytes per parameter have no GPU lines")
    cards = _gpus(gpus) if per_param is None else []
    fig = _new_figure(figsize)
    a = _setup_bars(fig, list(bars), animated=False,
                    rect=_AXES if cards else (0.1, 0.13, 0.86, 0.62))
    if cards:
        a |= _setup_lines(fig, a["ax"], cards, animated=False)
    top = _set_bars(a, list(bars.values()), scale=scale)
    for i, m in enumerate(bars.values()):
        if not cards:
            a["ax"].text(i, m.total / scale, f"{m.total / scale:g} bytes", ha="center",
                         va="bottom", fontsize=8)
        elif len(bars) > 1:  # the parts' sizes differ per bar: the labels above say totals
            a["ax"].text(i, m.total / GiB, f"{m.total / GiB:,.1f} GiB\n= {m.total / GB:,.1f} GB",
                         ha="center", va="bottom", fontsize=8, linespacing=1.1,
                         bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none"))
    a["title"].set_text(text("title", title))
    if not cards:
        a["ax"].set_ylim(0, 1.2 * top)
        a["ax"].set_ylabel("bytes per parameter", fontsize=9)
        return fig
    a["ax"].set_ylim(0, nice_ceiling(1.1 * max(top, cards[-1].capacity / GiB)))
    _place_labels(fig, a["ax"], a)
    return fig


_DTYPE_COLOURS = {"float32": "#4c72b0", "bfloat16": "#55a868", "float16": "#dd8452",
                 "int64": "#8c8c8c"}


def activations_figure(saved: dict, *, title: str = "") -> Figure:
    """What autograd keeps for the backward pass, by dtype: a bar per recipe, its total and its
    ratio to the first.

    Args:
        saved (dict): label -> ``{dtype name: bytes}``, one to six, the first the reference.
        title (str): the figure's title.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas.
    Raises:
        ValueError: naming ``saved`` or ``title``, for a bad value.
    """
    if not (isinstance(saved, dict) and 1 <= len(saved) <= 6 and all(
            isinstance(k, str) and isinstance(v, dict) and v and all(
                isinstance(d, str) and isinstance(b, int) and b >= 0 for d, b in v.items())
            for k, v in saved.items())):
        raise ValueError(f"saved must be a dict of one to six labels to {{dtype name: bytes}}, "
                         f"got {saved!r:.200}")
    fig = _new_figure((8.4, 2.8))
    ax = fig.add_axes((0.16, 0.2, 0.62, 0.62))
    names = list(saved)[::-1]  # the first recipe on top
    reference = sum(next(iter(saved.values())).values())
    dtypes = [d for d in _DTYPE_COLOURS if any(d in v for v in saved.values())]
    dtypes += sorted({d for v in saved.values() for d in v} - set(dtypes))
    left = [0.0] * len(names)
    for dtype in dtypes:
        widths = [saved[name].get(dtype, 0) / MiB for name in names]
        ax.barh(names, widths, left=left, height=0.6, label=dtype,
                color=_DTYPE_COLOURS.get(dtype, "#b0b0b0"))
        left = [a + b for a, b in zip(left, widths)]
    for i, name in enumerate(names):
        total = sum(saved[name].values())
        ax.text(left[i], i, f"  {format_bytes(total)}  ({total / reference:.3f}x)",
                va="center", fontsize=8)
    ax.set_xlim(0, 1.35 * max(left))
    ax.set_xlabel("MiB saved for the backward pass", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.tick_params(axis="y", labelsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title="dtype", title_fontsize=8)
    fig.text(0.01, 0.985, text("title", title), va="top", fontsize=10)
    return fig


def zero_figure(n_params: int, *, title: str = "") -> Figure:
    """Model states per GPU under ZeRO stages 0-3 (Rajbhandari et al. 2020) against the number
    of data-parallel GPUs (:data:`WORLD_SIZES`), log-log, with mixed-precision AdamW, against
    every GPU: stage 3 falls as ``1/N``; stages 1 and 2 level off.

    Args:
        n_params (int): parameters, as for ``training_memory``.
        title (str): the figure's title.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas.
    Raises:
        ValueError: naming the argument, for a bad value.
    Example:
        >>> fig = zero_figure(6_738_415_616)  # Llama 2 7B
        >>> [f"{line.get_ydata()[-1]:.1f}" for line in fig.axes[0].lines[:4]]  # GiB, 1024 GPUs
        ['100.4', '25.2', '12.6', '0.1']
    """
    per_stage = {stage: [training_memory(n_params, precision="bf16-mixed", zero_stage=stage,
                                         world_size=n).total / GiB
                         for n in WORLD_SIZES] for stage in range(4)}
    cards = _gpus(None)
    fig = _new_figure((8.4, 4.4))
    ax = fig.add_axes((_AXES[0], _AXES[1], _AXES[2], 0.76))
    for stage, values in per_stage.items():
        ax.plot(WORLD_SIZES, values, marker="o", ms=3, label=f"stage {stage}")
    ax.set(xscale="log", yscale="log")
    ax.set_xticks(WORLD_SIZES, [str(n) for n in WORLD_SIZES], fontsize=8)
    ax.minorticks_off()
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("data-parallel GPUs N", fontsize=9)
    ax.set_ylabel("model states per GPU (GiB)", fontsize=9)
    low = min(per_stage[3][-1], cards[0].capacity / GiB)
    high = max(per_stage[0][0], cards[-1].capacity / GiB)
    ax.set_ylim(low / 2, high * 2)
    ax.legend(loc="lower left", fontsize=8, title="ZeRO", title_fontsize=8)
    fig.text(0.01, 0.985, text("title", title), va="top", fontsize=10)
    a = _setup_lines(fig, ax, cards, animated=False)
    _place_labels(fig, ax, a)
    return fig


def _setup_calculator(fig) -> dict:
    a = _setup_bars(fig, ["per GPU"], animated=True)
    return a | _setup_lines(fig, a["ax"], _gpus(None), animated=True)


def _draw_calculator(a: dict, billions: float, optimizer: str, precision: str, zero_stage: int,
                     world_size: int) -> None:
    m = training_memory(round(billions * 1e9), optimizer=optimizer, precision=precision,
                        zero_stage=zero_stage, world_size=world_size)
    top = _set_bars(a, [m])
    a["ax"].set_ylim(0, nice_ceiling(1.1 * max(top, a["cards"][-1].capacity / GiB)))
    _place_labels(a["fig"], a["ax"], a, fits=lambda card: m.total <= card.capacity)
    fitting = [g.name for g in a["cards"] if m.total <= g.capacity]
    shown = next(k for k, v in _PRECISIONS.items() if v == precision)
    size = f"{billions:,.0f}B" if billions >= 100 else f"{billions:.3g}B"
    gpus = f"ZeRO stage {zero_stage} on {world_size} GPU" + ("s" if world_size > 1 else "")
    a["title"].set_text(
        f"{size} parameters, {optimizer}, {shown}, {gpus}\n"
        f"model states {m.total / GiB:,.1f} GiB per GPU: "
        + ("fit on every GPU here" if len(fitting) == len(a["cards"])
           else f"fit on {', '.join(fitting)}" if fitting else "fit on none of these GPUs"))


def _labelled(description: str, pixels: int) -> dict:
    """A control's label, shown whole, and its width."""
    return dict(description=description, style={"description_width": "initial"},
                layout=widgets.Layout(width=f"{pixels}px"))


def calculator(preset: str = "Llama 2 7B") -> widgets.VBox:
    """Lecture 01's calculator: ``training_memory`` per GPU for a model size (0.1 to 1000
    billion), optimizer, precision, ZeRO stage and GPUs, against every GPU (green: it fits).

    Args:
        preset (str): the model shown first, a name of :data:`course_lib.model.zoo.PRESETS`.
    Returns:
        ipywidgets.VBox: the preset menu above the view (``box.view``, a ``live_plot`` box).
    Raises:
        ValueError: naming ``preset``, for an unknown model.
    Example:
        >>> box = calculator("Llama 2 70B")
        >>> box.view.controls["zero_stage"].value = 3
        >>> box.view.controls["world_size"].value = 64
        >>> print(box.view.artists["title"].get_text())
        69B parameters, adamw, bf16-mixed (fp32 master), ZeRO stage 3 on 64 GPUs
        model states 16.1 GiB per GPU: fit on L4, A100 40GB, H100 80GB, A100 80GB, H200
    """
    start = PRESETS[choice("preset", preset, tuple(PRESETS))].published_params / 1e9
    sizes = {f"{10 ** (e / 20):.3g}": 10 ** (e / 20) for e in range(-20, 61)}
    sizes.update({f"{p.published_params / 1e9:.4g} ({name})": p.published_params / 1e9
                  for name, p in PRESETS.items()})
    size = widgets.SelectionSlider(options=sorted(sizes.items(), key=lambda item: item[1]),
                                   value=start, **_labelled("parameters (billions)", 480))
    menu = widgets.Dropdown(options=[("custom size", None)] + [
        (name, p.published_params / 1e9) for name, p in PRESETS.items()],
        value=start, **_labelled("model", 260))

    def use_preset(change):
        if change["new"] is not None:
            size.value = change["new"]

    def leave_preset(change):  # moving the slider away from a preset makes the size custom
        if menu.value is not None and change["new"] != menu.value:
            menu.value = None

    menu.observe(use_preset, names="value")
    size.observe(leave_preset, names="value")
    view = live_plot(_draw_calculator, {
        "billions": size,
        "optimizer": widgets.Dropdown(options=list(OPTIMIZERS), value="adamw",
                                      **_labelled("optimizer", 220)),
        "precision": widgets.Dropdown(options=list(_PRECISIONS.items()), value="bf16-mixed",
                                      **_labelled("precision", 300)),
        "zero_stage": widgets.Dropdown(options=[0, 1, 2, 3], value=0,
                                       **_labelled("ZeRO stage", 160)),
        "world_size": widgets.Dropdown(options=list(WORLD_SIZES), value=1,
                                       **_labelled("data-parallel GPUs", 220)),
    }, setup=_setup_calculator, figsize=(8.4, 4.4), columns=2)
    box = widgets.VBox([menu, view])
    box.view = view
    return box
