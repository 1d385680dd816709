"""06: a step's memory by category against a budget; the explorer "what fits on which GPU"."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import ipywidgets as widgets
import torch

from course_lib.device import GPU, GPUS, live_gpu
from course_lib.planning import fit
from course_lib.prediction import engine
from course_lib.prediction.engine import StepMemory
from course_lib.prediction.formulas import mixed_precision_for
from course_lib.prediction.predict import Step, predict
from course_lib.units import GB, MEMORY_CATEGORIES, format_bytes
from course_lib.validation import MAX_BYTES, choice, positive_int, text
from course_lib.views.widgets import live_plot, unit_of

# The colour of each label of engine.breakdown_rows, in stacking order.
_COLORS = {c.label: c.colour for c in MEMORY_CATEGORIES.values()}
_SEQ_LENS = (256, 512, 1024, 2048, 4096, 8192)
_EFFECTIVE_BATCHES = (8, 16, 32, 64, 128, 256, 512)
# The explorer's two bars, top to bottom, and their rows on the axes.
_EXPLORER_ROWS = {"planned": 1, "trained naively": 0}


def _axes(name, ax):
    if not (hasattr(ax, "barh") and hasattr(ax, "axvline")):
        raise ValueError(f"{name} must be a matplotlib Axes, got {type(ax).__name__}")
    return ax


def draw_steps(ax, steps: Mapping[str, StepMemory], *, budget: int | None = None,
               budget_label: str = "budget", measured: Mapping[str, int] | None = None,
               legend: bool = True) -> tuple[int, str]:
    """One bar per step (label -> ``StepMemory``, top to bottom), stacked by category.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        steps (mapping): bar label -> :class:`course_lib.prediction.engine.StepMemory`.
        budget (int, optional): bytes, a dashed line labelled ``budget_label``; None: no line.
        budget_label (str): the line's label in the legend.
        measured (mapping, optional): bar label -> measured peak in bytes, a tick across it.
        legend (bool): draw the legend above the axes.
    Returns:
        tuple: the x axis's ``(bytes per unit, unit name)``: GiB from 2 GiB on, else MiB.
    Raises:
        ValueError: naming the argument, for a bad value.
    """
    _axes("ax", ax)
    if not isinstance(steps, Mapping) or not steps or not all(
            isinstance(k, str) and isinstance(v, StepMemory) for k, v in steps.items()):
        raise ValueError(f"steps must be a non-empty mapping of label -> StepMemory, got {steps!r}")
    if budget is not None:
        budget = positive_int("budget", budget, maximum=MAX_BYTES)
    text("budget_label", budget_label)
    measured = dict(measured or {})
    for label, value in measured.items():
        if label not in steps:
            raise ValueError(f"measured names a bar that steps does not have: {label!r}")
        positive_int("measured", value, maximum=MAX_BYTES)
    top = max([m.total for m in steps.values()] + [budget or 0] + list(measured.values()))
    scale, unit = unit_of(top)
    rows = range(len(steps))[::-1]  # the first label on top
    drawn = set()
    for row, label in zip(rows, steps, strict=True):
        left = 0.0
        for name, value in engine.breakdown_rows(steps[label]):
            ax.barh(row, value / scale, left=left, color=_COLORS[name], height=0.6,
                    label=None if name in drawn else name)
            drawn.add(name)
            left += value / scale
        if label in measured:
            ax.plot([measured[label] / scale] * 2, [row - 0.38, row + 0.38], color="k", lw=2,
                    label=None if "measured" in drawn else "measured")
            drawn.add("measured")
    if budget is not None:
        ax.axvline(budget / scale, color="k", ls="--", lw=1.2, label=budget_label)
    ax.set_yticks(list(rows), list(steps), fontsize=9)
    ax.set_xlabel(unit)
    ax.set_xlim(0, 1.08 * top / scale)
    ax.tick_params(axis="x", labelsize=9)
    if legend:  # the categories in stacking order, then the tick and the line
        handles, names = ax.get_legend_handles_labels()
        order = {name: i for i, name in enumerate([*_COLORS, "measured", budget_label])}
        pairs = sorted(zip(handles, names), key=lambda p: order.get(p[1], len(order)))
        ax.legend(*zip(*pairs), loc="lower left", bbox_to_anchor=(0, 1.02), ncol=4, fontsize=8,
                  frameon=False)
    return scale, unit


def draw_largest(fig, fits: Mapping[str, fit.Fit], *, budget: int,
                 budget_label: str = "budget") -> None:
    """On an empty ``fig``: each plan's model size (left), its step against ``budget`` (right).

    Args:
        fig (matplotlib.figure.Figure): an empty figure to draw on.
        fits (mapping): row label -> :class:`course_lib.planning.fit.Fit`, top to bottom.
        budget (int): the bytes the plans were fitted to.
        budget_label (str): the budget line's label.
    Raises:
        ValueError: naming ``fits`` or the budget, for a bad value.
    """
    if not isinstance(fits, Mapping) or not fits or not all(
            isinstance(k, str) and isinstance(v, fit.Fit) for k, v in fits.items()):
        raise ValueError(f"fits must be a non-empty mapping of label -> Fit, got {fits!r}")
    left, right = fig.subplots(1, 2, width_ratios=(1, 2), sharey=True)
    fig.subplots_adjust(left=0.19, right=0.98, top=0.8, bottom=0.15, wspace=0.08)
    _, unit = draw_steps(right, {name: f.memory for name, f in fits.items()}, budget=budget,
                         budget_label=budget_label)
    right.set_xlabel(f"its predicted step ({unit})")
    sizes = [f.n_params / 1e6 for f in fits.values()]
    rows = range(len(fits))[::-1]
    left.barh(rows, sizes, color="0.5", height=0.6)
    for row, size in zip(rows, sizes, strict=True):
        left.text(size, row, f" {size:.2f}M", va="center", fontsize=8)
    left.set(xlabel="largest GPT that fits (M parameters)", xlim=(0, 1.4 * max(sizes)))


def draw_timeline(ax, clock: Sequence, allocated: Sequence[int], *, clock_unit: str,
                  budget: int, predicted: int, resident: int,
                  budget_label: str = "budget") -> None:
    """Allocated bytes over one step, with the budget, the predicted peak and the resident bytes.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        clock (sequence): when each point happened, in ``clock_unit``.
        allocated (sequence of int): bytes allocated at each point, the resident bytes included.
        clock_unit (str): "µs" or "event".
        budget, predicted, resident (int): bytes: dashed, dotted and thin grey lines (resident:
            what stays between steps, the model states).
        budget_label (str): the budget line's label.
    Raises:
        ValueError: naming the argument, for a bad value or ``clock`` and ``allocated`` of
            different lengths.
    """
    _axes("ax", ax)
    text("clock_unit", clock_unit)
    text("budget_label", budget_label)
    for name, value in (("budget", budget), ("predicted", predicted), ("resident", resident)):
        positive_int(name, value, maximum=MAX_BYTES)
    if len(clock) != len(allocated) or not len(clock):
        raise ValueError(f"clock and allocated must be non-empty and of one length, got "
                         f"{len(clock)} and {len(allocated)}")
    scale, unit = unit_of(max(int(max(allocated)), budget, predicted))
    ax.plot(clock, [a / scale for a in allocated], lw=1, color="C0", label="allocated")
    ax.axhline(budget / scale, color="k", ls="--", lw=1.2, label=budget_label)
    ax.axhline(predicted / scale, color="C1", ls=":", lw=1.5, label="predicted peak")
    ax.axhline(resident / scale, color="0.5", lw=0.8, label="model states (between steps)")
    xlabel = "allocations and frees, in order" if clock_unit == "event" else f"time ({clock_unit})"
    ax.set(xlabel=xlabel, ylabel=unit, ylim=(0, 1.12 * budget / scale))
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)


def _explorer_gpus(live: bool | None = None) -> dict[str, GPU]:
    """The presets, then this kernel's GPU with its free memory if ``live`` (None: if CUDA)."""
    gpus = dict(GPUS)
    if torch.cuda.is_available() if live is None else live:
        gpus["this GPU (free now)"] = live_gpu()
    return gpus


# Cached: a slider moved back asks for a setting again, and fit_model searches hundreds of
# models for each. A live card's free memory is part of the key (GPU is a frozen dataclass).
@functools.lru_cache(maxsize=256)
def _plan(target: GPU, budget: int, seq_len: int, effective_batch: int
          ) -> tuple[fit.Fit, StepMemory]:
    """The explorer's plan for one setting, and the same model's peak trained naively."""
    plan = fit.fit_model(budget, space=fit.search_space(seq_len=seq_len),
                         effective_batch=effective_batch,
                         precisions=(mixed_precision_for(target), "fp32"), gpu=target)
    naive = predict(Step(plan.step.config, effective_batch, gpu=target)).peak
    return plan, naive


def _setup_explorer(fig, animated: bool = True) -> dict:
    """The explorer's axes and artists, made once: a zero-wide bar per category and row."""
    ax = fig.subplots()
    fig.subplots_adjust(left=0.15, right=0.98, bottom=0.36, top=0.9)
    # the bars first, row by row (as draw_steps stacks them), then the lines and the text
    bars = {label: {name: ax.barh(row, 0, color=colour, height=0.6, label=name)
                    for name, colour in _COLORS.items()}
            for label, row in _EXPLORER_ROWS.items()}
    a = {"fig": fig, "ax": ax, "bars": bars, "legend_key": None,
         "budget": ax.axvline(0, color="k", ls="--", lw=1.2),
         "capacity": ax.axvline(0, color="0.3", lw=2),
         "needs": ax.text(0, 0, "", ha="right", va="center", fontsize=8, color="w",
                          fontweight="bold")}
    # The plan in words is printed under the figure: every glyph of an animated title would be
    # rasterised again on each change (about 0.07 ms a glyph: 13 ms for its two lines).
    ax.set_title("the largest GPT that fits the budget, planned; the same model trained naively",
                 fontsize=9, loc="left")
    ax.set_yticks(list(_EXPLORER_ROWS.values()), list(_EXPLORER_ROWS), fontsize=9)
    ax.tick_params(axis="x", labelsize=9)
    if animated:  # the spines too: they are drawn over the bars and the lines that reach them
        for artist in (*[c.patches[0] for row in bars.values() for c in row.values()],
                       a["budget"], a["capacity"], a["needs"],
                       *ax.spines.values()):
            artist.set_animated(True)
    return a


def _draw_explorer(fig, gpu: str, usable: int, seq_len: int, effective_batch: int, *,
                   gpus: Mapping[str, GPU]) -> fit.Fit:
    """Draw the plan for one setting on ``fig`` (a figure, or :func:`_setup_explorer`'s artists)."""
    target = gpus[gpu]
    memory = target.capacity
    budget = memory * usable // 100
    plan, naive = _plan(target, budget, seq_len, effective_batch)
    a = fig if isinstance(fig, dict) else _setup_explorer(fig, animated=False)
    ax = a["ax"]
    steps = {"planned": plan.memory, "trained naively": naive}
    top = max(plan.memory.total, naive.total, budget)
    scale, unit = unit_of(top)
    drawn = {}  # category -> its first bar, in the order draw_steps draws them: the legend's
    for label, m in steps.items():
        left, values = 0.0, dict(engine.breakdown_rows(m))
        for name, container in a["bars"][label].items():
            width = values.get(name, 0) / scale  # a category this step has not: zero wide
            container.patches[0].set_x(left)
            container.patches[0].set_width(width)
            left += width
            if name in values:
                drawn.setdefault(name, container)
    a["budget"].set_xdata([budget / scale] * 2)
    a["capacity"].set_xdata([memory / scale] * 2)
    ax.set_xlabel(unit)
    ax.set_xlim(0, 1.12 * memory / scale)
    needs = naive.total > 1.12 * memory
    a["needs"].set_position((1.1 * memory / scale, 0))
    a["needs"].set_text(f"needs {format_bytes(naive.total)} →" if needs else "")
    # Lines before bars, the order in which matplotlib collects a legend's entries. A new legend
    # only when the categories change: it stays in the widget's kept picture (its texts are in
    # the key), and drawing its text on every change cost more than the rest.
    of = "free memory" if target.live else "capacity"
    labels = [f"budget: the part of the {of} training may use",
              target.capacity_label.replace(" (", "\n("), *drawn]
    if a["legend_key"] != tuple(drawn):
        ax.legend([a["budget"], a["capacity"], *drawn.values()], labels, loc="upper left",
                  bbox_to_anchor=(-0.15, -0.2), ncol=4, fontsize=8, frameon=False)
        a["legend_key"] = tuple(drawn)
    else:
        for text, label in zip(ax.get_legend().get_texts(), labels):
            text.set_text(label)
    print(f"{target.name}: the largest GPT that trains in {usable}% of its "
          f"{'free memory' if target.live else 'memory'}, {format_bytes(budget)} "
          f"({budget / GB:.1f} GB):")
    print(plan.summary())
    print(f"trained naively (fp32, {effective_batch} sequences at once, no checkpointing): "
          f"{format_bytes(naive.total)}, {naive.total / budget:.1f}x the budget")
    return plan


def explorer_widget(*, gpu: str = "T4", seq_len: int = 1024,
                    effective_batch: int = 64) -> widgets.VBox:
    """The widget "what fits on which GPU": the largest GPT a card trains (``fit_model`` with a
    share of its memory as the budget), beside it trained naively (fp32, whole batch).

    Args:
        gpu (str): the GPU shown first, a name of :data:`course_lib.device.GPUS`.
        seq_len (int): the tokens per sequence shown first, a power of two, 256 to 8192.
        effective_batch (int): the sequences per step shown first, a power of two, 8 to 512.
    Returns:
        ipywidgets.VBox: :func:`course_lib.views.widgets.live_plot`'s box.
    Raises:
        ValueError: naming the argument, for a bad value.
    """
    choice("gpu", gpu, tuple(GPUS))
    for name, value, options in (("seq_len", seq_len, _SEQ_LENS),
                                 ("effective_batch", effective_batch, _EFFECTIVE_BATCHES)):
        if value not in options:
            raise ValueError(f"{name} must be one of {options}, got {value!r}")
    gpus = _explorer_gpus()
    look = dict(style={"description_width": "initial"}, layout=widgets.Layout(width="440px"))
    controls = {
        "gpu": widgets.Dropdown(options=list(gpus), value=gpu, description="GPU", **look),
        "usable": widgets.IntSlider(value=90, min=50, max=100, step=5, **look,
                                    description="% of its memory training may use"),
        "seq_len": widgets.SelectionSlider(options=_SEQ_LENS, value=seq_len, **look,
                                           description="tokens per sequence"),
        "effective_batch": widgets.SelectionSlider(options=_EFFECTIVE_BATCHES,
                                                   value=effective_batch, **look,
                                                   description="sequences per step"),
    }
    return live_plot(functools.partial(_draw_explorer, gpus=gpus), controls, columns=2,
                     figsize=(9, 3.6), setup=_setup_explorer)
