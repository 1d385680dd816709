"""08: where a step's bytes are, the figures of sections 2 to 4, and the fit ladder's widget."""

from __future__ import annotations

import functools
import math

import ipywidgets as widgets
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, NullFormatter
from matplotlib.transforms import offset_copy

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig
from course_lib.planning import fit_ladder
from course_lib.prediction.engine import StepMemory
from course_lib.units import MEMORY_CATEGORIES, GiB, MiB, format_bytes
from course_lib.validation import WrongTypeError, choice, items, number, positive_int
from course_lib.views.widgets import agg_figure, check_figure, live_plot

_GPT = functools.partial(GPTConfig, vocab_size=50257, seq_len=8192)
#: The explorer's models: the course GPT at the shapes of GPT-2 small to XL (Radford et al.
#: 2019) and of a 1.2B model with Llama 3's 128k vocabulary; ``seq_len`` is the longest offered.
LADDER_MODELS = {
    "GPT-2 small (124M)": _GPT(d_model=768, n_heads=12, n_layers=12),
    "GPT-2 medium (350M)": _GPT(d_model=1024, n_heads=16, n_layers=24),
    "GPT-2 large (774M)": _GPT(d_model=1280, n_heads=20, n_layers=36),
    "GPT-2 XL (1.5B)": _GPT(d_model=1600, n_heads=25, n_layers=48),
    "1.2B, 128k vocabulary": _GPT(vocab_size=128256, d_model=2048, n_heads=16, n_layers=16),
}
_SEQ_LENS = (512, 1024, 2048, 4096, 8192)
_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# The opening figure's parts: groups of MEMORY_CATEGORIES, each in its last category's colour.
_PARTS = (("parameters",), ("master_weights", "optimizer_state"), ("gradients",),
          ("activations",), ("transient",))
_FREE, _PAID, _NOTHING, _PLAIN = "#55a868", "#dd8452", "#c8c8c8", "0.45"
_LADDER_FIGSIZE = (9.5, 4.2)  # inches: the widget, its controls and its climb in one screen


def peak_parts_figure(jobs: dict[str, StepMemory], gpu: str, *,
                      fig: Figure | None = None) -> Figure:
    """One bar per job (label -> ``predict(step).peak``, at most 4) by part, against ``gpu``.

    Args:
        jobs (dict): a label per job -> its ``predict(step).peak``, at most 4 jobs.
        gpu (str): the preset whose memory the dashed line shows.
        fig (Figure, optional): an empty figure to draw on; None makes one with an Agg canvas.
    Returns:
        matplotlib.figure.Figure: the figure drawn on.
    Raises:
        ValueError: naming the argument, for a bad value.
    """
    if not isinstance(jobs, dict) or not 1 <= len(jobs) <= 4 or not all(
            isinstance(k, str) and isinstance(v, StepMemory) for k, v in jobs.items()):
        raise ValueError(f"jobs must map 1 to 4 labels to StepMemory peaks, got {jobs!r:.80}")
    card = GPUS[choice("gpu", gpu, tuple(GPUS))]
    budget = card.capacity
    fig = agg_figure((9.5, 2.9)) if fig is None else check_figure("fig", fig)
    ax = fig.subplots()
    fig.subplots_adjust(left=0.2, right=0.97, top=0.9, bottom=0.42)
    rows = list(jobs.items())
    left = [0.0] * len(rows)
    for fields in _PARTS:
        width = [sum(getattr(m, f) for f in fields) / GiB for _, m in rows]
        held = [f for f in fields if any(getattr(m, f) for _, m in rows)] or fields  # fp32: no masters
        ax.barh(range(len(rows)), width, left=left, color=MEMORY_CATEGORIES[fields[-1]].colour,
                label=" + ".join(MEMORY_CATEGORIES[f].label for f in held), height=0.6)
        left = [x + w for x, w in zip(left, width)]
    for i, (_, m) in enumerate(rows):
        ax.text(m.total / GiB, i, f" {format_bytes(m.total)}", va="center", fontsize=8.5)
    right = 5 * math.ceil(1.15 * max([m.total for _, m in rows] + [budget]) / GiB / 5)
    ax.axvline(budget / GiB, color="k", ls="--", lw=1)
    ax.text(budget / GiB, -0.62, " " + card.capacity_label, fontsize=8.5, va="bottom")
    ax.set(xlim=(0, right), ylim=(len(rows) - 0.5, -1.0), xlabel="GiB at the step's peak")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.3), ncol=3, fontsize=8.5,
              frameon=False)
    return fig


def _curves(name: str, value, length: int | None = None) -> dict[str, list[float]]:
    """``value`` as ``{label: [numbers]}``: one to six labels, every list as long (``length``)."""
    if not isinstance(value, dict) or not 1 <= len(value) <= 6 or not all(
            isinstance(k, str) for k in value):
        raise ValueError(f"{name} must map one to six labels to lists of numbers, got {value!r:.80}")
    out = {k: [number(name, x) for x in items(name, v, min_len=1)] for k, v in value.items()}
    lengths = {len(v) for v in out.values()} | ({length} if length else set())
    if len(lengths) != 1:
        raise ValueError(f"{name}'s lists must all have {length or 'the same'} values, "
                         f"got lengths {sorted(len(v) for v in out.values())}")
    return out


def chunked_loss_figure(vocabs, measured: dict, predicted: dict) -> Figure:
    """A step's peak against the vocabulary (log x), per loss: measured dots, predicted lines.

    Args:
        vocabs (list of int): the vocabulary sizes, the x axis.
        measured, predicted (dict): each loss's label -> bytes per vocabulary.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas.
    Raises:
        ValueError: naming the argument, for lists of another length or labels that differ.
    Example:
        >>> fig = chunked_loss_figure([16384, 32768], {"plain": [3e6, 5e6]}, {"plain": [3e6, 5e6]})
        >>> [line.get_label() for line in fig.axes[0].lines]
        ['plain loss, measured', 'plain loss, predicted']
        >>> [tick.get_text() for tick in fig.axes[0].get_xticklabels()]
        ['16k', '32k']
    """
    vocabs = [positive_int("vocabs", v) for v in items("vocabs", vocabs, min_len=1)]
    measured = _curves("measured", measured, len(vocabs))
    predicted = _curves("predicted", predicted, len(vocabs))
    if set(predicted) != set(measured):
        raise ValueError(f"predicted must have measured's labels {sorted(measured)}, "
                         f"got {sorted(predicted)}")
    fig = agg_figure((6.5, 2.8))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.11, right=0.97, top=0.95, bottom=0.19)
    for i, name in enumerate(measured):
        colour = ("C3", "C2", "C0", "C1", "C4", "C5")[i]
        ax.plot(vocabs, [b / MiB for b in measured[name]], "o", color=colour,
                label=f"{name} loss, measured")
        ax.plot(vocabs, [b / MiB for b in predicted[name]], "-", color=colour, lw=1,
                label=f"{name} loss, predicted")
    ax.set(xscale="log", xlabel="vocabulary V", ylabel="peak of the step (MiB)")
    ax.set_xticks(vocabs, [f"{v // 1024}k" if v % 1024 == 0 else f"{v:,}" for v in vocabs])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    return fig


def offload_price_figure(seconds: dict) -> Figure:
    """Per card, one step's predicted seconds: plain, plus what activation offloading adds;
    each card's link to the host (:attr:`course_lib.device.GPU.host_link`) under its name.

    Args:
        seconds (dict): one to six presets -> ``(plain, offloaded)`` seconds of one step.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas.
    Raises:
        ValueError: naming ``seconds``, for a bad value.
    Example:
        >>> fig = offload_price_figure({"T4": (5.5, 8.8), "H100 80GB": (0.66, 1.5)})
        >>> [label.get_text() for label in fig.axes[0].texts]  # after each bar: the price
        [' 8.8 s (+60%)', ' 1.5 s (+127%)']
    """
    if not isinstance(seconds, dict) or not 1 <= len(seconds) <= 6:
        raise ValueError(f"seconds must map one to six GPU presets to (plain, offloaded) "
                         f"seconds, got {seconds!r:.80}")
    rows = []
    for gpu, pair in seconds.items():
        choice("seconds", gpu, tuple(GPUS))
        plain, offloaded = (number("seconds", t, above=0.0) for t in items("seconds", pair,
                                                                            min_len=2, max_len=2))
        if offloaded < plain:
            raise ValueError(f"seconds[{gpu!r}] must not be faster with offloading, got "
                             f"{plain} then {offloaded}")
        rows.append((f"{gpu}\n{GPUS[gpu].host_link / 1e9:.0f} GB/s to the host", plain, offloaded))
    fig = agg_figure((6.5, 2.1))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.22, right=0.97, top=0.97, bottom=0.36)
    y = range(len(rows))
    plain = [r[1] for r in rows]
    ax.barh(y, plain, color=_PLAIN, height=0.6, label="the plain step (fp32 AdamW, whole batch)")
    ax.barh(y, [r[2] - r[1] for r in rows], left=plain, color=_PAID, height=0.6,
            label="added by activation offloading")
    for i, (_, before, after) in enumerate(rows):
        ax.text(after, i, f" {after:.2g} s ({after / before - 1:+.0%})", va="center", fontsize=8.5)
    ax.set_yticks(y, [r[0] for r in rows], fontsize=8.5)
    ax.set(xlim=(0, 1.3 * max(r[2] for r in rows)), ylim=(len(rows) - 0.5, -0.5),
           xlabel="seconds per step, predicted from datasheets")
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.3), ncol=2, fontsize=8, frameon=False)
    return fig


def loss_curves_figure(curves: dict, floor: float) -> Figure:
    """Loss curves of one to six runs (label -> loss per step) over ``floor``, the best possible.

    Args:
        curves (dict): each run's label -> its loss per optimizer step.
        floor (float): the best possible loss (the toy language's entropy), dotted.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas.
    Raises:
        ValueError: naming ``curves`` or ``floor``, for a bad value.
    Example:
        >>> fig = loss_curves_figure({"fp32 AdamW": [2.0, 1.2, 0.9]}, floor=0.69)
        >>> fig.axes[0].get_legend_handles_labels()[1]
        ['fp32 AdamW', 'best possible (0.690)']
    """
    curves = _curves("curves", curves)
    floor = number("floor", floor, minimum=0.0)
    fig = agg_figure((6.5, 3.6))
    ax = fig.subplots()
    # The legend sits under the axes: the curves meet near the floor, where it would cover them.
    fig.subplots_adjust(left=0.1, right=0.97, top=0.96, bottom=0.42)
    for label, losses in curves.items():
        ax.plot(losses, lw=1, label=label)
    ax.axhline(floor, color="k", ls=":", label=f"best possible ({floor:.3f})")
    ax.set(xlabel="optimizer step", ylabel="loss",
           ylim=(0.9 * floor, 1.05 * max(max(v) for v in curves.values())))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8, frameon=False)
    return fig


def state_bytes_figure(sizes, per_element: dict) -> Figure:
    """Optimizer state bytes per element against the parameter tensor's size, one line per run
    (label -> bytes per element at each of ``sizes``), over fp32 AdamW's 8 bytes (dotted).

    Args:
        sizes (Sequence[int]): the tensors' elements, the x ticks.
        per_element (dict): each run's label -> its state bytes per element at each size.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas.
    Raises:
        ValueError: naming ``sizes`` or ``per_element``, for a bad value.
    Example:
        >>> fig = state_bytes_figure([1024, 4096], {"8-bit AdamW": [8.0, 2.53]})
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['1,024', '4,096']
    """
    sizes = [positive_int("sizes", n) for n in items("sizes", sizes, min_len=1)]
    per_element = _curves("per_element", per_element, len(sizes))
    fig = agg_figure((7, 2.8))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.09, right=0.98, top=0.95, bottom=0.22)
    for label, values in per_element.items():
        ax.plot(values, "o-", label=label)
    ax.axhline(8, color="0.5", ls=":", label="fp32 AdamW: 8 bytes")
    ax.set_xticks(range(len(sizes)), [f"{n:,}" for n in sizes], fontsize=8)
    ax.set(xlabel="elements of the parameter tensor", ylabel="state bytes per element")
    ax.legend(fontsize=8)
    return fig


# --------------------------------------------------------------------------- the ladder


def _setup(fig, animated: bool = True) -> dict:
    """The ladder chart's axes and artists, made once: a bar and a label per row."""
    ax = fig.subplots()
    fig.subplots_adjust(left=0.31, right=0.97, bottom=0.175, top=0.93 if animated else 0.885)
    # the plain step, then every rung (a batch of 2 or more has them all)
    rows = 1 + len(fit_ladder.ladder(LADDER_MODELS["GPT-2 small (124M)"], "T4", batch_size=2,
                                     seq_len=512).listed)
    a = {"ax": ax, "rows": rows,
         "bars": ax.barh(range(rows), [0] * rows, height=0.7),
         "labels": [ax.text(0, i, "", va="center", fontsize=8) for i in range(rows)],
         # a label's gap from its bar end: an offset, as spaces would be glyphs drawn each time
         "after": offset_copy(ax.transData, fig, x=4, units="points"),
         "before": offset_copy(ax.transData, fig, x=-4, units="points"),
         "budget": ax.axvline(1, color="k", ls="--", lw=1),
         "budget_text": ax.text(0, -0.8, "", fontsize=8.5, va="center", ha="left"),
         # Every glyph of an animated text is rasterised again on each change (about 0.07 ms a
         # glyph): the widget prints the setting's title instead of drawing it.
         "title": None if animated else fig.text(0.02, 0.98, "", fontsize=9.5, va="top")}
    # The words that do not change with the setting stay in the kept picture (the budget's
    # label changes with the card only, and the card's memory is part of the kept picture's key
    # through its line).
    fig.text(0.02, 0.98 if animated else 0.935, "#rank on the ladder (bytes saved per time "
             "paid), time paid against the plain step (predicted)", fontsize=9.5, va="top")
    # A log axis: peaks run from a few GiB to terabytes, and the card's line must stay readable.
    ax.set_xlim(1, 10)  # positive before the log scale; each drawing sets its own
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(ylim=(rows - 0.5, -1.35),
           xlabel="predicted peak of the step with this lever alone (GiB, log scale)")
    ax.tick_params(axis="y", labelsize=8)
    ax.legend(handles=[Patch(color=_PLAIN, label="the plain step: fp32, whole batch"),
                       Patch(color=_FREE, label="costs no time"),
                       Patch(color=_PAID, label="costs time"),
                       Patch(color=_NOTHING, label="saves nothing here"),
                       Line2D([], [], color="k", ls="--", lw=1,
                              label="the card's memory, as PyTorch reports it")],
              loc="upper center", bbox_to_anchor=(0.288, -0.115), ncol=5, fontsize=8,
              frameon=False, handlelength=1.6, columnspacing=1.2)
    for artist in (*a["bars"], *a["labels"]):
        artist.set_animated(animated)
    return a


def _draw(a: dict, result: fit_ladder.Ladder, model: str) -> None:
    """Set the chart's numbers for one ladder."""
    rungs = list(result.listed)
    names = ["plain step"] + [r.lever for r in rungs]
    peaks = [result.baseline.total / GiB] + [r.memory.total / GiB for r in rungs]
    budget = result.budget_bytes / GiB
    left = 10.0 ** math.floor(math.log10(0.5 * min(peaks + [budget])))
    right = 10.0 ** math.ceil(math.log10(1.5 * max(peaks + [budget])))

    def where(x):  # a value's place across the axes, 0 to 1
        return math.log(x / left) / math.log(right / left)

    for i, (bar, label) in enumerate(zip(a["bars"], a["labels"])):
        if i >= len(names):
            bar.set_width(0)
            label.set_text("")
            continue
        r = rungs[i - 1] if i else None
        bar.set_x(left)
        bar.set_width(peaks[i] - left)
        bar.set_color(_PLAIN if r is None else _NOTHING if r.bytes_saved <= 0
                      else _FREE if r.time_paid <= 0 else _PAID)
        words = (format_bytes(result.baseline.total) if r is None else
                 f"#{result.rungs.index(r) + 1}, {r.time_paid:+.0%}")  # a datasheet's precision
        width = 0.011 * (len(words) + 2)  # of the axes, at 8 points
        # After the bar, else on its end, else beside the card's line: never across the line.
        p, b = where(peaks[i]), where(budget)
        if p + width <= 1 and not p < b < p + width:
            x, inside = peaks[i], False
        elif p >= width and not p - width < b < p:
            x, inside = peaks[i], True
        elif p < b <= 1 - width:
            x, inside = budget, False
        else:
            x, inside = budget if b >= width else peaks[i], True
        label.set_text(words)
        label.set_transform(a["before"] if inside else a["after"])
        label.set_x(x)
        label.set_horizontalalignment("right" if inside else "left")
        label.set_color("white" if inside else "black")
    a["ax"].set(xlim=(left, right))
    ticks = names + [""] * (a["rows"] - len(names))
    if a.get("ticks") != ticks:  # setting them anew costs more than the rest of a change
        a["ax"].set_yticks(range(a["rows"]), ticks)
        a["ticks"] = ticks
    a["budget"].set_xdata([result.budget_bytes / GiB] * 2)
    # A few words on the roomier side of the line, so that the line never crosses them
    # (nvidia-smi's figure is in the climb printed under the chart).
    words = f"{result.gpu}: {format_bytes(result.budget_bytes)}"
    beside = where(budget) < 0.5
    a["budget_text"].set_x(budget)
    a["budget_text"].set_horizontalalignment("left" if beside else "right")
    a["budget_text"].set_text(f" {words}" if beside else f"{words} ")
    if a["title"] is not None:
        a["title"].set_text(_title(result, model))


def _title(result: fit_ladder.Ladder, model: str) -> str:
    return (f"{model}, {result.batch_size} x {result.seq_len:,} tokens per step on a "
            f"{result.gpu}: each lever alone")


def _check_ladder(result) -> None:
    if not isinstance(result, fit_ladder.Ladder):
        raise WrongTypeError(f"result must be a course_lib.planning.fit_ladder.Ladder, got "
                             f"{type(result).__name__}")


def climb_text(result: fit_ladder.Ladder) -> str:
    """The ladder's combination in words: a rung a line, the peak after each, and the verdict.

    Args:
        result (Ladder): what :func:`course_lib.planning.fit_ladder.ladder` returned.
    Returns:
        str: the rungs taken, the peak after each, and whether the step fits.
    """
    _check_ladder(result)
    lines = [f"the plain step: {format_bytes(result.baseline.total)}; "
             f"{result.step.gpu.capacity_label}"]
    lines += [f"  + {lever:41s} -> {format_bytes(m.total):>10s}, time {paid:+.0%}"
              for lever, m, paid in result.climb]
    lines.append(("fits" if result.fits else "does not fit, with every rung that helps")
                 + f": {format_bytes(result.memory.total)}")
    return "\n".join(lines)


def ladder_figure(result: fit_ladder.Ladder, model: str = "", *,
                  fig: Figure | None = None) -> Figure:
    """The explorer's chart of one ladder as a static figure, ``model`` named in its title.

    Args:
        result (Ladder): what :func:`course_lib.planning.fit_ladder.ladder` returned.
        model (str): the model's name in the title.
        fig (Figure, optional): an empty figure to draw on; None makes one with an Agg canvas.
    Returns:
        matplotlib.figure.Figure: the figure drawn on.
    """
    _check_ladder(result)
    fig = agg_figure(_LADDER_FIGSIZE) if fig is None else check_figure("fig", fig)
    _draw(_setup(fig, animated=False), result, model or "the model")
    return fig


def ladder_explorer(*, model: str = "GPT-2 medium (350M)", gpu: str = "T4", seq_len: int = 1024,
                    batch_size: int = 16) -> widgets.VBox:
    """Lecture 08's widget: :func:`ladder_figure` and :func:`climb_text` for the chosen setting.

    Args:
        model (str): the model first shown, a name of :data:`LADDER_MODELS`.
        gpu (str): the preset first shown.
        seq_len (int): tokens per sequence first shown, a power of two, 512 to 8192.
        batch_size (int): sequences per optimizer step first shown, a power of two, 1 to 64.
    Returns:
        ipywidgets.VBox: :func:`course_lib.views.widgets.live_plot`'s box.
    Raises:
        ValueError: naming the argument, for a choice that is not offered.
    """
    choice("model", model, tuple(LADDER_MODELS))
    choice("gpu", gpu, tuple(GPUS))
    for name, value, options in (("seq_len", seq_len, _SEQ_LENS),
                                 ("batch_size", batch_size, _BATCHES)):
        if isinstance(value, bool) or value not in options:
            raise ValueError(f"{name} must be one of {options}, got {value!r}")
    wide = {"description_width": "initial"}

    def draw(artists, model, gpu, seq_len, batch_size):
        result = fit_ladder.ladder(LADDER_MODELS[model], gpu, batch_size=batch_size,
                                   seq_len=seq_len)
        _draw(artists, result, model)
        print(_title(result, model))
        print(climb_text(result))

    controls = {
        "model": widgets.Dropdown(options=list(LADDER_MODELS), value=model, description="model",
                                  style=wide),
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU", style=wide),
        "seq_len": widgets.SelectionSlider(options=list(_SEQ_LENS), value=seq_len,
                                           description="tokens per sequence", style=wide),
        "batch_size": widgets.SelectionSlider(options=list(_BATCHES), value=batch_size,
                                              description="sequences per step", style=wide),
    }
    return live_plot(draw, controls, setup=_setup, columns=2, figsize=_LADDER_FIGSIZE)
