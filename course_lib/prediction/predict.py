"""02-08: ``predict(step)``: what one training step will hold, moment by moment, and how long it takes.

The memory engine (:mod:`course_lib.prediction.engine`) replays the step's precision,
accumulation, checkpointing and chunked loss; closed forms adjust each moment for the levers
of lecture 08; the time model (:mod:`course_lib.prediction.time_model`) prices it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from course_lib.model.gpt import BLOCK_SHAPES, GPTConfig, param_numels  # noqa: F401 (the examples use GPTConfig)
from course_lib.prediction import activations as act, engine, time_model
from course_lib.prediction.engine import StepMemory
from course_lib.prediction.formulas import zero3_memory
from course_lib.prediction.step import Step
from course_lib.prediction.time_model import DeviceSpeed
from course_lib.training import levers
from course_lib.units import dtype_bytes
from course_lib.validation import WrongTypeError


@dataclass(frozen=True, eq=False)
class Prediction:
    """What :func:`predict` says of a :class:`Step`: ``moments``, moment name ->
    :class:`~course_lib.prediction.engine.StepMemory` in the order the step reaches them
    ("forward" where attention peaks in it, "backward", "backward 2+", "optimizer"); ``speed``
    the figures :attr:`time` uses (None: the step's device's)."""

    step: Step
    moments: dict
    speed: DeviceSpeed | None = None

    @property
    def peak(self) -> StepMemory:
        """The moment with the most bytes: the step's peak, by category."""
        return max(self.moments.values(), key=lambda m: m.total)

    @property
    def total(self) -> int:
        """The step's peak bytes: the number to hold against a card or a budget."""
        return self.peak.total

    @property
    def phases(self) -> dict[str, int]:
        """Bytes at each phase: ``"between steps"`` (the model states kept from step to step),
        then each moment's total."""
        between = next(iter(self.moments.values())).before_step
        return {"between steps": between, **{n: m.total for n, m in self.moments.items()}}

    @functools.cached_property
    def time(self):
        """The step's seconds by term (:func:`course_lib.prediction.time_model.step_time`)."""
        return time_model.step_time(self.step, self.speed)

    @property
    def seconds(self) -> float:
        """Seconds per optimizer step."""
        return self.time.seconds


def predict(step: Step, speed: DeviceSpeed | None = None) -> Prediction:
    """Predicted bytes, by moment and category, and time of one training step.

    ``speed`` (None: the step's GPU's datasheet, or this device measured) prices the time. On the
    CPU one micro-batch in fp32 or pure 16-bit is exact to the byte under every checkpointing
    mode and with accumulation; under autocast within 5 %.
    Args:
        step (Step): the training step to predict.
        speed (DeviceSpeed, optional): the device's speeds (None: as above).
    Returns:
        Prediction: the step's peak, its moments and phases, and its time.
    Example:
        >>> cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=2)
        >>> p = predict(Step(cfg, 4, precision="bf16-mixed", gpu="A100 80GB"))
        >>> p.peak.moment  # an A100 runs flash attention; its backward is where this step peaks
        'backward, micro-batch 1: fused attention backward (flash)'
        >>> list(p.phases), p.peak.optimizer_state == 2 * p.peak.master_weights
        (['between steps', 'backward', 'optimizer'], True)
        >>> p.time.basis
        'from the datasheet'
    """
    if not isinstance(step, Step):
        raise WrongTypeError(f"step must be a course_lib.prediction.step.Step, got "
                             f"{type(step).__name__}")
    if speed is not None and not isinstance(speed, DeviceSpeed):
        raise WrongTypeError(f"speed must be a DeviceSpeed or None, got {type(speed).__name__}")
    return Prediction(step, _lever_moments(step), speed)


def _lever_moments(step: Step) -> dict[str, StepMemory]:
    """The engine's moments adjusted for lecture 08's levers and ZeRO, each a closed form
    (Rajbhandari et al. 2020; FSDP2's gathered units: :func:`formulas.zero3_memory`)."""
    moments = engine.moments(step)
    if not (step.in_backward or step.lora_rank or step.state_bits != 32 or step.zero_stage
            or step.offload_activations or step.offload_optimizer):
        return moments  # the plain step: the engine's count as it is (a widget's common case)
    config, b, s = step.config, step.micro_batch_size, step.seq_len
    numels = param_numels(config)
    pb, _, mb, sb = step.spec.element_bytes  # params, grads, master weights, each state tensor
    if step.in_backward:
        largest = max(numels)
        opt = moments.pop("optimizer")
        for name in [n for n in moments if n.startswith("backward")]:
            moments[name] = replace(moments[name],
                                    gradients=min(moments[name].gradients, largest * pb))
        # the largest parameter's step (the tied embedding's comes last, after the activations)
        scratch = engine.adamw_scratch_bytes([largest * sb] * 2) + largest * mb
        moments["optimizer"] = replace(opt, moment="optimizer step in backward (largest tensor)",
                                       gradients=largest * pb, transient=scratch)
    r, h = step.lora_rank, config.d_model
    # with LoRA, A (r x in) and B (out x r) beside every block linear are trained
    trained = [n for _ in range(config.n_layers) for _, i, o in BLOCK_SHAPES
               for n in (r * i * h, o * h * r)] if r else numels
    trainable = sum(trained)
    state = (levers.low_bit_state_bytes(trained, step.state_bits, param_bytes=sb)
             if step.state_bits != 32 or r else None)  # None: the engine's count
    if step.offload_activations:  # on the device: what the op being differentiated needs
        resident_acts = max(act.total_bytes(items(config, b, s, step), act.STEP_KINDS, step.gpu)
                            for items in (act.block_items, act.head_items))
    N, z = step.world_size, step.zero_stage
    if z >= 3:  # the one model of ZeRO-3 / FSDP2, also lecture 07's
        gathered, sharded = (zero3_memory(config, precision=step.precision, world_size=N,
                                          during_step=during) for during in (True, False))
    out = {}
    for name, m in moments.items():
        f = m.as_dict()
        if r:  # frozen base in the model's dtype; adapters trained (gradients, state, masters)
            f["parameters"] = m.parameters + trainable * pb
            f["master_weights"] = trainable * mb
            f["gradients"] = min(m.gradients, trainable * pb)
            if m.activations:
                f["activations"] += 4 * config.n_layers * b * s * r * dtype_bytes(step.compute)
            if name == "optimizer":  # the adapters' AdamW scratch
                f["transient"] = engine.adamw_scratch_bytes([n * sb for n in trained])
        if state is not None and m.optimizer_state:
            f["optimizer_state"] = state
        if step.offload_activations:
            f["activations"] = min(m.activations, resident_acts)
        if step.offload_optimizer:
            f["optimizer_state"] = f["master_weights"] = 0
            if name == "optimizer":  # the step runs on the host
                f["transient"] = 0
        # ZeRO stage z >= 1 shards the first z + 1 of these, each to ceil(bytes / N)
        for key in ("optimizer_state", "master_weights", "gradients", "parameters")[:z and z + 1]:
            f[key] = -(-f[key] // N)
        if z >= 3 and name != "optimizer":  # plus the units FSDP2 gathers while passes run
            f["parameters"] += gathered.parameters - sharded.parameters
        if z >= 3 and name.startswith("backward"):
            f["gradients"] += gathered.gradients - sharded.gradients
        out[name] = StepMemory(m.moment, **f, first_step=m.first_step)
    return out


__all__ = ["Prediction", "predict"]
