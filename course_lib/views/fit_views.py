"""06: the figures of lecture 06: a step's memory by category against a budget, the GPU explorer.

Every function draws on the matplotlib ``Axes`` or ``Figure`` it is given (never through pyplot),
so that the same code serves a notebook figure and a widget of :func:`course_lib.views.widgets.live_plot`.
The bytes come from :func:`course_lib.prediction.predict.predict` and the planner
(:func:`course_lib.planning.fit.fit_model`); the figures only lay them out:

* :func:`draw_steps`: one horizontal bar per step, stacked by category
  (:data:`course_lib.units.MEMORY_CATEGORIES`), a measured peak as a tick on its bar, and the
  budget as a labelled line;
* :func:`draw_largest`: the largest GPT each set of techniques trains, beside its step;
* :func:`draw_timeline`: allocated bytes over one step, with the budget, the predicted peak and
  the resident model states;
* :func:`draw_explorer`: the widget "what fits on which GPU": the largest GPT a card trains, its
  step against the card's capacity (:attr:`course_lib.device.GPU.capacity`) and against the
  part of it training may use; :func:`explorer_widget` puts it under its
  controls.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import ipywidgets as widgets

from course_lib.device import GPU, GPUS, live_gpu
from course_lib.model.gpt import CONFIG_MAXIMUM
from course_lib.planning import fit
from course_lib.prediction import engine
from course_lib.prediction.engine import StepMemory
from course_lib.prediction.formulas import mixed_precision_for
from course_lib.prediction.predict import Step, predict
from course_lib.units import GB, MEMORY_CATEGORIES, GiB, MiB, format_bytes
from course_lib.validation import MAX_BYTES, choice, integer, positive_int, text
from course_lib.views.widgets import check_figure, live_plot

#: The colour of each label of :func:`course_lib.prediction.engine.breakdown_rows`, in stacking order.
COLORS = {c.label: c.colour for c in MEMORY_CATEGORIES.values()}
#: The options of the explorer's sliders (:func:`draw_explorer`).
SEQ_LENS = (256, 512, 1024, 2048, 4096, 8192)
EFFECTIVE_BATCHES = (8, 16, 32, 64, 128, 256, 512)
#: The name :func:`explorer_gpus` gives this kernel's GPU.
THIS_GPU = "this GPU (free now)"


def unit_of(nbytes: int) -> tuple[int, str]:
    """``(bytes per unit, name)`` to show ``nbytes`` in: GiB from 2 GiB on, else MiB.

    Args:
        nbytes (int): the largest value on the axis, in bytes (0 to
            :data:`course_lib.validation.MAX_BYTES`).

    Returns:
        tuple: ``(GiB, "GiB")`` or ``(MiB, "MiB")``.

    Raises:
        ValueError: naming ``nbytes``, for a negative or non-int value.
    """
    nbytes = integer("nbytes", nbytes, minimum=0, maximum=MAX_BYTES)
    return (GiB, "GiB") if nbytes >= 2 * GiB else (MiB, "MiB")


def _axes(name, ax):
    if not (hasattr(ax, "barh") and hasattr(ax, "axvline")):
        raise ValueError(f"{name} must be a matplotlib Axes, got {type(ax).__name__}")
    return ax


def draw_steps(ax, steps: Mapping[str, StepMemory], *, budget: int | None = None,
               budget_label: str = "budget", measured: Mapping[str, int] | None = None,
               legend: bool = True) -> tuple[int, str]:
    """One horizontal bar per predicted step, stacked by category, against a budget.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        steps (mapping): bar label -> :class:`course_lib.prediction.engine.StepMemory`, top to bottom.
        budget (int, optional): bytes, drawn as a dashed vertical line labelled
            ``budget_label``; None: no line.
        budget_label (str): the line's label in the legend.
        measured (mapping, optional): bar label -> measured peak in bytes, drawn as a black
            tick across its bar (labels missing from it get none).
        legend (bool): draw the legend of the categories (and the lines) above the axes.

    Returns:
        tuple: the ``(bytes per unit, unit name)`` of the x axis (:func:`unit_of`).

    Raises:
        ValueError: naming the argument: ``ax`` not an Axes, ``steps`` empty or not of
            StepMemory, a ``budget`` or measured value that is not a positive int of bytes, a
            measured label that is not a bar.
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
    labels = list(steps)
    rows = range(len(labels))[::-1]  # the first label on top
    drawn = set()
    for row, label in zip(rows, labels, strict=True):
        left = 0.0
        for name, value in engine.breakdown_rows(steps[label]):
            ax.barh(row, value / scale, left=left, color=COLORS[name], height=0.6,
                    label=None if name in drawn else name)
            drawn.add(name)
            left += value / scale
        if label in measured:
            ax.plot([measured[label] / scale] * 2, [row - 0.38, row + 0.38], color="k", lw=2,
                    label=None if "measured" in drawn else "measured")
            drawn.add("measured")
    if budget is not None:
        ax.axvline(budget / scale, color="k", ls="--", lw=1.2, label=budget_label)
    ax.set_yticks(list(rows), labels, fontsize=9)
    ax.set_xlabel(unit)
    ax.set_xlim(0, 1.08 * top / scale)
    ax.tick_params(axis="x", labelsize=9)
    if legend:  # the categories in stacking order, then the tick and the line
        handles, names = ax.get_legend_handles_labels()
        order = {name: i for i, name in enumerate([*COLORS, "measured", budget_label])}
        pairs = sorted(zip(handles, names), key=lambda p: order.get(p[1], len(order)))
        ax.legend(*zip(*pairs), loc="lower left", bbox_to_anchor=(0, 1.02), ncol=4, fontsize=8,
                  frameon=False)
    return scale, unit


def draw_largest(fig, fits: Mapping[str, fit.Fit], *, budget: int,
                 budget_label: str = "budget") -> None:
    """The largest GPT each set of allowed techniques trains, and its step against the budget.

    Two panels sharing their rows: on the left the parameters of each plan, on the right its
    predicted step stacked by category (:func:`draw_steps`).

    Args:
        fig (matplotlib.figure.Figure): an empty figure to draw on.
        fits (mapping): row label -> :class:`course_lib.planning.fit.Fit` (from
            :func:`course_lib.planning.fit.fit_model`), top to bottom.
        budget (int): the budget the plans were fitted to, in bytes.
        budget_label (str): the budget line's label.

    Raises:
        ValueError: naming ``fits`` (empty, or not of Fit records) or, as :func:`draw_steps`,
            the budget.
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
        clock (sequence): when each point happened (:class:`course_lib.measurement.timeline.Timeline`).
        allocated (sequence of int): bytes allocated at each point, the resident bytes included.
        clock_unit (str): what ``clock`` counts ("µs", "event").
        budget (int): bytes, a labelled dashed line.
        predicted (int): the predicted peak, in bytes, a dotted line.
        resident (int): bytes that stay between steps (model states), a thin grey line.
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


def explorer_gpus(live: bool | None = None) -> dict[str, GPU]:
    """The cards the explorer offers: the presets of :data:`course_lib.device.GPUS`, and this
    kernel's GPU (:func:`course_lib.device.live_gpu`, with the memory free on it now) when there
    is one.

    Args:
        live (bool, optional): add this kernel's GPU; None: if CUDA is available.

    Returns:
        dict: name -> :class:`course_lib.device.GPU`, presets first, :data:`THIS_GPU` last.

    Raises:
        ValueError: naming ``live``, for a non-bool, or ``live=True`` without CUDA.
    """
    import torch

    if live is None:
        live = torch.cuda.is_available()
    if not isinstance(live, bool):
        raise ValueError(f"live must be True, False or None, got {live!r}")
    gpus = dict(GPUS)
    if live:
        gpus[THIS_GPU] = live_gpu()
    return gpus


@functools.lru_cache(maxsize=256)
def _plan(target: GPU, budget: int, seq_len: int, effective_batch: int
          ) -> tuple[fit.Fit, StepMemory]:
    """The explorer's numbers for one setting: the plan and the same model trained naively.

    Cached (at most 256 settings): a learner moving a slider back and forth asks for the same
    settings again, and :func:`course_lib.planning.fit.fit_model` searches hundreds of models for each.
    A live card's reading (its free memory) is part of the key (``GPU`` is a frozen dataclass).
    """
    plan = fit.fit_model(budget, space=fit.search_space(seq_len=seq_len),
                         effective_batch=effective_batch,
                         precisions=(mixed_precision_for(target), "fp32"), gpu=target)
    naive = predict(Step(plan.step.config, effective_batch, gpu=target)).peak
    return plan, naive


#: The explorer's two bars, top to bottom, and their rows on the axes.
_EXPLORER_ROWS = {"planned": 1, "trained naively": 0}


def setup_explorer(fig, animated: bool = True) -> dict:
    """The explorer's axes and artists, made once (``live_plot``'s ``setup``).

    Each bar of :data:`_EXPLORER_ROWS` is one rectangle per category of :data:`COLORS` (those a
    setting does not have are zero wide), the budget and the card's capacity are vertical
    lines; :func:`draw_explorer` sets their numbers, the title and the legend. With
    ``animated``, the bars, the lines and the title are drawn over a kept picture of the rest
    (:func:`course_lib.views.widgets.render_png`), which the axis limit and the legend select.

    Args:
        fig (matplotlib.figure.Figure): the empty figure to draw on.
        animated (bool): mark the changing artists animated (a widget's); False for a static
            figure.

    Returns:
        dict: the artists, for :func:`draw_explorer`.
    """
    check_figure("fig", fig)
    ax = fig.subplots()
    fig.subplots_adjust(left=0.15, right=0.98, bottom=0.36, top=0.8)
    # the bars first, row by row (as draw_steps stacks them), then the lines and the text
    bars = {label: {name: ax.barh(row, 0, color=colour, height=0.6, label=name)
                    for name, colour in COLORS.items()}
            for label, row in _EXPLORER_ROWS.items()}
    a = {"fig": fig, "ax": ax, "bars": bars, "legend_key": None,
         "budget": ax.axvline(0, color="k", ls="--", lw=1.2),
         "capacity": ax.axvline(0, color="0.3", lw=2),
         "needs": ax.text(0, 0, "", ha="right", va="center", fontsize=8, color="w",
                          fontweight="bold"),
         "title": ax.set_title("", fontsize=9, loc="left")}
    ax.set_yticks(list(_EXPLORER_ROWS.values()), list(_EXPLORER_ROWS), fontsize=9)
    ax.tick_params(axis="x", labelsize=9)
    if animated:  # the spines too: they are drawn over the bars and the lines that reach them
        for artist in (*[c.patches[0] for row in bars.values() for c in row.values()],
                       a["budget"], a["capacity"], a["needs"], a["title"],
                       *ax.spines.values()):
            artist.set_animated(True)
    return a


def draw_explorer(fig, gpu: str, usable: int, seq_len: int, effective_batch: int, *,
                  gpus: Mapping[str, GPU]) -> fit.Fit:
    """The widget "what fits on which GPU": the largest GPT ``gpus[gpu]`` trains, and its step.

    :func:`course_lib.planning.fit.fit_model` over its default search space (GPT-2's vocabulary,
    64-wide heads) with ``usable`` percent of the card's :attr:`~course_lib.device.GPU.capacity`
    as the budget, in the card's mixed precision
    (:func:`course_lib.prediction.formulas.mixed_precision_for`) or fp32, predicted for the card's
    kernels. Draws the planned step stacked by category against the
    budget and the capacity, and the same model trained naively (fp32, the whole effective batch
    in one pass, no checkpointing), cut at the edge of the axes with its size written beside it;
    prints the plan's summary. The plans are cached per setting (a slider moved back redraws
    at once).

    In a widget, pass :func:`setup_explorer` as ``live_plot``'s ``setup``: ``fig`` is then the
    artists it made, and only their numbers change. Given a figure, it draws a static one.

    Args:
        fig: an empty matplotlib figure (a static figure), or what :func:`setup_explorer`
            returned (a widget's).
        gpu (str): a key of ``gpus``.
        usable (int): percent of the card's memory training may use, 1 to 100.
        seq_len (int): tokens per sequence.
        effective_batch (int): sequences per optimizer step.
        gpus (mapping): name -> :class:`course_lib.device.GPU` (:func:`explorer_gpus`).

    Returns:
        Fit: the plan drawn.

    Raises:
        ValueError: naming the argument, for a bad value, or when nothing fits.
    """
    if not isinstance(gpus, Mapping) or not gpus:
        raise ValueError(f"gpus must be a non-empty mapping of name -> GPU, got {gpus!r}")
    target = gpus[choice("gpu", gpu, tuple(gpus))]
    usable = integer("usable", usable, minimum=1, maximum=100)
    memory = target.capacity
    budget = memory * usable // 100
    seq_len = positive_int("seq_len", seq_len, maximum=CONFIG_MAXIMUM["seq_len"])
    effective_batch = positive_int("effective_batch", effective_batch,
                                   maximum=fit.MAX_EFFECTIVE_BATCH)
    plan, naive = _plan(target, budget, seq_len, effective_batch)
    a = fig if isinstance(fig, dict) else setup_explorer(fig, animated=False)
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
    s, c = plan.step, plan.step.config
    verdict = "fits" if plan.peak_bytes <= budget else "does not fit"
    a["title"].set_text(
        f"{target.name}: the largest GPT that {verdict} is {plan.n_params / 1e9:.2f}B "
        f"parameters (d_model {c.d_model}, {c.n_layers} layers)\n{s.precision}, "
        f"{s.micro_batch_size} x {s.accumulation_steps} micro-batches, checkpointing "
        f"{plan.label}: step {format_bytes(plan.peak_bytes)} of a budget of "
        f"{format_bytes(budget)} ({budget / GB:.1f} GB)")
    # The lines' labels, then the categories drawn (the order in which matplotlib collects a
    # legend's entries: lines before bars); a new legend only when the categories change. It
    # stays in the widget's kept picture (its texts are in the key): it changes with the card
    # only (the budget's figures are in the title), and drawing its text on every change cost
    # more than the rest.
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
    print(plan.summary())
    print(f"trained naively (fp32, {effective_batch} sequences at once, no checkpointing): "
          f"{format_bytes(naive.total)}, {naive.total / budget:.1f}x the budget")
    return plan


def explorer_widget(*, gpu: str = "T4", seq_len: int = 1024,
                    effective_batch: int = 64) -> widgets.VBox:
    """The widget "what fits on which GPU": :func:`draw_explorer` under four controls.

    Controls: the GPU (:func:`explorer_gpus`: the presets, and on CUDA this GPU with what is
    free on it), the percent of its memory training may use (90 first), tokens per sequence
    (:data:`SEQ_LENS`) and sequences per optimizer step (:data:`EFFECTIVE_BATCHES`).

    Args:
        gpu (str): the GPU shown first, a name of :data:`course_lib.device.GPUS`.
        seq_len (int): the tokens per sequence shown first, one of :data:`SEQ_LENS`.
        effective_batch (int): the sequences per step shown first, one of
            :data:`EFFECTIVE_BATCHES`.

    Returns:
        ipywidgets.VBox: :func:`course_lib.views.widgets.live_plot`'s box.

    Raises:
        ValueError: naming the argument, for a bad value.
    """
    choice("gpu", gpu, tuple(GPUS))
    for name, value, options in (("seq_len", seq_len, SEQ_LENS),
                                 ("effective_batch", effective_batch, EFFECTIVE_BATCHES)):
        if value not in options:
            raise ValueError(f"{name} must be one of {options}, got {value!r}")
    gpus = explorer_gpus()
    look = dict(style={"description_width": "initial"}, layout=widgets.Layout(width="440px"))
    controls = {
        "gpu": widgets.Dropdown(options=list(gpus), value=gpu, description="GPU", **look),
        "usable": widgets.IntSlider(value=90, min=50, max=100, step=5, **look,
                                    description="% of its memory training may use"),
        "seq_len": widgets.SelectionSlider(options=SEQ_LENS, value=seq_len, **look,
                                           description="tokens per sequence"),
        "effective_batch": widgets.SelectionSlider(options=EFFECTIVE_BATCHES,
                                                   value=effective_batch, **look,
                                                   description="sequences per step"),
    }
    return live_plot(functools.partial(draw_explorer, gpus=gpus), controls, columns=2,
                     figsize=(9, 3.6), setup=setup_explorer)


__all__ = ["COLORS", "SEQ_LENS", "EFFECTIVE_BATCHES", "THIS_GPU", "unit_of", "draw_steps",
           "draw_largest", "draw_timeline", "explorer_gpus", "setup_explorer", "draw_explorer",
           "explorer_widget"]
