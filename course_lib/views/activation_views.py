"""02: lecture 02's figures (on their own Agg canvas, no pyplot; :func:`show` displays one)
and its out-of-memory widget over :func:`oom_threshold`, whose result draws the widget's picture."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure

from course_lib.device import GPUS, live_gpu
from course_lib.measurement.memory import StepBreakdown
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig
from course_lib.prediction import engine
from course_lib.prediction.engine import StepMemory
from course_lib.prediction.predict import Step, predict
from course_lib.units import MEMORY_CATEGORIES, GiB, MiB, format_bytes
from course_lib.validation import MAX_BATCH, WrongTypeError, choice, positive_int, text
from course_lib.views.widgets import agg_figure, check_figure, live_plot, render_png

# the widget's model widths: label -> (d_model, heads), GPT-2's sizes (50,257 tokens)
_WIDTHS = {"768 (GPT-2 small)": (768, 12), "1024 (GPT-2 medium)": (1024, 16),
          "1280 (GPT-2 large)": (1280, 20), "1600 (GPT-2 XL)": (1600, 25),
          "2560 (2.7B-wide)": (2560, 32)}
_MAX_SHOWN = 128
_THRESHOLD_FIGSIZE = (9.5, 3.6)  # inches, the widget's and the figure's


def show(fig: Figure):
    """A figure of this module as a PNG ``IPython.display.Image`` (a cell's last expression).

    Args:
        fig (matplotlib.figure.Figure): what a ``*_figure`` function returned.
    Returns:
        IPython.display.Image: the figure as a PNG.
    """
    from IPython.display import Image

    return Image(render_png(check_figure("fig", fig)))


def _series(name: str, values, length: int | None = None) -> list[float]:
    if not isinstance(values, list | tuple) or not values or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in values):
        raise ValueError(f"{name} must be a non-empty list of byte counts (numbers >= 0), "
                         f"got {values!r}")
    if length is not None and len(values) != length:
        raise ValueError(f"{name} must hold {length} values, one per x, got {len(values)}")
    return [v / MiB for v in values]


def scaling_figure(batches, gradients, activations, seq_lens, curves: dict) -> Figure:
    """Measured bytes: gradients and saved activations per batch size; activations per sequence.

    Args:
        batches, seq_lens (list of int): the batch sizes and the sequence lengths measured.
        gradients, activations (list of int): the bytes at each batch size.
        curves (dict): label -> saved activation bytes, one per sequence length.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas (:func:`show` displays it).
    Raises:
        ValueError: naming the argument, for lists that are not byte counts of the right length.
    """
    xs = _series("batches", batches)
    grads = _series("gradients", gradients, len(xs))
    acts = _series("activations", activations, len(xs))
    seqs = _series("seq_lens", seq_lens)
    if not isinstance(curves, dict) or not curves:
        raise ValueError(f"curves must be a non-empty dict of label -> bytes, got {curves!r}")
    fig = agg_figure((9.5, 3.2))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.16, top=0.88, wspace=0.22)
    left, right = fig.subplots(1, 2)
    left.plot(batches, grads, "o-", color=MEMORY_CATEGORIES["gradients"].colour, label="gradients")
    left.plot(batches, acts, "s-", color=MEMORY_CATEGORIES["activations"].colour,
              label="saved activations")
    left.set(xlabel="batch size", ylabel="MiB", title="the batch grows", ylim=(0, None))
    for (label, values), style in zip(curves.items(), ["o-", "s-", "x--", "d:"] * 4):
        right.plot(seq_lens, _series(f"curves[{label!r}]", values, len(seqs)), style, label=label)
    right.set(xlabel="sequence length (tokens)", ylabel="saved activations, MiB",
              title="the sequence grows", ylim=(0, None))
    for ax in (left, right):
        ax.title.set_fontsize(10)
        ax.legend(fontsize=8, loc="upper left")
    return fig


def step_figure(steps: dict) -> Figure:
    """One panel per training step: the bytes live after each allocation or free, by category.

    Args:
        steps (dict): panel title -> :class:`course_lib.measurement.memory.StepBreakdown`.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas (:func:`show` displays it).
    Raises:
        ValueError: naming ``steps``, for anything but a non-empty dict of ``StepBreakdown``.
    """
    if not isinstance(steps, dict) or not steps or not all(
            isinstance(s, StepBreakdown) for s in steps.values()):
        raise ValueError(f"steps must be a non-empty dict of title -> StepBreakdown, got {steps!r}")
    fig = agg_figure((9.5, 3.2))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.27, top=0.9, wspace=0.12)
    axes = fig.subplots(1, len(steps), sharey=True, squeeze=False)[0]
    top = max(max(map(sum, zip(*s.series.values()))) for s in steps.values()) / MiB
    for ax, (title, step) in zip(axes, steps.items()):
        parts = [MEMORY_CATEGORIES[name] for name in step.series]  # in stacking order
        ax.stackplot(range(len(step.events)), *[[v / MiB for v in s] for s in step.series.values()],
                     colors=[c.colour for c in parts], labels=[c.label for c in parts])
        for phase in ("backward", "optimizer"):
            if phase in step.events:
                x = step.events.index(phase)
                ax.axvline(x, color="k", lw=0.8, ls="--")
                ax.text(x, 1.12 * top, f" {phase}", va="top", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("allocations and frees, in order", fontsize=9)
        ax.set_ylim(0, 1.15 * top)
    axes[0].set_ylabel("MiB live")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
               frameon=False)
    return fig


@dataclass(frozen=True)
class _Threshold:
    """A step's predicted peaks at batch 1, 2, ..., and the ``largest`` batch that fits."""

    step: Step
    memory: tuple
    largest: int

    @property
    def oom(self) -> int:
        """The first batch size that runs out of memory: ``largest + 1``."""
        return self.largest + 1

    @property
    def kernel(self) -> str:
        """The step's attention kernel."""
        return kernels.attention_kernel(self.step.config, self.step.spec.compute, self.step.gpu)

    @property
    def parts_at_largest(self) -> dict[str, int]:
        """The largest fitting batch's peak (batch 1's if none fits) by what holds it."""
        m = self.memory[max(self.largest, 1) - 1]
        return {"activations": m.activations, "in flight": m.transient,
                "model states": m.model_states}

    def figure(self, *, title: str | None = None) -> Figure:
        """The widget's picture of this threshold, the step's batch outlined; ``title`` is the
        first line (default: the setting, as the widget shows it). :func:`show` displays it."""
        title = _title(self) if title is None else text("title", title)
        fig = agg_figure(_THRESHOLD_FIGSIZE)
        _draw_threshold(_setup_threshold(fig, animated=False), self, title)
        return fig


def oom_threshold(step: Step) -> _Threshold:
    """``predict(replace(step, micro_batch_size=b)).peak`` at b = 1 to 16, 32, 64 or 128
    (``memory``), and the ``largest`` b that fits the card's capacity (doubling, then bisection:
    the total never shrinks with b). Left out, as by the engine: the CUDA context, cuBLAS
    workspaces and fragmentation (lecture 06).

    Args:
        step (Step): the step on a GPU (a preset, "cuda" or a :class:`~course_lib.device.GPU`).
    Returns:
        Threshold: the predictions (``memory``) and the ``largest`` batch that fits.
    Raises:
        ValueError: naming ``gpu``, for a step on the CPU (no card to fill).
    Example:
        >>> gpt2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
        >>> oom_threshold(Step(gpt2, 8, precision="fp16-mixed", gpu="T4")).largest > 0
        True
    """
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a course_lib.prediction.step.Step, got "
                             f"{type(step).__name__}")
    if step.gpu is None:
        raise ValueError("gpu must name a GPU (a preset of course_lib.device.GPUS, 'cuda' or a "
                         "GPU), got None: the CPU has no card to fill")

    def peak(b: int) -> StepMemory:
        return predict(replace(step, micro_batch_size=b)).peak

    def fits(b: int) -> bool:
        return peak(b).total <= step.gpu.capacity

    hi = 1  # doubling until hi does not fit, then bisection between hi / 2 and hi
    while hi <= MAX_BATCH and fits(hi):
        hi *= 2
    above = range(hi // 2 + 1, min(hi, MAX_BATCH + 1))
    largest = hi // 2 + bisect.bisect_left(above, True, key=lambda b: not fits(b))
    shown = _shown(step.micro_batch_size, largest + 1)
    return _Threshold(step, tuple(peak(b) for b in range(1, shown + 1)), largest)


def _setup_threshold(fig: Figure, animated: bool = True) -> dict:
    """The threshold figure's artists, made once."""
    fig.subplots_adjust(left=0.075, right=0.80, bottom=0.14, top=0.82)
    ax = fig.subplots()
    a = {"ax": ax, "parts": [ax.stairs([0], [0.5, 1.5], baseline=[0], fill=True,
                                       color=c.colour, label=c.label)
                           for c in MEMORY_CATEGORIES.values()]}
    a["capacity"] = ax.axhline(0, color="k", lw=1.2)
    a["capacity_label"] = ax.text(0.6, 0, "", ha="left", va="bottom", fontsize=8,
                                  bbox={"fc": "white", "ec": "none", "pad": 1, "alpha": 0.85})
    a["oom"] = ax.axvline(0, color="#b00020", ls="--", lw=1.2)
    a["oom_label"] = ax.text(0, 0, "", color="#b00020", va="top", fontsize=8,
                             bbox={"fc": "white", "ec": "none", "pad": 1})
    a["batch"] = ax.bar([1], [0], fill=False, edgecolor="k", lw=1.6, width=0.8,
                        label="chosen batch")[0]
    a["title"] = fig.text(0.075, 0.97, "", fontsize=9, va="top")
    a["verdict"] = fig.text(0.075, 0.905, "", fontsize=9, va="top", weight="bold")
    ax.set(xlabel="batch size", ylabel="GiB")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    for artist in (*a["parts"], a["capacity"], a["capacity_label"], a["oom"], a["oom_label"],
                   a["batch"], a["title"], a["verdict"]):
        artist.set_animated(animated)
    return a


def _draw_threshold(a: dict, t: _Threshold, title: str) -> None:
    batch = t.step.micro_batch_size
    n = len(t.memory)
    edges = [k - 0.5 for k in range(1, n + 2)]  # one step per batch size
    bottom = [0.0] * n
    for artist, field in zip(a["parts"], MEMORY_CATEGORIES):  # one filled step per part, not n bars
        top = [lo + getattr(m, field) / GiB for lo, m in zip(bottom, t.memory)]
        artist.set_data(top, edges, baseline=bottom)
        bottom = top
    capacity = t.step.gpu.capacity / GiB
    ymax = 1.25 * max(max(bottom), capacity)  # the top fifth stays free for the OOM label
    a["ax"].set(xlim=(0, n + 1), ylim=(0, ymax))
    a["capacity"].set_ydata([capacity] * 2)
    a["capacity_label"].set_position((0.6, capacity))
    a["capacity_label"].set_text(t.step.gpu.capacity_label)
    shown = t.oom <= n
    right = t.oom <= n / 2  # the label on the side of the line with room for it
    a["oom"].set_xdata([t.oom - 0.5 if shown else math.nan] * 2)
    a["oom_label"].set_position((t.oom - 0.35 if right else t.oom - 0.65, 0.97 * ymax))
    a["oom_label"].set_horizontalalignment("left" if right else "right")
    a["oom_label"].set_text(f"out of memory from batch {t.oom}" if shown else "")
    b = min(batch, n)
    a["batch"].set_x(b - 0.4)
    a["batch"].set_height(bottom[b - 1])
    a["title"].set_text(title)
    if t.largest == 0:
        verdict, colour = "not even batch 1 fits", "#b00020"
    elif batch <= t.largest:
        verdict, colour = f"batch {batch} fits; the largest that fits is {t.largest}", "#1a7f37"
    else:
        verdict, colour = (f"batch {batch} does NOT fit: out of memory from batch {t.oom}",
                           "#b00020")
    peak = t.memory[b - 1]
    where = ("the optimizer step" if peak.moment.startswith(("optimizer", "AdamW"))
             else peak.moment.split(",")[0])
    a["verdict"].set_text(f"{verdict}   (peak of batch {b}: {format_bytes(peak.total)}, "
                          f"in {where})")
    a["verdict"].set_color(colour)


def _title(t: _Threshold) -> str:
    step, c = t.step, t.step.config
    foreach = kernels.adamw_foreach(step.gpu) if step.foreach is None else step.foreach
    return (f"d_model {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, sequence "
            f"{step.seq_len}, {step.precision}, {t.kernel} attention, "
            f"{'foreach' if foreach else 'per-tensor'} AdamW")


def _shown(batch: int, oom: int) -> int:
    """Batch sizes the widget draws: 16, 32, 64 or 128, enough for the batch and the threshold."""
    want = max(16, batch, oom + 1)
    return min(_MAX_SHOWN, 2 ** math.ceil(math.log2(want)))


def oom_widget(*, gpu: str = "T4", precision: str = "fp16-mixed", batch: int = 8) -> widgets.VBox:
    """The out-of-memory widget: a GPT's predicted step memory per batch size against a card
    (a preset, or on CUDA this GPU's free memory, read once), the batch outlined.

    Args:
        gpu (str): the GPU shown first, a name of :data:`course_lib.device.GPUS`.
        precision (str): shown first, one of :data:`course_lib.prediction.engine.PRECISIONS`.
        batch (int): the batch size outlined first, 1 to 64.
    Returns:
        ipywidgets.VBox: :func:`course_lib.views.widgets.live_plot`'s box.
    Raises:
        ValueError: naming the argument, for a bad value.
    """
    gpus = dict(GPUS)
    choice("gpu", gpu, tuple(gpus))
    engine.precision_of(precision)
    batch = positive_int("batch", batch, maximum=64)
    if torch.cuda.is_available():
        here = live_gpu()
        gpus[f"this GPU ({here.name}, free)"] = here

    def kw(description: str, width: str = "230px") -> dict:
        return dict(description=description, style={"description_width": "initial"},
                    layout=widgets.Layout(width=width))

    controls = {
        "gpu": widgets.Dropdown(options=list(gpus), value=gpu, **kw("GPU")),
        "width": widgets.Dropdown(options=list(_WIDTHS), value=next(iter(_WIDTHS)), **kw("width")),
        "layers": widgets.IntSlider(value=12, min=1, max=64, **kw("layers")),
        "seq": widgets.Dropdown(options=[256, 512, 1024, 2048, 4096, 8192], value=1024,
                                **kw("sequence", "180px")),
        "attention": widgets.Dropdown(options=["sdpa", "explicit"], value="sdpa",
                                      **kw("attention")),
        "precision": widgets.Dropdown(options=list(engine.PRECISIONS), value=precision,
                                      **kw("precision")),
        "foreach": widgets.Dropdown(options=[("foreach (GPU default)", True),
                                             ("per tensor", False)], value=True, **kw("AdamW")),
        "batch": widgets.IntSlider(value=batch, min=1, max=64, **kw("batch size", "180px")),
    }

    def draw(a, gpu, width, layers, seq, attention, precision, foreach, batch):
        d_model, heads = _WIDTHS[width]
        config = GPTConfig(vocab_size=50257, seq_len=seq, d_model=d_model, n_heads=heads,
                           n_layers=layers, dropout=0.1, attention=attention)
        t = oom_threshold(Step(config, batch, precision=precision, gpu=gpus[gpu],
                               foreach=foreach))
        _draw_threshold(a, t, _title(t))

    return live_plot(draw, controls, figsize=_THRESHOLD_FIGSIZE, columns=4, setup=_setup_threshold)
