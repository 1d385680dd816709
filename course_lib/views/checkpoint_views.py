"""04: the figures of lecture 04, and its explorer of checkpointing modes on a GPU preset."""

from __future__ import annotations

from dataclasses import dataclass, replace

import ipywidgets as widgets
import numpy as np
import torch

from course_lib.device import GPU, GPUS, pick_dtype
from course_lib.measurement.timeline import Timeline
from course_lib.model.gpt import GPTConfig
from course_lib.prediction import checkpointed, engine
from course_lib.prediction.predict import Prediction, Step, predict
from course_lib.training import checkpointing as ckpt
from course_lib.units import MEMORY_CATEGORIES, GiB, MiB, format_bytes
from course_lib.validation import choice, integer
from course_lib.views.widgets import live_plot

# The explorer's checkpointing modes (of enable_checkpointing) -> how its menu names them.
_CHOICES = {"none": "none", "blocks": "per-block", "sqrt": "segments"}
# The explorer's model: GPT-2 small's width, heads, sequence and vocabulary.
_GPT2_SMALL = dict(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12)
_MAX_LAYERS = 96
_COLORS = {"none": "#c44e52", "per-block": "#4c72b0", "√n segments": "#8c8c8c",
           "best segments": "#55a868"}


def plot_timelines(ax, timelines: dict[str, Timeline]) -> None:
    """Draw each labelled :class:`~course_lib.measurement.timeline.Timeline`, with its peak.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        timelines (dict): label -> ``Timeline``.
    Raises:
        ValueError: naming ``timelines``, if it is empty or holds anything but timelines.
    """
    if not isinstance(timelines, dict) or not timelines or not all(
            isinstance(t, Timeline) for t in timelines.values()):
        raise ValueError(f"timelines must be a non-empty dict of Timeline, got {timelines!r}")
    for i, (name, t) in enumerate(timelines.items()):
        ax.plot(t.clock, np.array(t.allocated) / MiB, color=_COLORS.get(name, f"C{i}"), lw=1.2,
                label=f"{name}: peak {format_bytes(t.peak)}")
    unit = next(iter(timelines.values())).unit
    ax.set_xlabel("time (µs)" if unit == "µs" else "allocations and frees, in order")
    ax.set_ylabel("allocated (MiB)")
    ax.legend(fontsize=9, loc="upper right")


def _slope(depths, values) -> float:
    """``p`` of ``values ~ depths^p``, fitted on log-log axes."""
    return float(np.polyfit(np.log(depths), np.log(values), 1)[0])


def plot_depths(ax, depths, measured: dict) -> None:
    """Measured peak bytes against depth (log-log) per label; slopes in the legend.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        depths (sequence of int): the layers measured.
        measured (dict): label -> bytes per depth.
    Raises:
        ValueError: naming ``depths`` or ``measured``.
    """
    if len(depths) < 2 or min(depths) <= 0:
        raise ValueError(f"depths must hold at least two positive numbers, got {depths!r}")
    if not isinstance(measured, dict) or not measured or any(
            len(v) != len(depths) or min(v) <= 0 for v in measured.values()):
        raise ValueError(f"measured must be a non-empty dict of positive bytes per depth, got "
                         f"{measured!r}")
    for i, (name, values) in enumerate(measured.items()):
        deep = _slope(depths[-2:], values[-2:])
        ax.loglog(depths, np.array(values) / MiB, "o-", color=_COLORS.get(name, f"C{i}"), ms=4, lw=2.5,
                  label=f"{name}: slope {_slope(depths, values):.2f}, "
                        f"{deep:.2f} at {depths[-2]}-{depths[-1]}")
    low = min(min(v) for v in measured.values()) / MiB
    high = max(max(v) for v in measured.values()) / MiB
    ticks = [t for t in (m * 10.0**e for e in range(-1, 5) for m in (1, 2, 5))  # 1-2-5 MiB
             if low / 1.5 <= t <= high * 1.5]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xticks(list(depths), [str(n) for n in depths])
    ax.minorticks_off()
    ax.set_xlabel("layers n")
    ax.set_ylabel("peak of forward + backward (MiB)")
    ax.legend(fontsize=8.5, loc="upper left")


@dataclass(frozen=True)
class _Setting:
    """One setting of the explorer, predicted; ``segments`` is ``k`` for ``"sqrt"`` only."""

    gpu: GPU
    precision: str
    segments: int | None
    best_segments: int
    memory: Prediction
    plain: Prediction
    flop_ratio: float


def _explore(gpu: str = "T4", layers: int = 48, mode: str = "blocks",
             segments: int = 8, batch_size: int = 6) -> _Setting:
    """Predict one AdamW step of the explorer's model under autocast in the card's dtype."""
    card = GPUS[gpu]
    precision = "autocast-bf16" if pick_dtype(card) == torch.bfloat16 else "autocast-fp16"
    config = GPTConfig(**_GPT2_SMALL, n_layers=layers)
    k = min(segments, layers) if mode == "sqrt" else None
    kernel = dict(dtype=pick_dtype(card), gpu=card, autocast=True)
    plain = Step(config, batch_size, precision=precision, gpu=card)
    memory = predict(replace(plain, mode=mode, segments=k))
    cost = checkpointed.checkpoint_cost(config, batch_size, mode, segments=k, **kernel)
    best = ckpt.best_segments(layers, checkpointed.block_ratio(config, batch_size, **kernel))
    return _Setting(card, precision, k, best, memory, predict(plain), cost.flop_ratio)


def _setup(fig) -> dict:
    mem, flops = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1.4]})
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.12, top=0.74, wspace=0.36)
    a = {"mem": mem, "title": fig.text(0.5, 0.975, "", ha="center", va="top", fontsize=10)}
    a["plain"] = mem.bar([0], [0], width=0.6, color="0.8")[0]
    a["parts"] = {c.label: mem.bar([1], [0], width=0.6, color=c.colour, label=[c.label])[0]
                  for c in MEMORY_CATEGORIES.values()}
    a["labels"] = [mem.text(i, 0, "", ha="center", va="bottom", fontsize=9) for i in (0, 1)]
    a["card"] = mem.axhline(0, color="k", ls="--", lw=1)
    a["card_text"] = mem.text(3.15, 0, "", ha="right", va="bottom", fontsize=8.5)
    mem.set(xlim=(-0.5, 3.2), ylabel="GiB at the step's peak")
    mem.set_xticks([0, 1], ["no checkpointing", "this setting"], fontsize=9)
    mem.tick_params(labelsize=8.5)
    fig.legend(handles=list(a["parts"].values()), loc="upper center", ncol=6, fontsize=8.5,
               frameon=False, bbox_to_anchor=(0.5, 0.89))
    flops.bar([0], [1.0], width=0.6, color="0.8")
    a["flops"] = flops.bar([1], [0], width=0.6, color="#dd8452")[0]
    a["flops_labels"] = [flops.text(i, 0, "", ha="center", va="bottom", fontsize=9)
                         for i in (0, 1)]
    flops.set(xlim=(-0.5, 1.5), ylim=(0, 1.6), ylabel="compute, x no checkpointing")
    flops.set_xticks([0, 1], ["none", "this"], fontsize=9)
    flops.tick_params(labelsize=8.5)
    flops.set_title("time if compute-bound", fontsize=9)
    for artist in (a["plain"], *a["parts"].values(), *a["labels"], a["card"], a["card_text"],
                   a["flops"], *a["flops_labels"], a["title"]):
        artist.set_animated(True)
    return a


def _draw(a: dict, gpu: str, layers: int, mode: str, segments: int,
          batch_size: int) -> None:
    s = _explore(gpu, layers, mode, segments, batch_size)
    top = 1.15 * max(s.plain.total, s.memory.total, s.gpu.capacity) / GiB
    a["mem"].set_ylim(0, top)
    a["plain"].set_height(s.plain.total / GiB)
    bottom = 0.0
    rows = dict(engine.breakdown_rows(s.memory.peak))
    for name, bar in a["parts"].items():
        bar.set_y(bottom)
        bar.set_height(rows.get(name, 0) / GiB)
        bottom += rows.get(name, 0) / GiB
    for text, m, x in zip(a["labels"], (s.plain, s.memory), (0, 1)):
        text.set_position((x, min(m.total / GiB, 0.93 * top)))
        text.set_text(format_bytes(m.total))
    cap = s.gpu.capacity / GiB
    a["card"].set_ydata([cap, cap])
    a["card_text"].set_position((3.15, cap))
    a["card_text"].set_text(s.gpu.capacity_label.replace(" (", "\n(", 1))
    a["flops"].set_height(min(s.flop_ratio, 1.55))
    for text, ratio, x in zip(a["flops_labels"], (1.0, s.flop_ratio), (0, 1)):
        text.set_position((x, min(ratio, 1.5)))
        text.set_text(f"x{ratio:.2f}")
    how = {"none": "no checkpointing", "blocks": "every block checkpointed",
           "sqrt": f"{s.segments} segments"}[mode]
    verdict = "fits" if s.memory.total <= s.gpu.capacity else "does NOT fit"
    a["title"].set_text(
        f"{layers} layers, batch {batch_size}, {s.precision} on the {gpu}, {how}: "
        f"peak {format_bytes(s.memory.total)}, {verdict}\n"
        f"least memory with segments: k = {s.best_segments}, segments of "
        f"{layers // s.best_segments} blocks (round(√{layers}) = {ckpt.sqrt_segments(layers)})")


def explorer(*, gpu: str = "T4", layers: int = 48, mode: str = "blocks",
             segments: int = 8, batch_size: int = 6) -> widgets.VBox:
    """Lecture 04's explorer: a GPT-2-small-sized model's predicted peak and compute per mode.

    Args:
        gpu (str): the preset shown first, a name of :data:`course_lib.device.GPUS`.
        layers, segments (int): the depth (4 to 96) and ``k`` shown first.
        mode (str): the mode shown first: ``"none"``, ``"blocks"`` or ``"sqrt"`` (``k`` segments).
        batch_size (int): the batch shown first, from 1 to 32.
    Returns:
        ipywidgets.VBox: :func:`course_lib.views.widgets.live_plot`'s box.
    Raises:
        ValueError: naming the argument, for a value outside the sliders' ranges.
    """
    choice("gpu", gpu, tuple(GPUS))
    choice("mode", mode, tuple(_CHOICES))
    for name, value, low, high in (("layers", layers, 4, _MAX_LAYERS),
                                   ("segments", segments, 1, _MAX_LAYERS),
                                   ("batch_size", batch_size, 1, 32)):
        integer(name, value, minimum=low, maximum=high)  # the slider's range
    style = {"description_width": "initial"}
    controls = {
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
        "layers": widgets.IntSlider(value=layers, min=4, max=_MAX_LAYERS,
                                    description="layers", style=style),
        "mode": widgets.Dropdown(options=[(label, m) for m, label in _CHOICES.items()],
                                 value=mode, description="checkpointing", style=style),
        "segments": widgets.IntSlider(value=segments, min=1, max=_MAX_LAYERS,
                                      description="segments k", style=style),
        "batch_size": widgets.IntSlider(value=batch_size, min=1, max=32,
                                        description="batch", style=style),
    }
    return live_plot(_draw, controls, setup=_setup, figsize=(8.4, 3.8))
