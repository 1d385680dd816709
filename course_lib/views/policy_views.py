"""05: the figures of lecture 05 (text of 8 points or more) and its planner widget."""

from __future__ import annotations

import math

import ipywidgets as widgets
import numpy as np
from matplotlib.axes import Axes
from matplotlib.transforms import Bbox

from course_lib.planning import planner
from course_lib.units import format_bytes
from course_lib.views.widgets import live_plot, unit_of

_FONT = 8  # points: readable at 1280 px with the sidebar open
_MARKER = 5  # points: the half-width kept free around each labelled point
_COLOURS = {"none": "0.2", "blocks": "C1", "sqrt": "C4", "selective": "C0", "attention": "C2"}
# Where a label may go around its point, in points: right, left, above, below, then farther.
_OFFSETS = [(6, 3), (-6, 3), (6, -11), (-6, -11), (0, 9), (0, -17), (10, 12), (-10, 12),
           (10, -20), (-10, -20), (0, 20), (0, -28)]


def _overlap(a, b) -> float:
    """The area two display boxes share (0 if they are apart)."""
    both = Bbox.intersection(a, b)
    return both.width * both.height if both is not None else 0.0


def _obstacles(ax: Axes, renderer, pad: float) -> tuple[list, np.ndarray]:
    """What a label must not cover: boxes (legend, markers) and lines as points a pixel apart."""
    boxes = [ax.get_legend().get_window_extent(renderer)] if ax.get_legend() else []
    samples = [np.empty((0, 2))]
    for line in ax.lines:
        xy = ax.transData.transform(line.get_xydata())
        if line.get_marker() not in (None, "None", "", " "):
            half = max(pad, line.get_markersize() / 2 * ax.figure.dpi / 72)
            boxes += [Bbox.from_extents(x - half, y - half, x + half, y + half) for x, y in xy]
        if line.get_linestyle() not in ("None", "", " "):
            samples += [np.linspace(a, b, int(np.hypot(*(b - a))) + 2)
                        for a, b in zip(xy[:-1], xy[1:])]
    return boxes, np.concatenate(samples)


def _place_labels(ax: Axes, points, labels) -> list:
    """Label each point at the first free place of _OFFSETS, else the least crowded (call last)."""
    shared: dict = {}
    for point, label in zip(points, labels):
        shared.setdefault(tuple(point), []).append(label)
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    pad = _MARKER * fig.dpi / 72  # the points' markers, and a little room around them
    taken, lines = _obstacles(ax, renderer, pad)
    for x, y in shared:
        px, py = ax.transData.transform((x, y))
        taken.append(Bbox.from_extents(px - pad, py - pad, px + pad, py + pad))
    texts = []
    for (x, y), names in shared.items():
        best, best_cost = None, math.inf
        for dx, dy in _OFFSETS:
            text = ax.annotate(", ".join(names), (x, y), xytext=(dx, dy),
                               textcoords="offset points", fontsize=_FONT,
                               ha="left" if dx > 0 else "right" if dx < 0 else "center",
                               va="bottom")
            box = text.get_window_extent(renderer).expanded(1.04, 1.1)
            cost = sum(_overlap(box, other) for other in taken)
            crossed = ((lines[:, 0] >= box.x0) & (lines[:, 0] <= box.x1)
                       & (lines[:, 1] >= box.y0) & (lines[:, 1] <= box.y1)).sum()
            cost += crossed * pad * pad + 10 * (box.width * box.height - _overlap(box, inside))
            if cost < best_cost:
                if best is not None:
                    best[0].remove()
                best, best_cost = (text, box), cost
            else:
                text.remove()
            if cost == 0:
                break
        texts.append(best[0])
        taken.append(best[1])
    return texts


def draw_question(ax: Axes, none: tuple, full: tuple) -> None:
    """The opening figure: ``(extra FLOPs in %, peak bytes)`` of no and of full checkpointing.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        none, full (tuple): ``(extra FLOPs in %, peak bytes)``.
    """
    unit, name = unit_of(none[1])
    xs, ys = [none[0], full[0]], [none[1] / unit, full[1] / unit]
    ax.plot(xs, ys, ":", color="0.7")
    ax.plot(xs, ys, "o", color="C3", ms=7)
    ax.annotate("no checkpointing", (xs[0], ys[0]), xytext=(8, 4), textcoords="offset points",
                fontsize=_FONT + 1, va="bottom")
    ax.annotate("every block checkpointed (lecture 04)", (xs[1], ys[1]), xytext=(-6, -10),
                textcoords="offset points", fontsize=_FONT + 1, ha="right", va="top")
    middle = (sum(xs) / 2, sum(ys) / 2)
    ax.text(middle[0] + 0.04 * xs[1], middle[1], "?", fontsize=26, color="C0", va="center")
    ax.text(middle[0] + 0.12 * xs[1], middle[1], "most of the saving\nfor a fraction of the price?",
            fontsize=_FONT + 1, color="C0", va="center")
    ax.set(xlabel="extra compute: recomputed FLOPs (% of a plain step)",
           ylabel=f"peak of a training step ({name})", xlim=(-0.08 * xs[1], 1.25 * xs[1]),
           ylim=(0, 1.2 * ys[0]))
    ax.tick_params(labelsize=_FONT + 1)


def draw_every_k(ax: Axes, fractions, memory, flops, labels, predicted=None) -> None:
    """Memory saved and FLOPs recomputed per share of blocks checkpointed, a label per policy.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        fractions, memory, flops (list of float): per policy, shares of every block's.
        labels (list of str): one per policy.
        predicted (list of float, optional): the predicted memory saving, a cross per policy.
    """
    ax.plot([0, 1], [0, 1], color="0.75", lw=1, label="the share of blocks itself")
    ax.plot(fractions, flops, "s", color="C1", ms=7, mfc="none", label="FLOPs recomputed (counted)")
    ax.plot(fractions, memory, "o", color="C0", label="memory saved (measured peak)")
    if predicted is not None:
        ax.plot(fractions, predicted, "x", color="k", ms=7, label="memory saved (predicted)")
    ax.set(xlabel="share of the blocks checkpointed", ylabel="share of what every block gives",
           xlim=(0, 1.12), ylim=(0, 1.15))
    ax.legend(fontsize=_FONT, loc="upper left")
    ax.tick_params(labelsize=_FONT + 1)
    _place_labels(ax, list(zip(fractions, memory)), labels)


def draw_policy_costs(ax: Axes, kept: dict, reruns: dict) -> None:
    """One bar per policy (top to bottom): the bytes a block keeps, and the text of what reruns.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        kept, reruns (dict): policy name -> bytes kept, and -> what runs again.
    """
    names = list(kept)
    ys = range(len(names))[::-1]
    unit, unit_name = unit_of(max(kept.values()))
    values = [kept[n] / unit for n in names]
    ax.barh(ys, values, color=["0.6" if i < 2 else "C0" for i in range(len(names))], height=0.6)
    right = max(values)
    for y, n, v in zip(ys, names, values):
        ax.text(v + 0.02 * right, y, f"{format_bytes(kept[n])}; reruns {reruns[n]}",
                fontsize=_FONT, va="center")
    ax.set_yticks(list(ys), names, fontsize=_FONT + 1)
    ax.set(xlabel=f"kept from the forward to the backward pass, one block ({unit_name})",
           xlim=(0, 2.6 * right))
    ax.tick_params(axis="x", labelsize=_FONT + 1)


def draw_frontier(ax: Axes, points, front_labels) -> None:
    """``(peak bytes, time ratio, label)`` per policy; those in ``front_labels`` joined, dashed.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        points (list): ``(peak bytes, time ratio, label)`` per policy.
        front_labels (collection of str): the labels on the frontier.
    """
    unit, name = unit_of(max(p[0] for p in points))
    for peak, ratio, label in points:
        ax.plot(peak / unit, ratio, "o", color=_COLOURS[label.split("/")[0]], ms=6)
    front = sorted((p for p in points if p[2] in front_labels), key=lambda p: p[0])
    ax.plot([p[0] / unit for p in front], [p[1] for p in front], "k--", lw=1,
            label="frontier: nothing both smaller and faster")
    ys = [p[1] for p in points]
    span = max(max(ys) - min(ys), 0.2)
    ax.set(xlabel=f"peak of a training step ({name})", ylabel="step time / no checkpointing",
           xlim=(0, 1.12 * max(p[0] for p in points) / unit),
           ylim=(min(ys) - 0.25 * span, max(ys) + 0.3 * span))
    ax.legend(fontsize=_FONT, loc="upper right")
    ax.tick_params(labelsize=_FONT + 1)
    _place_labels(ax, [(p[0] / unit, p[1]) for p in points], [p[2] for p in points])


def planner_widget(step) -> widgets.VBox:
    """The planner's pick for a budget, set in % of the peak without checkpointing (60 at first).

    Args:
        step (Step): the step to plan.
    Returns:
        ipywidgets.VBox: :func:`course_lib.views.widgets.live_plot`'s box.
    """
    options = planner.candidates(step)
    shown = planner.choices(options)
    none = next(c for c in options if c.step.mode == "none")
    plain, plain_s = none.peak_bytes, none.seconds
    unit, unit_name = unit_of(plain)

    height = max(3.2, 1.3 + 0.26 * len(shown))  # inches: about 0.26 in (19 pt) a bar

    def setup(fig):
        ax = fig.subplots()
        fig.subplots_adjust(left=0.22, right=0.97, bottom=0.6 / height, top=1 - 0.5 / height)
        ys = range(len(shown))[::-1]
        bars = ax.barh(ys, [c.peak_bytes / unit for c in shown], color="0.85", height=0.65,
                       linewidth=2)
        ax.set_yticks(list(ys), [f"{c.label}  x{c.seconds / plain_s:.2f}" for c in shown],
                      fontsize=_FONT + 1)
        ax.set(xlim=(0, 1.12 * plain / unit), ylim=(-0.6, len(shown) + 0.3))
        ax.set_xlabel(f"predicted peak of a training step ({unit_name})", fontsize=_FONT + 1)
        ax.text(-0.01, 1.0, "policy, predicted\ntime vs none", transform=ax.transAxes, ha="right",
                va="bottom", fontsize=_FONT)
        ax.tick_params(axis="x", labelsize=_FONT + 1)
        line = ax.axvline(0, color="C3", ls="--")
        note = ax.text(0, len(shown) - 0.2, "", color="C3", fontsize=_FONT + 1)
        title = ax.set_title("", fontsize=_FONT + 2)
        for artist in (*bars, line, note, title):
            artist.set_animated(True)
        return bars, line, note, title

    def draw(artists, budget):
        bars, line, note, title = artists
        budget_bytes = max(1, int(plain * budget / 100))
        try:
            plan = planner.plan_checkpointing(step, budget_bytes)
            title.set_text(f"the planner picks {plan.label}: x{plan.seconds / plain_s:.2f} time, "
                           f"+{plan.recompute_fraction:.1%} FLOPs")
        except planner.NothingFits:
            plan = None
            title.set_text("nothing fits: a smaller batch or more memory")
        for bar, c in zip(bars, shown):
            bar.set_facecolor("C2" if c.peak_bytes <= budget_bytes else "0.85")
            bar.set_edgecolor("k" if c is plan else "none")
        x = budget_bytes / unit
        line.set_xdata([x, x])
        note.set_text(f" budget {format_bytes(budget_bytes)}")
        note.set_x(x)
        note.set_horizontalalignment("right" if budget > 70 else "left")

    slider = widgets.IntSlider(value=60, min=10, max=100, step=1,
                               description="budget, % of the peak without checkpointing",
                               style={"description_width": "initial"},
                               layout=widgets.Layout(width="560px"))
    return live_plot(draw, {"budget": slider}, setup=setup, figsize=(7.4, height))
