"""03: two views of one optimizer step with gradient accumulation.

* :func:`tradeoff_explorer`: the step's cost at a glance. Micro-batch ``b``,
  accumulation steps ``K`` and checkpointing set two pairs of bars, **peak memory**
  and **time per optimizer step**, each against the plain step (one batch of
  ``b K``, no checkpointing), for a model and a GPU preset or this kernel's device:
  :func:`course_lib.playground.optimizer_step_cost` predicts both, and a button
  measures the setting on this device (:func:`course_lib.playground.measure_step_cost`).
* :func:`step_through`: one optimizer step of ``K`` micro-batches, frame by frame (an
  ``ipywidgets.Play`` and a slider), with the training loop beside it and its current
  line highlighted: the gradient buffer fills micro-batch by micro-batch (the real
  gradient norms of a recorded run, :func:`record_accumulation_step`), the weights move
  only at ``optimizer.step()``, ``zero_grad`` empties the buffer. Two wrong loops show
  where their gradient goes wrong.

Both draw with :func:`course_lib.widgets.live_plot`'s ``setup``/``draw`` pair: the axes,
bars and texts are made once, and a change only sets their heights and texts.
"""

from __future__ import annotations

import copy
import html
import math
import time
from dataclasses import dataclass

import ipywidgets as widgets
import torch

from .device import GPUS, resolve_gpu
from .memory import mixed_precision_for
from .models import GPTConfig, check_config
from .playground import (
    DeviceSpeed,
    MeasuredStep,
    StepCost,
    measure_step_cost,
    optimizer_step_cost,
    step_ops,
)
from .units import format_bytes
from .validation import positive_int
from .widgets import live_plot

# --------------------------------------------------------------------------- the trade-off

#: The checkpointing choices the explorer offers: label -> mode of course_lib.checkpointing.
CHECKPOINT_CHOICES = {"none": "none", "every block": "blocks", "selective": "selective"}
#: Longest a measurement may be predicted to take on this device before the button declines.
MEASURE_LIMIT_SECONDS = 20.0
_PARTS = (("compute", "compute_seconds", "#4c72b0"), ("operators", "overhead_seconds", "#dd8452"),
          ("optimizer", "optimizer_seconds", "#8c8c8c"))


@dataclass(frozen=True)
class Tradeoff:
    """The explorer's numbers for one setting: this step, the plain step, and the card's memory.

    Attributes:
        step (StepCost): the setting's predicted cost.
        plain (StepCost): the same batch ``b K`` in one pass, no checkpointing.
        precision (str): the precision both use (``"mixed"`` resolved to the device's).
        capacity (int or None): bytes of the GPU (free bytes for a live card; None: the CPU, no
            line drawn).
    """

    step: StepCost
    plain: StepCost
    precision: str
    capacity: int | None


def tradeoff(config: GPTConfig, micro_batch_size: int, accumulation_steps: int, *,
             checkpointing: str = "none", precision: str = "fp32", gpu=None,
             speed: DeviceSpeed | None = None) -> Tradeoff:
    """This step and the plain one (a batch of ``b K`` in one pass, no checkpointing), predicted.

    Args:
        config (GPTConfig): the model.
        micro_batch_size (int): b, sequences per pass.
        accumulation_steps (int): K, micro-batches per optimizer step.
        checkpointing (str): one of :data:`course_lib.playground.CHECKPOINTING`.
        precision (str): "fp32" or "mixed" (the device's:
            :func:`course_lib.memory.mixed_precision_for`) or any of
            :data:`course_lib.engine.PRECISIONS`.
        gpu (str or GPU, optional): None (the CPU; then ``speed`` is required), or what
            :func:`course_lib.device.resolve_gpu` takes.
        speed (DeviceSpeed, optional): as :func:`course_lib.playground.optimizer_step_cost`.

    Returns:
        Tradeoff: both steps' costs and the card's capacity in bytes.

    Raises:
        ValueError: naming the argument, as :func:`course_lib.playground.optimizer_step_cost`.
    """
    card = resolve_gpu(gpu)
    resolved = mixed_precision_for(card) if precision == "mixed" else precision
    kw = dict(precision=resolved, gpu=card, speed=speed)
    step = optimizer_step_cost(config, micro_batch_size, accumulation_steps,
                               checkpointing=checkpointing, **kw)
    plain = optimizer_step_cost(config, micro_batch_size * accumulation_steps, 1, **kw)
    return Tradeoff(step, plain, resolved, None if card is None else
                    (card.free_memory if card.live else card.total_memory))


#: The y range of the two panels, in multiples of the plain step: fixed, so that only the bars
#: and numbers are redrawn (a bar above the range is cut, its number says how far it goes).
MEMORY_RANGE, TIME_RANGE = 1.6, 4.0


def _setup_tradeoff(fig, animated: bool = True) -> dict:
    mem, tim = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.14, top=0.76, wspace=0.22)
    a = {"mem": mem, "time": tim}
    a["mem_bars"] = mem.bar([0, 1], [1, 1], width=0.6, color=["0.75", "#55a868"])
    a["cap"] = mem.axhline(math.nan, color="k", ls="--", lw=1)
    a["cap_text"] = mem.text(1.45, 0, "", ha="right", va="bottom", fontsize=8)
    a["time_bars"] = [tim.bar([0, 1], [0, 0], width=0.6, color=color, label=label)
                      for label, _, color in _PARTS]
    a["mem_measured"], = mem.plot([1], [math.nan], "k_", ms=40, mew=2.5)
    a["time_measured"], = tim.plot([1], [math.nan], "k_", ms=40, mew=2.5, label="measured here")
    a["measured_labels"] = [ax.text(1.32, 0, "", ha="left", va="center", fontsize=7.5)
                            for ax in (mem, tim)]
    a["mem_labels"] = [mem.text(i, 0, "", ha="center", va="bottom", fontsize=8) for i in (0, 1)]
    a["time_labels"] = [tim.text(i, 0, "", ha="center", va="bottom", fontsize=8) for i in (0, 1)]
    for ax, top, what in ((mem, MEMORY_RANGE, "peak memory of the step"),
                          (tim, TIME_RANGE, "time per optimizer step")):
        ax.set(xlim=(-0.5, 1.5), ylim=(0, top), ylabel="x the plain step")
        ax.set_xticks([0, 1], ["the plain step:\none batch, no checkpointing", "this step"],
                      fontsize=8)
        ax.axhline(1, color="0.6", lw=0.8, zorder=0)
        ax.set_title(what, fontsize=10)
    tim.legend(loc="upper left", fontsize=7, ncol=2, frameon=False, markerscale=0.3)
    a["title"] = fig.text(0.5, 0.98, "", ha="center", va="top", fontsize=9.5)
    if animated:
        _animate(a, "mem_bars", "cap", "cap_text", "time_bars", "mem_measured", "time_measured",
                 "mem_labels", "time_labels", "measured_labels", "title")
    return a


def tradeoff_figure(t: Tradeoff, what: str, *, figsize: tuple = (9.5, 3.6)):
    """The explorer's picture of one setting as a static ``Figure`` (for a page or a file).

    Args:
        t (Tradeoff): what :func:`tradeoff` returned.
        what (str): the title, what the setting is.
        figsize (tuple): the figure's size in inches.

    Returns:
        matplotlib.figure.Figure: with an Agg canvas, not shown.

    Example::

        tradeoff_figure(tradeoff(...), "GPT-2 124M on an A100").savefig("tradeoff.png")
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    _draw_tradeoff(_setup_tradeoff(fig, animated=False), t, None, what)
    return fig


def _animate(artists: dict, *names: str) -> None:
    """Mark the artists a draw function changes: drawn over the still picture of the rest."""
    for name in names:
        items = artists[name]
        for item in items if isinstance(items, (list, tuple)) or hasattr(items, "patches") else [items]:
            for artist in getattr(item, "patches", [item]):
                artist.set_animated(True)


def _label(text, x: float, value: float, top: float, words: str) -> None:
    """A number over a bar; over the top of the panel, at its top with an arrow."""
    text.set_position((x, min(value, top * 0.9)))
    text.set_text(words + (" ↑" if value > top * 0.9 else ""))


def _draw_tradeoff(a: dict, t: Tradeoff, measured: MeasuredStep | None, what: str) -> None:
    step, plain = t.step, t.plain
    b, K = step.micro_batch_size, step.accumulation_steps
    checkpointing = "" if step.checkpointing == "none" else f", checkpointing {step.checkpointing}"
    a["title"].set_text(f"{what}\neffective batch {b} x {K} = {step.effective_batch} sequences: "
                        f"{K} micro-batch{'es' if K > 1 else ''} of {b}{checkpointing}, "
                        f"against one batch of {step.effective_batch}")
    mem_ratio = step.peak_bytes / plain.peak_bytes
    a["mem_bars"][1].set_height(mem_ratio)
    for i, n in enumerate((plain.peak_bytes, step.peak_bytes)):
        _label(a["mem_labels"][i], i, n / plain.peak_bytes, MEMORY_RANGE,
               format_bytes(n) + ("" if i == 0 else f" (x{mem_ratio:.2f})"))
    if t.capacity is not None and t.capacity / plain.peak_bytes < MEMORY_RANGE:
        a["cap"].set_ydata([t.capacity / plain.peak_bytes] * 2)
        a["cap_text"].set_position((1.45, t.capacity / plain.peak_bytes))
        a["cap_text"].set_text(f"the GPU: {format_bytes(t.capacity)}")
    else:
        a["cap"].set_ydata([math.nan] * 2)
        a["cap_text"].set_text("" if t.capacity is None else
                               f"the GPU: {format_bytes(t.capacity)}, above")
        a["cap_text"].set_position((1.45, MEMORY_RANGE * 0.93))
    bottom = [0.0, 0.0]
    for bars, (_, field, _) in zip(a["time_bars"], _PARTS):
        for i, (bar, cost) in enumerate(zip(bars, (plain, step))):
            height = getattr(cost, field) / plain.seconds
            bar.set_y(bottom[i])
            bar.set_height(height)
            bottom[i] += height
    for i, cost in enumerate((plain, step)):
        ratio = cost.seconds / plain.seconds
        _label(a["time_labels"][i], i, ratio, TIME_RANGE,
               _duration(cost.seconds) + ("" if i == 0 else f" (x{ratio:.2f})"))
    heights = ((measured.peak_bytes / plain.peak_bytes, MEMORY_RANGE, format_bytes(measured.peak_bytes)),
               (measured.seconds / plain.seconds, TIME_RANGE, _duration(measured.seconds))
               ) if measured else ((math.nan, 1, ""), (math.nan, 1, ""))
    for marker, label, (ratio, top, words) in zip((a["mem_measured"], a["time_measured"]),
                                                  a["measured_labels"], heights):
        marker.set_ydata([min(ratio, top * 0.97)])
        label.set_position((1.32, min(ratio, top * 0.97) if measured else 0))
        label.set_text(f"{words}\nmeasured" if measured else "")


def _duration(seconds: float) -> str:
    return f"{seconds:,.3g} s" if seconds >= 1 else f"{seconds * 1e3:,.3g} ms"


def tradeoff_explorer(models: dict[str, GPTConfig], *, speed: DeviceSpeed,
                      device: torch.device | str = "cpu", model: str | None = None,
                      gpu: str | None = None) -> widgets.VBox:
    """The one-glance trade-off widget of lecture 03 (see the module doc).

    Args:
        models (dict): the model menu, name -> config (the first runs on this device).
        speed (DeviceSpeed): this device's measured speed
            (:func:`course_lib.playground.measure_device_speed`).
        device (torch.device or str): this kernel's device: "this device" in the GPU menu, and where
            the button measures.
        model, gpu: the menus' first values (default: the first model, "this device").

    Returns:
        A ``VBox`` with ``view`` (the :func:`course_lib.widgets.live_plot` box), ``button``,
        ``status`` (an ``Output``), ``measured`` (setting -> :class:`MeasuredStep`) and
        ``measure()`` (what the button does).

    Raises:
        ValueError: for an empty ``models`` or one that maps a name to anything but a
            ``GPTConfig``, or ``model``/``gpu`` not among the choices.
    """
    if not isinstance(models, dict) or not models:
        raise ValueError(f"models must map at least one name to a GPTConfig, got {models!r:.80}")
    for name, config in models.items():
        check_config(config, f"models[{name!r}]")
    device = torch.device(device)
    here = f"this device ({speed.name})"
    targets = {here: "cuda" if device.type == "cuda" else None, **{n: n for n in GPUS}}
    model = next(iter(models)) if model is None else model
    gpu = here if gpu is None else gpu
    if model not in models:
        raise ValueError(f"model must be one of {list(models)}, got {model!r}")
    if gpu not in targets:
        raise ValueError(f"gpu must be one of {list(targets)}, got {gpu!r}")
    sizes = [1, 2, 4, 8, 16, 32, 64]
    controls = {
        "model": widgets.Dropdown(options=list(models), value=model, description="model"),
        "gpu": widgets.Dropdown(options=list(targets), value=gpu, description="GPU"),
        "precision": widgets.Dropdown(options=[("fp32", "fp32"), ("16-bit mixed", "mixed")],
                                      value="fp32", description="precision"),
        "micro_batch_size": widgets.SelectionSlider(options=sizes, value=4,
                                                    description="micro-batch"),
        "accumulation_steps": widgets.SelectionSlider(options=sizes, value=4,
                                                      description="accum. steps"),
        "checkpointing": widgets.ToggleButtons(options=list(CHECKPOINT_CHOICES), value="none",
                                               description="checkpointing"),
    }
    measured: dict[tuple, MeasuredStep] = {}
    for config in models.values():  # count the operators of every choice now, not on a change
        for mode in CHECKPOINT_CHOICES.values():
            for precision in ("fp32", "fp16-mixed", "bf16-mixed"):
                step_ops(config, mode, precision)

    def settings(values: dict) -> tuple[Tradeoff, tuple]:
        target = targets[values["gpu"]]
        t = tradeoff(models[values["model"]], values["micro_batch_size"],
                     values["accumulation_steps"],
                     checkpointing=CHECKPOINT_CHOICES[values["checkpointing"]],
                     precision=values["precision"], gpu=target,
                     speed=speed if values["gpu"] == here else None)
        key = (values["model"], t.precision, t.step.micro_batch_size,
               t.step.accumulation_steps, t.step.checkpointing)
        return t, key

    def draw(artists, model, gpu, precision, micro_batch_size, accumulation_steps,
             checkpointing):
        values = dict(model=model, gpu=gpu, precision=precision,
                      micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
                      checkpointing=checkpointing)
        t, key = settings(values)
        _draw_tradeoff(artists, t, measured.get(key) if gpu == here else None,
                       f"{model}, {t.precision}, on {gpu}")

    view = live_plot(draw, controls, setup=_setup_tradeoff, figsize=(9.5, 3.6))
    button = widgets.Button(description="measure on this device", icon="stopwatch")
    status = widgets.Output()

    def measure(_=None) -> None:
        controls["gpu"].value = here  # what is measured here is compared with this device
        values = {name: c.value for name, c in controls.items()}
        t, key = settings(values)
        status.clear_output()
        with status:
            need = 8 * t.step.seconds  # two steps for memory (under the tracker), four timed
            if need > MEASURE_LIMIT_SECONDS:
                print(f"not measured: {values['model']} would take about {need:.0f} s here "
                      f"(predicted {t.step.seconds:.1f} s per step); choose a smaller model")
                return
            start = time.perf_counter()
            measured[key] = measure_step_cost(
                models[values["model"]], t.step.micro_batch_size, t.step.accumulation_steps,
                checkpointing=t.step.checkpointing, precision=t.precision, device=device)
            m = measured[key]
            print(f"measured on {device}: peak {format_bytes(m.peak_bytes)} (predicted "
                  f"{format_bytes(t.step.peak_bytes)}), {m.seconds * 1e3:,.1f} ms per step "
                  f"(predicted {t.step.seconds * 1e3:,.1f} ms), in "
                  f"{time.perf_counter() - start:.1f} s")
        view.redraw()

    button.on_click(measure)
    box = widgets.VBox([view, widgets.HBox([button, status])])
    box.view, box.button, box.status, box.measured, box.measure = (view, button, status,
                                                                   measured, measure)
    return box


# --------------------------------------------------------------------------- the step-through

#: The loops the step-through shows: mode -> lines of code. Frame lines refer to their roles.
LOOPS = {
    "right": ["optimizer.zero_grad()",
              "for x, y in batch.split(micro_batch_size):  # K micro-batches",
              "    loss = model(x, y)                      # forward",
              "    (loss / K).backward()                   # .grad += gradient / K",
              "optimizer.step()                            # the weights move, once",
              "optimizer.zero_grad()                       # empty the buffer"],
    "no / K (bug)": ["optimizer.zero_grad()",
                     "for x, y in batch.split(micro_batch_size):",
                     "    loss = model(x, y)",
                     "    loss.backward()                         # BUG: not divided by K",
                     "optimizer.step()",
                     "optimizer.zero_grad()"],
    "zero_grad in the loop (bug)": ["for x, y in batch.split(micro_batch_size):",
                                    "    optimizer.zero_grad()                   # BUG: empties the buffer",
                                    "    loss = model(x, y)",
                                    "    (loss / K).backward()",
                                    "optimizer.step()",
                                    "optimizer.zero_grad()"],
}
_WRONG_LINE = {"right": None, "no / K (bug)": 3, "zero_grad in the loop (bug)": 1}


@dataclass(frozen=True)
class Frame:
    """One moment of the step: the code lines running, and the state they leave.

    Attributes:
        lines (tuple of int): indices into the loop's code (:data:`LOOPS`).
        caption (str): what happens, in words.
        micro_batch (int or None): the micro-batch running (0-based), None outside the loop.
        done (int): micro-batches whose backward has run.
        grad (tuple of float): per group: ``||.grad|| / ||full-batch gradient||``.
        moved (tuple of float): per group: ``||w - w_before|| / ||w_before||``.
    """

    lines: tuple[int, ...]
    caption: str
    micro_batch: int | None
    done: int
    grad: tuple[float, ...]
    moved: tuple[float, ...]


@dataclass(frozen=True)
class StepRecording:
    """A recorded optimizer step of ``K`` micro-batches, as frames (one loop ``mode``).

    Attributes:
        mode (str): the loop, a key of :data:`LOOPS`.
        groups (tuple of str): the parameter groups (:func:`parameter_groups`).
        K (int): micro-batches.
        micro_batch_size (int): sequences per micro-batch.
        frames (tuple of Frame): the moments, in order.
    """

    mode: str
    groups: tuple[str, ...]
    K: int
    micro_batch_size: int
    frames: tuple[Frame, ...]


def parameter_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """Group name -> parameter names, for the step-through's bars.

    The embeddings, each block's attention and MLP, and the LayerNorms (all of them, one
    group).

    Args:
        model (torch.nn.Module): a course GPT (names as ``GPT.named_parameters()``).

    Returns:
        dict: group name -> list of parameter names, embeddings first, LayerNorms last.
    """
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
                             lr: float = 1e-2) -> StepRecording:
    """Run and record one AdamW step of ``K = B / micro_batch_size`` micro-batches.

    It runs on a copy of ``model`` with the loop ``mode`` of :data:`LOOPS`, recording
    ``.grad`` after every line.

    Each group's gradient norm is divided by that group's norm of the whole batch's gradient
    (one forward and backward pass over ``inputs``), so a right loop ends at 1 in every
    group; the weights' change is relative to their norm before the step. ``model`` itself is
    not changed.

    Args:
        model (torch.nn.Module): ``model(x, y)`` must return ``(logits, loss)`` with the loss a
            mean, as the course GPT does.
        inputs (torch.Tensor): ``(B, T)`` token ids.
        targets (torch.Tensor): ``(B, T)`` targets.
        micro_batch_size (int): must divide ``B`` into 2 or more micro-batches.
        mode (str): a key of :data:`LOOPS`.
        lr (float): AdamW's learning rate.

    Returns:
        StepRecording: the frames of the step.

    Raises:
        ValueError: for an unknown ``mode`` or a ``micro_batch_size`` that does not divide
            the batch into 2 or more.
    """
    if mode not in LOOPS:
        raise ValueError(f"mode must be one of {list(LOOPS)}, got {mode!r}")
    b = positive_int("micro_batch_size", micro_batch_size)
    B = inputs.size(0)
    if B % b or B == b:
        raise ValueError(f"micro_batch_size must divide the batch of {B} into 2 or more, got {b}")
    K = B // b
    model = copy.deepcopy(model)
    groups = parameter_groups(model)
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
    right, no_k, inside = mode == "right", mode == "no / K (bug)", mode.startswith("zero_grad")
    frames = []
    optimizer.zero_grad()
    frames.append(Frame((0,), "the loop starts: the batch is cut into K micro-batches" if inside
                        else "optimizer.zero_grad(): the gradient buffer starts empty",
                        None, 0, zero, zero))
    forward, backward = (2, 3)
    for k, (x, y) in enumerate(zip(inputs.split(b), targets.split(b))):
        lines = (1, forward) if not inside else (0, 1, forward)
        if inside:
            optimizer.zero_grad()
        _, loss = model(x, y)
        caption = (f"micro-batch {k + 1} of {K}: forward pass, loss {loss.item():.3f}"
                   + ("; zero_grad() has just emptied the buffer" if inside and k else ""))
        frames.append(Frame(lines, caption, k, k, grads() if not inside else zero, moved()))
        (loss if no_k else loss / K).backward()
        share = "all of its gradient" if no_k else f"1/{K} of its gradient"
        frames.append(Frame((backward,), f"micro-batch {k + 1}: backward adds {share} to .grad",
                            k, k + 1, grads(), moved()))
    at_step = grads()
    optimizer.step()
    verdict = ("= the whole batch's gradient" if right else
               f"= {K} x the whole batch's gradient" if no_k else
               "= the last micro-batch's share only")
    frames.append(Frame((4,), f"optimizer.step(): the weights move once, with .grad {verdict}",
                        None, K, at_step, moved()))
    optimizer.zero_grad()
    frames.append(Frame((5,), "optimizer.zero_grad(): the buffer is empty for the next step",
                        None, K, zero, moved()))
    return StepRecording(mode, tuple(groups), K, b, tuple(frames))


def _code_html(mode: str, lines: tuple[int, ...]) -> str:
    rows = []
    for i, text in enumerate(LOOPS[mode]):
        style = "background:#ffe9a8;" if i in lines else ""
        if i == _WRONG_LINE[mode]:
            style += "color:#c0392b;font-weight:bold;"
        rows.append(f'<div style="{style}padding:0 4px">{html.escape(text) or "&nbsp;"}</div>')
    return ('<pre style="font-size:11px;line-height:1.6;margin:40px 6px 0 0;border:1px solid #ddd;'
            'padding:6px">' + "".join(rows) + "</pre>")


def step_through(recordings: dict[str, StepRecording], *, interval_ms: int = 900) -> widgets.VBox:
    """The step-through widget of lecture 03 (see the module doc).

    Args:
        recordings (dict): loop mode -> :func:`record_accumulation_step` of the same batch, each
            with the same number of frames (the modes of :data:`LOOPS`).
        interval_ms (int): the Play widget's time per frame.

    Returns:
        A ``VBox``: a Play button and a frame slider (linked in the browser), the loop menu,
        then the code with its current line highlighted beside the figure; with ``view`` (the
        :func:`course_lib.widgets.live_plot` box), ``play`` and ``code`` attributes.

    Raises:
        ValueError: for no recordings, an unknown mode, or recordings of different lengths.
    """
    if not recordings or any(m not in LOOPS for m in recordings):
        raise ValueError(f"recordings must map modes of {list(LOOPS)} to recordings")
    lengths = {len(r.frames) for r in recordings.values()}
    if len(lengths) != 1:
        raise ValueError(f"recordings must have the same number of frames, got {sorted(lengths)}")
    first = next(iter(recordings.values()))
    n, groups, K = lengths.pop(), first.groups, first.K
    frame = widgets.IntSlider(value=0, min=0, max=n - 1, description="frame")
    mode = widgets.Dropdown(options=list(recordings), value=first.mode, description="loop")
    play = widgets.Play(value=0, min=0, max=n - 1, interval=interval_ms, description="play")
    widgets.jslink((play, "value"), (frame, "value"))
    code = widgets.HTML(_code_html(first.mode, first.frames[0].lines))
    top = max(max(f.grad) for r in recordings.values() for f in r.frames)
    top_moved = max(max(f.moved) for r in recordings.values() for f in r.frames) or 1.0

    def setup(fig):
        grid = fig.add_gridspec(2, 2, height_ratios=[1, 5], width_ratios=[3, 1.3])
        fig.subplots_adjust(left=0.07, right=0.98, bottom=0.26, top=0.88, hspace=0.5, wspace=0.3)
        strip, ax, wax = (fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]),
                          fig.add_subplot(grid[1, 1]))
        a = {"boxes": strip.bar(range(K), [1] * K, width=0.9, color="0.85")}
        strip.set(xlim=(-0.5, K - 0.5), ylim=(0, 1), yticks=[], xticks=range(K),
                  xticklabels=[f"micro-batch {k + 1}" for k in range(K)])
        strip.tick_params(length=0, labelsize=8)
        strip.set_title(f"the batch, split into K = {K} micro-batches", fontsize=9)
        x = range(len(groups))
        a["grad"] = ax.bar(x, [0] * len(groups), color="#4c72b0")
        ax.axhline(1, color="k", ls="--", lw=1)
        ax.text(len(groups) - 0.5, 1, "the whole batch's gradient", ha="right", va="bottom",
                fontsize=7)
        ax.set(ylim=(0, 1.15 * max(top, 1.0)), xticks=x)
        ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("|.grad| / |whole batch's|", fontsize=8)
        ax.set_title(".grad: the gradient buffer, per parameter group", fontsize=9)
        a["moved"] = wax.bar(x, [0] * len(groups), color="#c44e52")
        wax.set(ylim=(0, 1.2 * top_moved), xticks=x)
        wax.set_xticklabels(groups, rotation=45, ha="right", fontsize=6)
        wax.set_title("the weights: |w - w0| / |w0|", fontsize=9)
        a["caption"] = fig.text(0.5, 0.02, "", ha="center", fontsize=8.5)
        a["verdict"] = fig.text(0.5, 0.95, "", ha="center", fontsize=9)
        _animate(a, "boxes", "grad", "moved", "caption", "verdict")
        return a

    def draw(a, frame, mode):
        rec = recordings[mode]
        f = rec.frames[frame]
        code.value = _code_html(mode, f.lines)
        for k, box in enumerate(a["boxes"]):
            box.set_color("#dd8452" if k == f.micro_batch else "#55a868" if k < f.done else "0.85")
        for bar, value in zip(a["grad"], f.grad):
            bar.set_height(value)
        for bar, value in zip(a["moved"], f.moved):
            bar.set_height(value)
        a["caption"].set_text(f"frame {frame + 1}/{len(rec.frames)}: {f.caption}")
        end = rec.frames[-2].grad  # .grad as optimizer.step() used it
        a["verdict"].set_text(f"at optimizer.step(): |.grad| / |whole batch's| = "
                              f"{min(end):.2f} to {max(end):.2f}")

    view = live_plot(draw, {"frame": frame, "mode": mode}, setup=setup, figsize=(6.6, 4.4))
    controls_row = view.children[0]
    box = widgets.VBox([widgets.HBox([play, *controls_row.children]),
                        widgets.HBox([code, view.image]), view.output])
    box.view, box.play, box.code = view, play, code
    return box
