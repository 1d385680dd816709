"""04: the figures of lecture 04 and its explorer.

* :func:`plot_timelines`: memory over one forward + backward, one curve per checkpointing
  mode (:mod:`course_lib.measurement.timeline`).
* :func:`plot_depths`: the peak of forward + backward against depth on log-log axes, measured
  (solid) and the memory engine's (dashed).
* :func:`lecture_sizes`: the lecture's models and batches for the device it runs on.
* :func:`explorer`: a GPT-2-small-sized model on a GPU preset, without checkpointing, with
  per-block checkpointing, or with ``checkpoint_sequential`` in ``k`` segments: the memory
  engine's step peak by category against the card's memory, and the step's compute
  (:func:`course_lib.prediction.checkpointed.checkpoint_cost`) against no checkpointing.
  :func:`explore` is its pure back end.

The explorer draws with :func:`course_lib.views.widgets.live_plot`'s ``setup``/``draw`` pair: the
bars and texts are made once, a change only sets their heights and texts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ipywidgets as widgets
import numpy as np
import torch

from course_lib.device import GPU, GPUS, live_gpu, pick_dtype
from course_lib.measurement.timeline import Timeline
from course_lib.model.gpt import GPTConfig
from course_lib.prediction import checkpointed, engine
from course_lib.prediction.predict import Prediction, Step, predict
from course_lib.training import checkpointing as ckpt
from course_lib.units import MEMORY_CATEGORIES, format_bytes
from course_lib.validation import MAX_BATCH, choice, integer, items, number, positive_int
from course_lib.views.widgets import live_plot

#: The checkpointing modes of lecture 04's explorer (of
#: :func:`course_lib.training.checkpointing.enable_checkpointing`) -> how its menu names them.
CHOICES = {"none": "none", "blocks": "per-block", "sqrt": "segments"}
#: The explorer's model: GPT-2 small's width, heads, sequence and vocabulary.
GPT2_SMALL = dict(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12)
#: The most layers the explorer offers.
MAX_EXPLORER_LAYERS = 96
#: Colours of the curves of :func:`plot_depths`.
COLORS = {"none": "#c44e52", "per-block": "#4c72b0", "√n segments": "#8c8c8c",
          "best segments": "#55a868"}


#: Lecture 04's sizes on a CPU: ``(config, batch, sweep, sweep_batch)`` of :func:`lecture_sizes`.
CPU_SIZES = (GPTConfig(vocab_size=64, seq_len=64, d_model=64, n_heads=4, n_layers=8,
                       attention="explicit"), 8,
             dict(vocab_size=32, seq_len=64, d_model=16, n_heads=2), 16)


def lecture_sizes(device) -> tuple[GPTConfig, int, dict, int]:
    """``(config, batch, sweep, sweep_batch)``: lecture 04's model and its depth sweep's.

    ``config`` is the model of sections 1, 2 and 4, its attention written as matmuls so that
    ``FlopCounterMode`` counts it on every device; ``sweep`` the keyword arguments of
    ``GPTConfig`` but ``n_layers``, narrow with long sequences so that activations outweigh the
    weights. On a CPU :data:`CPU_SIZES`, quick on one thread; on CUDA a model of real size in
    fp32, each batch the largest power of two whose step the memory engine predicts within a
    third (``config``) or half (``sweep`` at 64 layers, no checkpointing) of the free memory.

    Args:
        device (torch.device): where the lecture runs.

    Returns:
        tuple: the config, its batch, the sweep's keyword arguments and the sweep's batch.
    """
    if torch.device(device).type != "cuda":
        return CPU_SIZES
    gpu = live_gpu()
    config = GPTConfig(vocab_size=8192, seq_len=1024, d_model=512, n_heads=8, n_layers=12,
                       attention="explicit")
    sweep = dict(vocab_size=128, seq_len=1024, d_model=128, n_heads=2)

    def largest(c, share):
        fits = [b for b in (1, 2, 4, 8, 16, 32)
                if predict(Step(c, b, gpu=gpu)).total <= gpu.capacity // share]
        return max(fits, default=1)

    return config, largest(config, 3), sweep, largest(GPTConfig(**sweep, n_layers=64), 2)


def _color(name: str, i: int) -> str:
    return COLORS.get(name, f"C{i}")


def plot_timelines(ax, timelines: dict[str, Timeline]) -> None:
    """Draw each :class:`~course_lib.measurement.timeline.Timeline` on ``ax``, labelled with its peak.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        timelines (dict): label -> ``Timeline`` (from ``track_timeline`` or ``record_timeline``).

    Raises:
        ValueError: naming ``timelines``, if it is empty or holds anything but timelines.
    """
    if not isinstance(timelines, dict) or not timelines or not all(
            isinstance(t, Timeline) for t in timelines.values()):
        raise ValueError(f"timelines must be a non-empty dict of Timeline, got {timelines!r}")
    for i, (name, t) in enumerate(timelines.items()):
        ax.plot(t.clock, np.array(t.allocated) / 2**20, color=_color(name, i), lw=1.2,
                label=f"{name}: peak {format_bytes(t.peak)}")
    unit = next(iter(timelines.values())).unit
    ax.set_xlabel("time (µs)" if unit == "µs" else "allocations and frees, in order")
    ax.set_ylabel("allocated (MiB)")
    ax.legend(fontsize=9, loc="upper right")


def loglog_slope(depths, values) -> float:
    """The slope of ``log(values)`` against ``log(depths)``, fitted: ``p`` of ``values ~ n^p``.

    Args:
        depths (sequence of int): at least two positive depths.
        values (sequence of float): one positive value per depth.

    Returns:
        float: the fitted exponent.

    Raises:
        ValueError: naming ``depths`` or ``values``.
    """
    depths, values = ([number(name, v, above=0.0) for v in items(
        name, seq.tolist() if isinstance(seq, np.ndarray) else seq, max_len=10_000)]
        for name, seq in (("depths", depths), ("values", values)))
    if len(depths) < 2:
        raise ValueError(f"depths must hold at least two positive numbers, got {depths!r}")
    if len(values) != len(depths):
        raise ValueError(f"values must hold one positive number per depth, got {values!r}")
    return float(np.polyfit(np.log(depths), np.log(values), 1)[0])


def plot_depths(ax, depths, measured: dict, predicted: dict | None = None) -> None:
    """Peak bytes against depth on log-log axes: a line per mode, the engine's dashed over it.

    Each label gives the fitted exponent :func:`loglog_slope` (``n^p`` is a line of slope ``p``)
    and the slope between the two deepest points, where a linear term shows first.

    Args:
        ax (matplotlib.axes.Axes): where to draw.
        depths (sequence of int): the layers measured.
        measured (dict): label -> bytes per depth.
        predicted (dict, optional): label -> the engine's bytes per depth, drawn dashed.

    Raises:
        ValueError: naming ``depths``, ``measured`` or ``predicted``.
    """
    if not isinstance(measured, dict) or not measured:
        raise ValueError(f"measured must be a non-empty dict of bytes per depth, got {measured!r}")
    if predicted is not None and (not isinstance(predicted, dict) or set(predicted) - set(measured)):
        raise ValueError("predicted must be a dict with the labels of measured, or None")
    for i, (name, values) in enumerate(measured.items()):
        deep = loglog_slope(depths[-2:], values[-2:])
        ax.loglog(depths, np.array(values) / 2**20, "o-", color=_color(name, i), ms=4, lw=2.5,
                  label=f"{name}: slope {loglog_slope(depths, values):.2f}, "
                        f"{deep:.2f} at {depths[-2]}-{depths[-1]}")
    for name, values in (predicted or {}).items():
        ax.loglog(depths, np.array(values) / 2**20, "--", color="k", lw=0.9,
                  label="the memory engine" if name == next(iter(predicted)) else None)
    low = min(min(v) for v in measured.values()) / 2**20
    high = max(max(v) for v in measured.values()) / 2**20
    ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                         10000, 20000, 50000) if low / 1.5 <= t <= high * 1.5]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xticks(list(depths), [str(n) for n in depths])
    ax.minorticks_off()
    ax.set_xlabel("layers n")
    ax.set_ylabel("peak of forward + backward (MiB)")
    ax.legend(fontsize=8.5, loc="upper left")


def _precision(card: GPU) -> str:
    """How the lecture trains on ``card``: autocast in the dtype :func:`pick_dtype` gives it."""
    return "autocast-bf16" if pick_dtype(card) == torch.bfloat16 else "autocast-fp16"


@dataclass(frozen=True)
class Setting:
    """One setting of the explorer, predicted (:func:`explore`).

    Attributes:
        gpu (GPU): the card.
        precision (str): how the step trains there (autocast in the card's dtype).
        layers (int): blocks of the model.
        mode (str): a key of :data:`CHOICES`.
        segments (int or None): ``k``, for ``"sqrt"`` only.
        best_segments (int): the count with the least memory
            (:func:`course_lib.training.checkpointing.best_segments`).
        memory (Prediction): the step with this checkpointing.
        plain (Prediction): the same step without checkpointing.
        flop_ratio (float): the step's FLOPs over those without checkpointing.
    """

    gpu: GPU
    precision: str
    layers: int
    mode: str
    segments: int | None
    best_segments: int
    memory: Prediction
    plain: Prediction
    flop_ratio: float

    @property
    def fits(self) -> bool:
        """Whether the step's peak fits in the card's capacity."""
        return self.memory.total <= self.gpu.capacity


def explore(gpu: str = "T4", layers: int = 48, mode: str = "blocks",
            segments: int = 8, batch_size: int = 6) -> Setting:
    """Predict one steady-state AdamW step of a GPT-2-small-sized model on a GPU preset.

    The model is :data:`GPT2_SMALL` with ``layers`` blocks, trained under ``torch.autocast`` in
    the dtype the card gets (bf16 from compute capability 8.0, fp16 on a T4); memory from
    :func:`course_lib.prediction.predict.predict`, compute from
    :func:`course_lib.prediction.checkpointed.checkpoint_cost`.

    Args:
        gpu (str): a name of :data:`course_lib.device.GPUS`.
        layers (int): from 1 to :data:`MAX_EXPLORER_LAYERS`.
        mode (str): a key of :data:`CHOICES`.
        segments (int): ``k`` for ``"sqrt"``, at least 1; more than ``layers`` counts as
            ``layers``. Ignored otherwise.
        batch_size (int): sequences, from 1 to :data:`course_lib.validation.MAX_BATCH`.

    Returns:
        Setting: the prediction.

    Raises:
        ValueError: naming the parameter, for a value out of range.
    """
    choice("gpu", gpu, tuple(GPUS))
    layers = positive_int("layers", layers, maximum=MAX_EXPLORER_LAYERS)
    choice("mode", mode, tuple(CHOICES))
    segments = positive_int("segments", segments, maximum=MAX_EXPLORER_LAYERS)
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    card = GPUS[gpu]
    precision = _precision(card)
    config = GPTConfig(**GPT2_SMALL, n_layers=layers)
    k = min(segments, layers) if mode == "sqrt" else None
    kernel = dict(dtype=pick_dtype(card), gpu=card, autocast=True)
    plain = Step(config, batch_size, precision=precision, gpu=card)
    memory = predict(replace(plain, mode=mode, segments=k))
    cost = checkpointed.checkpoint_cost(config, batch_size, mode, segments=k, **kernel)
    best = ckpt.best_segments(layers, checkpointed.block_ratio(config, batch_size, **kernel))
    return Setting(card, precision, layers, mode, k, best, memory, predict(plain),
                   cost.flop_ratio)


def _setup(fig) -> dict:
    mem, flops = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1.4]})
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.12, top=0.74, wspace=0.36)
    a = {"mem": mem, "title": fig.text(0.5, 0.975, "", ha="center", va="top", fontsize=10)}
    a["plain"] = mem.bar([0], [0], width=0.6, color="0.8")[0]
    a["parts"] = {c.label: mem.bar([1], [0], width=0.6, color=c.colour)[0]
                  for c in MEMORY_CATEGORIES.values()}
    for name, patch in a["parts"].items():
        patch.set_label(name)
    a["labels"] = [mem.text(i, 0, "", ha="center", va="bottom", fontsize=9) for i in (0, 1)]
    a["card"] = mem.axhline(0, color="k", ls="--", lw=1)
    a["card_text"] = mem.text(3.15, 0, "", ha="right", va="bottom", fontsize=8.5)
    mem.set_xlim(-0.5, 3.2)
    mem.set_xticks([0, 1], ["no checkpointing", "this setting"], fontsize=9)
    mem.set_ylabel("GiB at the step's peak")
    mem.tick_params(labelsize=8.5)
    fig.legend(handles=list(a["parts"].values()), loc="upper center", ncol=6, fontsize=8.5,
               frameon=False, bbox_to_anchor=(0.5, 0.89))
    flops.bar([0], [1.0], width=0.6, color="0.8")
    a["flops"] = flops.bar([1], [0], width=0.6, color="#dd8452")[0]
    a["flops_labels"] = [flops.text(i, 0, "", ha="center", va="bottom", fontsize=9)
                         for i in (0, 1)]
    flops.set_xlim(-0.5, 1.5)
    flops.set_ylim(0, 1.6)
    flops.set_xticks([0, 1], ["none", "this"], fontsize=9)
    flops.set_ylabel("compute, x no checkpointing")
    flops.tick_params(labelsize=8.5)
    flops.set_title("time if compute-bound", fontsize=9)
    for artist in (a["plain"], *a["parts"].values(), *a["labels"], a["card"], a["card_text"],
                   a["flops"], *a["flops_labels"], a["title"]):
        artist.set_animated(True)
    return a


def _draw(a: dict, gpu: str, layers: int, mode: str, segments: int,
          batch_size: int) -> None:
    s = explore(gpu, layers, mode, segments, batch_size)
    gib = 2**30
    top = 1.15 * max(s.plain.total, s.memory.total, s.gpu.capacity) / gib
    a["mem"].set_ylim(0, top)
    a["plain"].set_height(s.plain.total / gib)
    bottom = 0.0
    rows = dict(engine.breakdown_rows(s.memory.peak))
    for name, bar in a["parts"].items():
        bar.set_y(bottom)
        bar.set_height(rows.get(name, 0) / gib)
        bottom += rows.get(name, 0) / gib
    for text, m, x in zip(a["labels"], (s.plain, s.memory), (0, 1)):
        text.set_position((x, min(m.total / gib, 0.93 * top)))
        text.set_text(format_bytes(m.total))
    cap = s.gpu.capacity / gib
    a["card"].set_ydata([cap, cap])
    a["card_text"].set_position((3.15, cap))
    a["card_text"].set_text(s.gpu.capacity_label.replace(" (", "\n(", 1))
    a["flops"].set_height(min(s.flop_ratio, 1.55))
    for text, ratio, x in zip(a["flops_labels"], (1.0, s.flop_ratio), (0, 1)):
        text.set_position((x, min(ratio, 1.5)))
        text.set_text(f"x{ratio:.2f}")
    how = {"none": "no checkpointing", "blocks": "every block checkpointed",
           "sqrt": f"{s.segments} segments"}[mode]
    verdict = "fits" if s.fits else "does NOT fit"
    a["title"].set_text(
        f"{layers} layers, batch {batch_size}, {s.precision} on the {gpu}, {how}: "
        f"peak {format_bytes(s.memory.total)}, {verdict}\n"
        f"least memory with segments: k = {s.best_segments}, segments of "
        f"{layers // s.best_segments} blocks (round(√{layers}) = {ckpt.sqrt_segments(layers)})")


def explorer(*, gpu: str = "T4", layers: int = 48, mode: str = "blocks",
             segments: int = 8, batch_size: int = 6) -> widgets.VBox:
    """The explorer of lecture 04 (see the module doc): controls over :func:`explore`'s figure.

    Args:
        gpu (str): the preset shown first, a name of :data:`course_lib.device.GPUS`.
        layers (int): the depth shown first, from 4 to :data:`MAX_EXPLORER_LAYERS`.
        mode (str): a key of :data:`CHOICES`.
        segments (int): ``k`` shown first, from 1 to :data:`MAX_EXPLORER_LAYERS`.
        batch_size (int): the batch shown first, from 1 to 32.

    Returns:
        ipywidgets.VBox: from :func:`course_lib.views.widgets.live_plot`.

    Raises:
        ValueError: naming the parameter, for a value :func:`explore` refuses or outside the
            sliders' ranges.
    """
    explore(gpu, layers, mode, segments, batch_size)  # checks the arguments
    for name, value, low, high in (("layers", layers, 4, MAX_EXPLORER_LAYERS),
                                   ("batch_size", batch_size, 1, 32)):
        integer(name, value, minimum=low, maximum=high)  # the slider's range
    style = {"description_width": "initial"}
    controls = {
        "gpu": widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU"),
        "layers": widgets.IntSlider(value=layers, min=4, max=MAX_EXPLORER_LAYERS,
                                    description="layers", style=style),
        "mode": widgets.Dropdown(options=[(label, m) for m, label in CHOICES.items()], value=mode,
                                 description="checkpointing", style=style),
        "segments": widgets.IntSlider(value=segments, min=1, max=MAX_EXPLORER_LAYERS,
                                      description="segments k", style=style),
        "batch_size": widgets.IntSlider(value=batch_size, min=1, max=32,
                                        description="batch", style=style),
    }
    return live_plot(_draw, controls, setup=_setup, figsize=(8.4, 3.8))


__all__ = ["CHOICES", "CPU_SIZES", "GPT2_SMALL", "Setting", "explore", "explorer",
           "lecture_sizes", "loglog_slope", "plot_depths", "plot_timelines"]
