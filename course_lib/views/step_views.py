"""03: the widgets of lecture 03 (the trade-off explorer, the step-through, the playground).

Figures are at most 8.6 inches wide, their text at least 8 points (1280-1440 pixels, sidebar open).
"""

from __future__ import annotations

import copy
import html
import math
import time
from dataclasses import dataclass, replace

import ipywidgets as widgets
import torch
from matplotlib import cbook
from matplotlib.collections import LineCollection
from matplotlib.ticker import FuncFormatter

from course_lib.device import GPUS, resolve_gpu
from course_lib.measurement.timing import TimeLimitExceeded, within_seconds
from course_lib.model.gpt import GPT, GPTConfig, check_batch, check_config, random_tokens
from course_lib.model.toy_data import markov_entropy
from course_lib.prediction.formulas import mixed_precision_for
from course_lib.prediction.predict import Prediction, Step, predict
from course_lib.prediction.step_setup import build, train_options
from course_lib.prediction.time_model import DeviceSpeed
from course_lib.training.loop import train
from course_lib.units import GiB, KiB, MiB, format_bytes
from course_lib.validation import (
    MAX_BATCH,
    WrongTypeError,
    available_device as as_device,
    boolean,
    choice,
    number,
    positive_int,
)
from course_lib.views.playground import (
    PLAYGROUND_MODES,
    MeasuredStep,
    Playground,
    measure_step_cost,
)
from course_lib.views.widgets import (
    agg_figure,
    chosen_values,
    live_plot,
    nice_ceiling,
    show_error,
)


def _format_duration(seconds: float) -> str:
    """Seconds (at least 0) as people read them: three digits up to a minute, then minutes, then
    hours (``"42.1 ms"``, ``"31.0 min"``)."""
    if seconds / 60 >= 59.95:  # what would print as "60.0 min"
        return f"{seconds / 3600:.1f} h"
    if seconds >= 59.95:  # what would print as "60.0 s"
        return f"{seconds / 60:.1f} min"
    # 0.9995 prints as "1.00", not "1000" in the unit below
    value, unit = next((seconds / scale, unit) for scale, unit in
                       ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
                       if seconds / scale >= 0.9995 or unit == "µs")
    digits = 0 if value >= 99.95 else 1 if value >= 9.995 else 2
    return f"{value:.{digits}f} {unit}"


def _duration_tick(seconds: float, _=None) -> str:
    """A time axis's tick: :func:`_format_duration` without trailing zeros (``"2 s"``, ``"0"``)."""
    if seconds <= 0:
        return "0"
    value, unit = _format_duration(seconds).split(" ")
    return f"{value.rstrip('0').rstrip('.') if '.' in value else value} {unit}"


def _byte_unit(n: float) -> tuple[int, str]:
    """The binary unit a memory axis up to ``n`` bytes is labelled in."""
    return next(((size, name) for size, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))
                 if n >= size), (1, "bytes"))


def _animate(*artists) -> None:
    """Mark the artists a draw function changes: drawn over the still picture of the rest."""
    for artist in cbook.flatten(artists):
        artist.set_animated(True)


def _on_top(text, x: float, value: float, top: float, words: str) -> None:
    """A number over a bar; for a bar above the panel, boxed inside its top, with an arrow."""
    over = value > top * 0.88
    text.set_position((x, top * 0.96 if over else value))
    text.set_verticalalignment("top" if over else "bottom")
    text.set_bbox(dict(boxstyle="round,pad=0.25", fc="white", ec="0.6", lw=0.6) if over else None)
    text.set_text(("↑ " if over else "") + words)


#: The checkpointing modes the explorer offers (lecture 04's): mode -> menu label.
CHECKPOINT_CHOICES = {"none": "none", "blocks": "every block", "selective": "selective"}
#: Longest the "measure here" button may block, in seconds (it declines or stops what is slower).
MEASURE_LIMIT_SECONDS = 20.0
#: The micro-batch sizes and accumulation steps the explorer's sliders offer.
SIZES = (1, 2, 4, 8, 16, 32, 64)
# the time bars' parts: label, seconds of a StepTime, colour
_PARTS = (("compute", lambda t: t.compute_seconds, "#4c72b0"),
          ("operators", lambda t: t.pointwise_seconds + t.launch_seconds + t.transfer_seconds,
           "#dd8452"),
          ("optimizer", lambda t: t.optimizer_seconds, "#8c8c8c"))
_FITS, _TOO_BIG, _NO_LIMIT = "#55a868", "#c44e52", "#8c8c8c"


@dataclass(frozen=True)
class _Tradeoff:
    """``K`` micro-batches of ``b`` and one batch of ``b K``, predicted; the card's bytes and
    whether each fits them (None on the CPU)."""

    accumulated: Prediction
    plain: Prediction
    capacity: int | None
    fits: bool | None
    plain_fits: bool | None

    def verdict(self) -> str:
        """One line: does each step fit, in words."""
        step = self.accumulated.step
        b, K, B = step.micro_batch_size, step.accumulation_steps, step.batch_size
        if self.capacity is None:
            return f"on the CPU no memory limit is drawn (host memory): {B} sequences per step"
        where = f"in the {step.gpu.name}'s {format_bytes(self.capacity)}" + (
            " free" if step.gpu.live else "")
        word = {True: "fits", False: "does not fit"}
        return (f"{K} micro-batch{'es' if K > 1 else ''} of {b}: {word[self.fits]} {where};  "
                f"one batch of {B}: {word[self.plain_fits]}")


def tradeoff(step: Step, speed: DeviceSpeed | None = None) -> _Tradeoff:
    """``step`` (``accumulated``) and the one-batch step it replaces (``plain``: ``b K`` in one
    pass, no checkpointing), predicted, and whether each fits (``fits``, ``plain_fits``).

    Args:
        step (Step): the accumulated step.
        speed (DeviceSpeed, optional): as :func:`course_lib.prediction.predict.predict`'s.
    Returns:
        Tradeoff: both predictions and whether each fits the step's GPU.
    Example:
        >>> t = tradeoff(Step(GPTConfig(n_layers=2), 4, 8, precision="bf16-mixed", gpu="T4"))
        >>> t.plain.step.micro_batch_size, t.fits
        (32, True)
    """
    accumulated = predict(step, speed)  # which checks step and speed
    plain = predict(replace(step, micro_batch_size=step.batch_size, accumulation_steps=1,
                            mode="none", every=1, segments=None), speed)
    if step.gpu is None:
        return _Tradeoff(accumulated, plain, None, None, None)
    capacity = step.gpu.capacity
    return _Tradeoff(accumulated, plain, capacity, accumulated.total <= capacity,
                     plain.total <= capacity)


def _memory_top(t: _Tradeoff) -> int:
    """The memory panel's top in bytes, fixed for a card, a model and a precision."""
    if t.capacity is not None:
        return _rounded(1.25 * t.capacity)
    return _rounded(1.15 * predict(replace(t.plain.step, micro_batch_size=max(SIZES))).total)


def _rounded(top: float) -> int:
    """``top`` bytes rounded up to 1, 2 or 5 times a power of ten of its unit."""
    unit, _ = _byte_unit(top)
    return int(nice_ceiling(top / unit) * unit)


def _setup_tradeoff(fig, animated: bool = True) -> dict:
    mem, tim = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.075, right=0.99, bottom=0.17, top=0.75, wspace=0.28)
    a = {"mem": mem, "time": tim}
    a["mem_bars"] = mem.bar([0, 1], [0, 0], width=0.6, color=[_NO_LIMIT, _NO_LIMIT])
    a["cap"] = mem.axhline(math.nan, color="k", ls="--", lw=1)
    a["cap_text"] = mem.text(2.45, 0, "", ha="right", va="bottom", fontsize=8.5)
    a["mem_measured"], = mem.plot([1], [math.nan], "k_", ms=34, mew=2.5)
    a["time_bars"] = [tim.bar([0, 1], [0, 0], width=0.6, color=color, label=label)
                      for label, _, color in _PARTS]
    a["time_measured"], = tim.plot([1], [math.nan], "k_", ms=34, mew=2.5, label="measured")
    for ax, name, title in ((mem, "mem", "peak memory of one optimizer step"),
                            (tim, "time", "time per optimizer step (a model)")):
        a[f"{name}_labels"] = [ax.text(i, 0, "", ha="center", va="bottom", fontsize=8.5)
                               for i in (0, 1)]
        ax.set_xlim(-0.5, 2.5)
        ax.tick_params(labelsize=8.5)
        ax.set_title(title, fontsize=10)
    tim.yaxis.set_major_formatter(FuncFormatter(_duration_tick))
    tim.legend(loc="upper right", fontsize=8.5, frameon=False, markerscale=0.3)
    a["title"] = fig.text(0.5, 0.985, "", ha="center", va="top", fontsize=10)
    a["verdict"] = fig.text(0.5, 0.895, "", ha="center", va="top", fontsize=9.5)
    if animated:
        _animate(*(v for k, v in a.items() if k not in ("mem", "time")))
    return a


def _draw_tradeoff(a: dict, t: _Tradeoff, measured: MeasuredStep | None, what: str,
                   top: int) -> None:
    step, plain = t.accumulated, t.plain
    b, K, B = step.step.micro_batch_size, step.step.accumulation_steps, step.step.batch_size
    ckpt = "" if step.step.mode == "none" else f", checkpointing {step.step.mode}"
    a["title"].set_text(f"{what}\n{K} micro-batch{'es' if K > 1 else ''} of {b}{ckpt} "
                        f"(= {B} sequences per step) against one batch of {B}")
    a["verdict"].set_text(t.verdict())
    a["verdict"].set_color("k" if t.fits is None else _FITS if t.fits else _TOO_BIG)
    mem, tim = a["mem"], a["time"]
    unit, name = _byte_unit(top)
    mem.set_ylim(0, top / unit)
    mem.set_ylabel(name, fontsize=9)
    for ax in (mem, tim):
        ax.set_xticks([0, 1], [f"one batch\nof {B}", f"{K} x {b}\naccumulated"])
    for i, (cost, fits) in enumerate(((plain, t.plain_fits), (step, t.fits))):
        bar = a["mem_bars"][i]
        bar.set_height(min(cost.total, top) / unit)
        bar.set_color(_NO_LIMIT if fits is None else _FITS if fits else _TOO_BIG)
        extra = (f"\nmeasured {format_bytes(measured.peak_bytes)}" if measured and i else "")
        _on_top(a["mem_labels"][i], i, cost.total / unit, top / unit,
                format_bytes(cost.total) + extra)
    cap = math.nan if t.capacity is None else t.capacity / unit
    a["cap"].set_ydata([cap] * 2)
    a["cap_text"].set_position((2.45, cap))
    a["cap_text"].set_text("" if t.capacity is None else
                           step.step.gpu.capacity_label.replace(" (", "\n(", 1))
    a["mem_measured"].set_ydata([min(measured.peak_bytes, top) / unit if measured else math.nan])
    seconds = [plain.seconds, step.seconds] + ([measured.seconds] if measured else [])
    time_top = nice_ceiling(1.3 * max(seconds))
    tim.set_ylim(0, time_top)
    bottom = [0.0, 0.0]
    for bars, (_, seconds_of, _) in zip(a["time_bars"], _PARTS):
        for i, (bar, cost) in enumerate(zip(bars, (plain, step))):
            height = seconds_of(cost.time)
            bar.set_y(bottom[i])
            bar.set_height(height)
            bottom[i] += height
    for i, cost in enumerate((plain, step)):
        ratio = "" if i == 0 else f" (x{step.seconds / plain.seconds:.2f})"
        extra = f"\nmeasured {_format_duration(measured.seconds)}" if measured and i else ""
        _on_top(a["time_labels"][i], i, cost.seconds, time_top,
                _format_duration(cost.seconds) + ratio + extra)
    a["time_measured"].set_ydata([measured.seconds if measured else math.nan])


def tradeoff_figure(t: _Tradeoff, what: str, *, figsize: tuple = (8.6, 3.7)):
    """The explorer's picture of :func:`tradeoff`'s ``t`` as a static ``Figure`` on an Agg canvas.

    Args:
        t (Tradeoff): what :func:`tradeoff` returned.
        what (str): the title's first line: the model, precision and card.
        figsize (tuple): inches.
    Returns:
        matplotlib.figure.Figure: with an Agg canvas, not shown.
    """
    if not isinstance(t, _Tradeoff):
        raise WrongTypeError(f"t must be a Tradeoff (tradeoff(...)), got {type(t).__name__}")
    fig = agg_figure(figsize)
    top = _rounded(int(1.25 * t.capacity if t.capacity is not None else
                       1.3 * max(t.accumulated.total, t.plain.total)))
    _draw_tradeoff(_setup_tradeoff(fig, animated=False), t, None, what, top)
    return fig


def tradeoff_explorer(models: dict[str, GPTConfig], *, speed: DeviceSpeed,
                      device: torch.device | str = "cpu", model: str | None = None,
                      gpu: str | None = None, precision: str = "fp32",
                      micro_batch_size: int = 4, accumulation_steps: int = 4,
                      checkpointing_menu: bool = False) -> widgets.VBox:
    """The trade-off widget of lecture 03: :func:`tradeoff`'s peak memory against the card and
    time per step; "measure here" runs the setting on ``device`` and adds it to ``measured``
    (setting -> :class:`~course_lib.views.playground.MeasuredStep`).

    Args:
        models (dict): the model menu, name -> config.
        speed (DeviceSpeed): this device's measured speed.
        device (torch.device or str): this kernel's device, where the button measures.
        model, gpu (str, optional): the menus' first values (default: the first model, "here").
        precision (str): the precision menu's first value, ``"fp32"`` or ``"mixed"``.
        micro_batch_size, accumulation_steps (int): the sliders' first values, in :data:`SIZES`.
        checkpointing_menu (bool): offer a menu of checkpointing modes.
    Returns:
        ipywidgets.VBox: with ``view``, ``button``, ``status``, ``measured`` and ``measure()``.
    Raises:
        ValueError: naming the argument, for a bad value.
    """
    if not isinstance(models, dict) or not models:
        raise ValueError(f"models must map at least one name to a GPTConfig, got {models!r:.80}")
    for name, config in models.items():
        check_config(config, f"models[{name!r}]")
    boolean("checkpointing_menu", checkpointing_menu)
    device = as_device("device", device)
    if not isinstance(speed, DeviceSpeed):
        raise WrongTypeError(f"speed must be a DeviceSpeed (time_model.device_speed), got "
                             f"{type(speed).__name__}")
    here = speed.name if device.type == "cpu" else f"{speed.name} (here)"
    # each card decoded once (a live card's free memory read now): the menu's label -> GPU
    targets = {**GPUS, here: resolve_gpu("cuda") if device.type == "cuda" else None}
    model = next(iter(models)) if model is None else model
    gpu = here if gpu is None else gpu
    positive_int("micro_batch_size", micro_batch_size, maximum=MAX_BATCH)  # TypeError for 1.5
    positive_int("accumulation_steps", accumulation_steps, maximum=MAX_BATCH)
    for label, value, options in (("model", model, models), ("gpu", gpu, targets),
                                  ("precision", precision, ("fp32", "mixed")),
                                  ("micro_batch_size", micro_batch_size, SIZES),
                                  ("accumulation_steps", accumulation_steps, SIZES)):
        if isinstance(value, bool) or not isinstance(value, str | int) or value not in options:
            raise ValueError(f"{label} must be one of {list(options)}, got {value!r:.80}")
    wide = {"style": {"description_width": "initial"}}
    controls = {
        "model": widgets.Dropdown(options=list(models), value=model, description="model",
                                  layout=widgets.Layout(width="300px"), **wide),
        "gpu": widgets.Dropdown(options=list(targets), value=gpu, description="GPU",
                                layout=widgets.Layout(width="250px"), **wide),
        "precision": widgets.Dropdown(options=[("fp32", "fp32"), ("16-bit mixed", "mixed")],
                                      value=precision, description="precision",
                                      layout=widgets.Layout(width="210px"), **wide),
        "micro_batch_size": widgets.SelectionSlider(
            options=list(SIZES), value=micro_batch_size, description="micro-batch b", **wide),
        "accumulation_steps": widgets.SelectionSlider(
            options=list(SIZES), value=accumulation_steps, description="accumulation steps K",
            **wide),
    }
    if checkpointing_menu:
        controls["mode"] = widgets.ToggleButtons(
            options=[(label, mode) for mode, label in CHECKPOINT_CHOICES.items()], value="none",
            description="checkpointing", **wide)
    measured: dict[tuple, MeasuredStep] = {}
    tops: dict[tuple, int] = {}

    def settings(values: dict) -> tuple[_Tradeoff, tuple]:
        card = targets[values["gpu"]]
        precision = (mixed_precision_for(card) if values["precision"] == "mixed"
                     else values["precision"])
        step = Step(models[values["model"]], values["micro_batch_size"],
                    values["accumulation_steps"], precision=precision,
                    mode=values.get("mode", "none"), gpu=card)
        t = tradeoff(step, speed if values["gpu"] == here else None)
        return t, (values["model"], precision, step.micro_batch_size,
                   step.accumulation_steps, step.mode)

    def draw(artists, **values):
        t, key = settings(values)
        model, gpu, precision = values["model"], values["gpu"], key[1]
        scale = (model, gpu, precision)  # the memory axis: fixed for a model, card, precision
        if scale not in tops:
            tops[scale] = _memory_top(t)
        _draw_tradeoff(artists, t, measured.get(key) if gpu == here else None,
                       f"{model}, {precision}, on {gpu}", tops[scale])

    view = live_plot(draw, controls, setup=_setup_tradeoff, figsize=(8.6, 3.7))
    button = widgets.Button(description="measure here", icon="stopwatch",
                            tooltip="run this setting on this kernel's device and draw the "
                                    "measurement beside the prediction",
                            layout=widgets.Layout(width="auto"))
    status = widgets.Output()

    def measure(_=None) -> None:
        status.clear_output()
        with status:
            try:
                done = _measure_within_limit(controls, here, settings, device, measured)
            except Exception as exc:  # a button must show a message, never a traceback
                show_error(exc)
                return
        if done:
            view.redraw()

    button.on_click(measure)
    box = widgets.VBox([view, widgets.HBox([button, status])])
    box.view, box.button, box.status, box.measured, box.measure = (view, button, status,
                                                                   measured, measure)
    return box


# steps a measurement runs, in plain steps: two for memory (slower under the tracker), one
# warm-up and three timed
_MEASURED_STEPS = 8


def _measure_within_limit(controls, here, settings, device, measured) -> bool:
    """The explorer's button: measure here unless too slow; whether it measured."""
    controls["gpu"].value = here  # what is measured here is compared with this device
    values = chosen_values(controls)
    t, key = settings(values)
    model_name, p = values["model"], t.accumulated
    step, config = p.step, p.step.config
    predicted = _format_duration(p.seconds)
    if _MEASURED_STEPS * p.seconds > MEASURE_LIMIT_SECONDS:
        print(f"not measured: {model_name} would take about "
              f"{_format_duration(_MEASURED_STEPS * p.seconds)} here (predicted {predicted} "
              f"per step); choose a smaller model")
        return False
    start = time.perf_counter()

    def one_step() -> None:  # what the measurement repeats: build, then one optimizer step
        model, optimizer = build(config, precision=step.precision, mode=step.mode, device=device)
        train(model, optimizer, [random_tokens(config, step.batch_size, device=device)],
              micro_batch_size=step.micro_batch_size, accumulation_steps=step.accumulation_steps,
              **train_options(step.precision, device))

    limit = MEASURE_LIMIT_SECONDS / 3
    try:
        _, first = within_seconds(one_step, limit, what="the first step")
    except TimeLimitExceeded:
        print(f"not measured: the first step of {model_name} took more than "
              f"{_format_duration(limit)} here (predicted {predicted} per step): this machine is "
              f"slower than predicted, or busy; stopped after "
              f"{_format_duration(time.perf_counter() - start)}")
        return False
    second = time.perf_counter()
    one_step()
    plain = time.perf_counter() - second
    need = 2 * first + 4 * plain
    if time.perf_counter() - start + need > MEASURE_LIMIT_SECONDS:
        print(f"not measured: one step of {model_name} took {_format_duration(plain)} here "
              f"(predicted {predicted}), so the measurement would take about "
              f"{_format_duration(need)} more; choose a smaller model")
        return False
    m = measured[key] = measure_step_cost(step, device=device)
    print(f"measured here: peak {format_bytes(m.peak_bytes)} (predicted "
          f"{format_bytes(p.total)}), {_format_duration(m.seconds)} per step "
          f"(predicted {predicted}); took {_format_duration(time.perf_counter() - start)}")
    return True


#: The loops the step-through shows: mode -> lines of code.
LOOPS = {
    "right": ["optimizer.zero_grad()",
              "for x, y in batch.split(b):       # K micro-batches",
              "    loss = model(x, y)            # forward",
              "    (loss / K).backward()         # .grad += gradient / K",
              "optimizer.step()                  # the weights move, once",
              "optimizer.zero_grad()             # empty the buffer"],
    "no / K (bug)": ["optimizer.zero_grad()",
                     "for x, y in batch.split(b):",
                     "    loss = model(x, y)",
                     "    loss.backward()               # BUG: not divided by K",
                     "optimizer.step()",
                     "optimizer.zero_grad()"],
    "zero_grad in the loop (bug)": ["for x, y in batch.split(b):",
                                    "    optimizer.zero_grad()         # BUG: empties .grad",
                                    "    loss = model(x, y)",
                                    "    (loss / K).backward()",
                                    "optimizer.step()",
                                    "optimizer.zero_grad()"],
}


@dataclass(frozen=True)
class _Frame:
    """One moment of the step: the lines running and, per group, ``.grad`` and the weights."""

    lines: tuple[int, ...]
    caption: str
    micro_batch: int | None
    done: int
    grad: tuple[float, ...]
    moved: tuple[float, ...]


@dataclass(frozen=True)
class _StepRecording:
    """A recorded optimizer step of ``K`` micro-batches with the loop ``mode``, as frames."""

    mode: str
    groups: tuple[str, ...]
    K: int
    micro_batch_size: int
    frames: tuple[_Frame, ...]


def _parameter_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """Group name -> parameter names: embeddings, each block's attention and MLP, LayerNorms."""
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "blocks" and parts[2] in ("attn", "mlp"):
            key = f"block {parts[1]} {'attention' if parts[2] == 'attn' else 'MLP'}"
        elif "emb" in parts[0]:
            key = "embeddings"
        else:
            key = "LayerNorms"
        groups.setdefault(key, []).append(name)
    order = ["embeddings", *(k for k in groups if k.startswith("block")), "LayerNorms"]
    return {k: groups[k] for k in order if k in groups}


def _norms(tensors: dict[str, torch.Tensor | None], groups: dict[str, list[str]]) -> list[float]:
    return [math.sqrt(sum(float(tensors[n].double().pow(2).sum()) for n in names
                          if tensors.get(n) is not None)) for names in groups.values()]


def record_accumulation_step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                             micro_batch_size: int, mode: str = "right",
                             lr: float = 1e-2) -> _StepRecording:
    """Run one AdamW step of ``K = B / micro_batch_size`` micro-batches (2 or more) on a copy of
    the course GPT ``model`` with the loop ``mode`` of :data:`LOOPS`, recording after every line
    each group's ``.grad`` norm over the whole batch's (1 at the end of a right loop) and the
    weights' change over their norm, for :func:`step_through`.

    Args:
        model (torch.nn.Module): a course GPT.
        inputs, targets (torch.Tensor): ``(B, T)`` token ids.
        micro_batch_size (int): must divide ``B`` into 2 or more micro-batches.
        mode (str): a key of :data:`LOOPS`.
        lr (float): AdamW's learning rate.
    Returns:
        StepRecording: the frames of the step.
    Raises:
        ValueError: naming the argument, for a bad value.
    """
    choice("mode", mode, tuple(LOOPS))
    if not isinstance(model, GPT):
        raise ValueError(f"model must be a course_lib.model.gpt.GPT, got {type(model).__name__}")
    check_batch(model, inputs, targets)
    lr = number("lr", lr, above=0.0, maximum=10.0)
    b = positive_int("micro_batch_size", micro_batch_size)
    B = inputs.size(0)
    if B % b or B == b:
        raise ValueError(f"micro_batch_size must divide the batch of {B} into 2 or more, got {b}")
    K = B // b
    model = copy.deepcopy(model)
    groups = _parameter_groups(model)
    params = dict(model.named_parameters())
    full = dict(zip(params, torch.autograd.grad(model(inputs, targets)[1], list(params.values()))))
    reference = _norms(full, groups)
    before = {n: p.detach().clone() for n, p in params.items()}
    size = _norms(before, groups)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def grads():
        return tuple(g / r for g, r in zip(_norms({n: p.grad for n, p in params.items()}, groups),
                                            reference))

    def moved():
        now = _norms({n: p.detach() - before[n] for n, p in params.items()}, groups)
        return tuple(d / s for d, s in zip(now, size))

    zero = tuple(0.0 for _ in groups)
    no_k, inside = mode == "no / K (bug)", mode.startswith("zero_grad")
    frames = []
    optimizer.zero_grad()
    frames.append(_Frame((0,), "the loop starts: the batch is cut into K micro-batches" if inside
                        else "optimizer.zero_grad(): the gradient buffer starts empty",
                        None, 0, zero, zero))
    for k, (x, y) in enumerate(zip(inputs.split(b), targets.split(b))):
        lines = (1, 2) if not inside else (0, 1, 2)  # the loop's line and the forward's
        if inside:
            optimizer.zero_grad()
        _, loss = model(x, y)
        caption = (f"micro-batch {k + 1} of {K}: forward pass, loss {loss.item():.3f}"
                   + ("; zero_grad() has just emptied the buffer" if inside and k else ""))
        frames.append(_Frame(lines, caption, k, k, grads() if not inside else zero, moved()))
        (loss if no_k else loss / K).backward()
        share = "all of its gradient" if no_k else f"1/{K} of its gradient"
        frames.append(_Frame((3,), f"micro-batch {k + 1}: backward adds {share} to .grad",
                            k, k + 1, grads(), moved()))
    at_step = grads()
    optimizer.step()
    verdict = ("= the whole batch's gradient" if mode == "right" else
               f"= {K} x the whole batch's gradient" if no_k else
               "= the last micro-batch's share only")
    frames.append(_Frame((4,), f"optimizer.step(): the weights move once, with .grad {verdict}",
                        None, K, at_step, moved()))
    optimizer.zero_grad()
    frames.append(_Frame((5,), "optimizer.zero_grad(): the buffer is empty for the next step",
                        None, K, zero, moved()))
    return _StepRecording(mode, tuple(groups), K, b, tuple(frames))


def _code_html(mode: str, lines: tuple[int, ...]) -> str:
    """The loop as HTML: one line per row, never wrapped (a narrow page scrolls it sideways)."""
    rows = []
    for i, text in enumerate(LOOPS[mode]):
        style = "background:#ffe9a8;" if i in lines else ""
        if "BUG" in text:
            style += "color:#c0392b;font-weight:bold;"
        rows.append(f'<div style="{style}padding:0 6px">{html.escape(text) or "&nbsp;"}</div>')
    return ('<pre style="font-size:12px;line-height:1.5;margin:4px 0;border:1px solid #ddd;'
            'padding:4px 0;white-space:pre;overflow-x:auto;max-width:100%">'
            + "".join(rows) + "</pre>")


def step_through(recordings: dict[str, _StepRecording]) -> widgets.VBox:
    """The step-through widget of lecture 03: ``recordings`` frame by frame, the loop's current
    line highlighted; what ``optimizer.step()`` reads is printed from its frame on only.

    Args:
        recordings (dict): loop mode -> :func:`record_accumulation_step` of one batch, each with
            the same number of frames.
    Returns:
        ipywidgets.VBox: with ``view`` (the :func:`~course_lib.views.widgets.live_plot` box),
        ``play`` and ``code``.
    Raises:
        ValueError: for no recordings, an unknown mode, or recordings of different lengths.
    """
    if (not isinstance(recordings, dict) or not recordings
            or any(m not in LOOPS or not isinstance(r, _StepRecording)
                   for m, r in recordings.items())):
        raise ValueError(f"recordings must map modes of {list(LOOPS)} to recordings "
                         f"(record_accumulation_step), got {recordings!r:.80}")
    lengths = {len(r.frames) for r in recordings.values()}
    if len(lengths) != 1:
        raise ValueError(f"recordings must have the same number of frames, got {sorted(lengths)}")
    first = next(iter(recordings.values()))
    n, groups, K = lengths.pop(), first.groups, first.K
    frame = widgets.IntSlider(value=1, min=1, max=n, description="frame")
    mode = widgets.Dropdown(options=list(recordings), value=first.mode, description="loop")
    play = widgets.Play(value=1, min=1, max=n, interval=900, description="play")
    widgets.jslink((play, "value"), (frame, "value"))
    code = widgets.HTML(_code_html(first.mode, first.frames[0].lines))
    top = max(max(f.grad) for r in recordings.values() for f in r.frames)
    top_moved = max(max(f.moved) for r in recordings.values() for f in r.frames) or 1.0

    def setup(fig):
        grid = fig.add_gridspec(2, 2, height_ratios=[1, 5], width_ratios=[2.4, 1])
        fig.subplots_adjust(left=0.08, right=0.985, bottom=0.3, top=0.87, hspace=0.55,
                            wspace=0.25)
        strip, ax, wax = (fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]),
                          fig.add_subplot(grid[1, 1]))
        a = {"boxes": strip.bar(range(K), [1] * K, width=0.9, color="0.85")}
        strip.set(xlim=(-0.5, K - 0.5), ylim=(0, 1), yticks=[], xticks=range(K),
                  xticklabels=[f"micro-batch {k + 1}" for k in range(K)])
        strip.tick_params(length=0, labelsize=8.5)
        strip.set_title(f"the batch, split into K = {K} micro-batches", fontsize=9.5)
        x = range(len(groups))
        a["grad"] = ax.bar(x, [0] * len(groups), color="#4c72b0")
        # animated after the bars (a higher zorder), so that bars past 1 never hide them
        a["reference"] = ax.axhline(1, color="k", ls="--", lw=1, zorder=4)
        a["reference_label"] = ax.text(
            len(groups) - 0.5, 1.04, "the whole batch's gradient", ha="right", va="bottom",
            fontsize=8.5, zorder=5, bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none"))
        ax.set_ylabel("|.grad| / |whole batch's|", fontsize=8.5)
        a["moved"] = wax.bar(x, [0] * len(groups), color="#c44e52")
        for axes, height, rotation, title in (
                (ax, 1.15 * max(top, 1.0), 25, ".grad: the gradient buffer, per parameter group"),
                (wax, 1.2 * top_moved, 40, "the weights: |w - w0| / |w0|")):
            axes.set(ylim=(0, height), xticks=x)
            axes.set_xticklabels(groups, rotation=rotation, ha="right", fontsize=8)
            axes.tick_params(axis="y", labelsize=8)
            axes.set_title(title, fontsize=9.5)
        a["unmoved"] = wax.text(0.5, 0.5, "", ha="center", va="center", fontsize=8.5,
                                transform=wax.transAxes)
        a["caption"] = fig.text(0.5, 0.015, "", ha="center", fontsize=9)
        a["verdict"] = fig.text(0.5, 0.955, "", ha="center", fontsize=9.5)
        _animate(*a.values())
        return a

    def draw(a, frame, mode):
        rec = recordings[mode]
        f = rec.frames[frame - 1]
        code.value = _code_html(mode, f.lines)
        for k, box in enumerate(a["boxes"]):
            box.set_color("#dd8452" if k == f.micro_batch else "#55a868" if k < f.done else "0.85")
        for bar, value in zip(a["grad"], f.grad):
            bar.set_height(value)
        for bar, value in zip(a["moved"], f.moved):
            bar.set_height(value)
        a["unmoved"].set_text("" if max(f.moved) else "0 in every group:\nevery micro-batch "
                              "so far\nruns on the same weights")
        a["caption"].set_text(f"frame {frame}/{len(rec.frames)}: {f.caption}")
        stepped = len(rec.frames) - 1  # the frame of optimizer.step()
        end = rec.frames[stepped - 1].grad  # .grad as optimizer.step() used it
        a["verdict"].set_text(
            f"at optimizer.step(): |.grad| / |whole batch's| = {min(end):.2f} to {max(end):.2f}"
            if frame >= stepped else
            f"optimizer.step() reads .grad at frame {stepped}: where will the bars be then?")

    view = live_plot(draw, {"frame": frame, "mode": mode}, setup=setup, figsize=(8.2, 4.0))
    box = widgets.VBox([widgets.HBox([play, *view.children[0].children]), code, view.image,
                        view.output])
    box.view, box.play, box.code = view, play, code
    return box


def playground_view(playground: Playground, *, sizes: tuple = (1, 2, 4, 8, 16),
                    steps: tuple = (1, 2, 4, 8), micro_batch_size: int = 8,
                    accumulation_steps: int = 4, mode: str | None = None
                    ) -> widgets.VBox:
    """The playground widget of lecture 03: each run's loss against the samples seen (the toy
    language's floor ln 2) and one step's peak memory, predicted and measured; "train this
    setting" runs :meth:`Playground.run`.

    Args:
        playground (Playground): the runs' back end (its cache is what the view shows).
        sizes, steps (tuple of int): the values the sliders offer (ascending positive ints).
        micro_batch_size, accumulation_steps (int): the sliders' first values.
        mode (str, optional): None: no checkbox; ``"none"`` or ``"blocks"``: unticked, ticked.
    Returns:
        ipywidgets.VBox: with ``view``, ``button``, ``status`` and ``train()``.
    Raises:
        ValueError: naming the argument, for a bad value.
    """
    if not isinstance(playground, Playground):
        raise ValueError(f"playground must be a course_lib.views.playground.Playground, got "
                         f"{type(playground).__name__}")
    wide = {"style": {"description_width": "initial"}}
    controls = {}
    for name, options, first_name, first, label in (
            ("sizes", sizes, "micro_batch_size", micro_batch_size, "micro-batch b"),
            ("steps", steps, "accumulation_steps", accumulation_steps, "accumulation steps K")):
        if not (isinstance(options, tuple | list) and 1 <= len(options) <= 16
                and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_BATCH
                        for v in options) and list(options) == sorted(set(options))):
            raise ValueError(f"{name} must be 1 to 16 ascending ints from 1 to {MAX_BATCH:,}, "
                             f"got {options!r:.80}")
        value = positive_int(first_name, first, maximum=MAX_BATCH)
        if value not in options:
            raise ValueError(f"{first_name} must be one of {name} {list(options)}, "
                             f"got {first!r}")
        controls[first_name] = widgets.SelectionSlider(options=list(options), value=value,
                                                       description=label, **wide)
    if mode is not None:
        choice("mode", mode, PLAYGROUND_MODES)
        controls["every_block"] = widgets.Checkbox(value=mode == "blocks",
                                                   description="checkpoint every block", **wide)
    modes = PLAYGROUND_MODES if mode is not None else ("none",)
    top = max(playground.predict_peak(b, K, m) for b in sizes for K in steps for m in modes)
    unit, unit_name = _byte_unit(top)

    def setup(fig):
        ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.3, 1]})
        fig.subplots_adjust(left=0.07, right=0.985, bottom=0.15, top=0.86, wspace=0.3)
        a = {"others": ax1.add_collection(LineCollection([], colors="0.8", lw=1)),
             "run": ax1.plot([], [], ".-", color="C0", label="this setting")[0],
             "missing": ax1.text(0.5, 0.5, "", ha="center", transform=ax1.transAxes,
                                 fontsize=9),
             "title": ax1.set_title("", fontsize=10), "mode": ax2.set_title("", fontsize=10)}
        ax1.axhline(markov_entropy(), color="C2", ls=":", lw=1.5, label="best possible: ln 2")
        ax1.plot([], [], color="0.8", lw=1, label="other runs")
        # lower left, above the floor line: where no loss curve passes (they start near ln 64)
        ax1.legend(loc="lower left", bbox_to_anchor=(0, 0.17), fontsize=8.5)
        ax1.set(xlim=(0, playground.samples * 1.02), ylim=(0, 4.5))
        ax1.set_xlabel("samples seen", fontsize=9)
        ax1.set_ylabel("training loss", fontsize=9)
        a["bars"] = ax2.bar(["predicted", "measured"], [0, 0], color=["C1", "C0"])
        a["labels"] = [ax2.text(i, 0, "", ha="center", va="bottom", fontsize=8.5) for i in (0, 1)]
        ax2.set_ylim(0, 1.3 * top / unit)
        ax2.set_ylabel(f"peak memory of a step ({unit_name})", fontsize=9)
        for ax in (ax1, ax2):
            ax.tick_params(labelsize=8.5)
        _animate(*a.values())
        return a

    def draw(a, micro_batch_size, accumulation_steps, every_block=False):
        b, K, mode = micro_batch_size, accumulation_steps, "blocks" if every_block else "none"
        run = playground.cached(b, K, mode)
        predicted = playground.predict_peak(b, K, mode)
        a["others"].set_segments([list(zip(r.samples_seen, r.losses))
                                  for r in playground.cache.values()])
        a["run"].set_data(run.samples_seen if run else [], run.losses if run else [])
        a["missing"].set_text("" if run else "not trained yet: press 'train this setting'")
        a["title"].set_text(f"b = {b}, K = {K}: effective batch {b * K}, "
                            f"{playground.samples // (b * K)} optimizer steps")
        measured = run.measured_peak if run else 0
        for bar, label, value in zip(a["bars"], a["labels"], (predicted, measured)):
            bar.set_height(value / unit)
            label.set_position((label.get_position()[0], value / unit))
            label.set_text(format_bytes(value) if value else "?")
        a["mode"].set_text("checkpointing every block" if every_block else "one step's memory")

    view = live_plot(draw, controls, setup=setup, figsize=(8.6, 3.5))
    button = widgets.Button(description="train this setting", layout=widgets.Layout(width="auto"))
    status = widgets.Label()

    def train(_=None) -> None:
        try:  # a button must show a message, never a traceback
            values = chosen_values(controls)
            b, K = values["micro_batch_size"], values["accumulation_steps"]
            steps_total = playground.samples // (b * K)
            start = time.perf_counter()

            def progress(step, loss):  # live: the label follows the run step by step
                status.value = f"step {step}/{steps_total}: loss {loss:.3f}"

            playground.run(b, K, "blocks" if values.get("every_block") else "none",
                           on_step=progress)
            status.value += f" (trained in {_format_duration(time.perf_counter() - start)})"
        except Exception as exc:
            status.value = f"⚠ {exc}" if isinstance(exc, ValueError) else \
                f"⚠ {type(exc).__name__}: {exc}"
            return
        view.redraw()

    button.on_click(train)
    box = widgets.VBox([view, widgets.HBox([button, status])])
    box.view, box.button, box.status, box.train = view, button, status, train
    return box
