"""08: the fit ladder: every lever of the course for one model and one GPU, ranked.

:class:`Plan` is one way to run a step (a setting per lever); :func:`predict_plan` predicts
its peak bytes (the memory engine for precision, accumulation, checkpointing and the
chunked loss; closed forms over the engine's moments for the levers of lecture 08) and
:func:`plan_seconds` its time (the course's one time model, :mod:`course_lib.prediction.time_model`, from
datasheet figures: a prediction, not a measurement);
:func:`ladder` ranks every lever alone by bytes saved per time paid, both against the plain
step, and adds them in that order until the step fits the GPU. The chart and the widget of
lecture 08 are :mod:`course_lib.views.ladder_view`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig, check_config, param_numels
from course_lib.planning.fit import FIT_POLICIES
from course_lib.prediction import activations as act, engine, time_model
from course_lib.prediction.engine import StepMemory
from course_lib.prediction.formulas import MAX_WORLD_SIZE, mixed_precision_for, zero3_memory
from course_lib.training import checkpointing as ckpt, levers
from course_lib.units import dtype_bytes, format_bytes
from course_lib.validation import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_COUNT,
    boolean,
    choice,
    integer,
    number,
    optional_positive_int,
    positive_int,
)

#: The levers of :func:`ladder`, by group: one setting per group is in force at a time.
LADDER_GROUPS = ("precision", "accumulation", "checkpointing", "chunked loss",
                 "optimizer in backward", "optimizer states", "offload activations",
                 "offload optimizer", "LoRA", "ZeRO")
#: Groups that change the job rather than how it runs: LoRA trains other parameters, ZeRO
#: needs more GPUs. The ladder tries them last.
JOB_CHANGING = ("LoRA", "ZeRO")


@dataclass(frozen=True)
class Plan:
    """One way to run a training step: a setting per lever (the defaults are the plain step).

    ``precision``, ``accumulation_steps``, ``mode``/``every`` and ``loss_chunk`` are the memory
    engine's; ``in_backward``, ``state_bits``, ``offload_activations``, ``offload_optimizer``,
    ``lora_rank`` and ``zero_stage`` over ``world_size`` GPUs adjust its moments with the
    closed forms of :func:`predict_plan`. Each field's comment says what it does and why one
    would change it.

    Raises:
        ValueError: naming the field: an unknown ``precision`` or ``mode``; a count that is not
            an int (not a bool) in range (``accumulation_steps`` up to
            :data:`course_lib.validation.MAX_BATCH`, ``world_size`` up to
            :data:`course_lib.prediction.formulas.MAX_WORLD_SIZE`, ``zero_stage`` 0 to 3); ``state_bits``
            not 32, 8 or 4; a switch that is not a bool.

    Example:
        >>> plan = Plan(precision="bf16-mixed", mode="blocks", state_bits=8)
        >>> plan.state_bits, plan.accumulation_steps, plan.zero_stage  # the rest as plain
        (8, 1, 0)
    """

    #: One of :data:`course_lib.prediction.engine.PRECISIONS`. ``"bf16-mixed"`` halves weights,
    #: gradients and activations but adds fp32 master weights: 16 bytes per parameter of
    #: model states, as fp32 AdamW, with half the activations; pure ``"bf16"`` 8.
    precision: str = "fp32"
    #: Micro-batches per optimizer step K (``batch_size`` must divide by it): activations
    #: shrink to one micro-batch's, at the cost of K smaller (less efficient) passes.
    accumulation_steps: int = 1
    #: Activation checkpointing mode (:data:`course_lib.training.checkpointing.MODES`): fewer kept
    #: activations, paid with recomputation in the backward pass.
    mode: str = "none"
    #: Checkpoint every ``every``-th block (``blocks``, ``selective``, ``attention`` modes):
    #: larger saves less memory and recomputes less.
    every: int = 1
    #: Tokens per chunk of the chunked loss (:func:`course_lib.training.levers.chunked_cross_entropy`),
    #: or None for the plain loss: the full ``N x V`` logits never exist at once; helps most
    #: with large vocabularies.
    loss_chunk: int | None = None
    #: Step each parameter in the backward pass as soon as its gradient is ready
    #: (:func:`course_lib.training.levers.optimizer_in_backward`): only one gradient lives at a time.
    #: Not with accumulation.
    in_backward: bool = False
    #: Bits per optimizer state value: 32, 8 or 4 (torchao's ``AdamW8bit``/``AdamW4bit``;
    #: :func:`course_lib.training.levers.low_bit_state_bytes`): AdamW's ``m`` and ``v`` shrink 4 or 8x.
    state_bits: int = 32
    #: Keep saved activations in host memory (``save_on_cpu``): the device holds about one
    #: block's at a time, paid with PCIe transfers.
    offload_activations: bool = False
    #: Keep optimizer states and master weights on the host and step there: removes them from
    #: the device, paid with transfers and a CPU step.
    offload_optimizer: bool = False
    #: Rank of LoRA adapters on every block linear, the rest frozen (None: full training):
    #: gradients and optimizer states only for the adapters. Changes what is trained.
    lora_rank: int | None = None
    #: ZeRO stage 0-3 over ``world_size`` GPUs: shards optimizer states (1), gradients (2)
    #: and parameters (3). Needs several GPUs.
    zero_stage: int = 0
    #: GPUs the ZeRO shards are divided over, from 1 to :data:`course_lib.prediction.formulas.MAX_WORLD_SIZE`.
    world_size: int = 1

    def __post_init__(self):
        engine.precision_of(self.precision)
        # the counts stored as ints, so that a numpy int cannot overflow in the sums further on
        object.__setattr__(self, "accumulation_steps", positive_int(
            "accumulation_steps", self.accumulation_steps, maximum=MAX_BATCH))
        choice("mode", self.mode, ckpt.MODES)
        object.__setattr__(self, "every", positive_int("every", self.every, maximum=MAX_COUNT))
        object.__setattr__(self, "loss_chunk", optional_positive_int(
            "loss_chunk", self.loss_chunk, maximum=MAX_COUNT))
        for name in ("in_backward", "offload_activations", "offload_optimizer"):
            boolean(name, getattr(self, name))
        if isinstance(self.state_bits, bool) or self.state_bits not in (32, 8, 4) or not isinstance(
                self.state_bits, int):
            raise ValueError(f"state_bits must be one of (32, 8, 4), got {self.state_bits!r}")
        object.__setattr__(self, "lora_rank", optional_positive_int(
            "lora_rank", self.lora_rank, maximum=MAX_COUNT))
        object.__setattr__(self, "zero_stage", integer("zero_stage", self.zero_stage, minimum=0,
                                                       maximum=3))
        object.__setattr__(self, "world_size", positive_int("world_size", self.world_size,
                                                            maximum=MAX_WORLD_SIZE))


def _plan_moments(config: GPTConfig, batch_size: int, plan: Plan, gpu, seq_len: int
                  ) -> list[StepMemory]:

    K = plan.accumulation_steps
    if batch_size % K:
        raise ValueError(f"accumulation_steps must divide batch_size={batch_size}, got {K}")
    b = batch_size // K
    spec = engine.precision_of(plan.precision)
    moments = dict(engine.predict_moments(
        config, b, K, precision=plan.precision, mode=plan.mode, every=plan.every,
        seq_len=seq_len, gpu=gpu, loss_chunk=plan.loss_chunk))
    numels = param_numels(config)
    pb, _, mb, sb = spec.element_bytes  # params, grads, master weights, each state tensor
    if plan.in_backward:  # no moment holds every gradient: one parameter's at a time
        largest = max(numels)
        opt = moments.pop("optimizer")
        for name in [n for n in moments if n.startswith("backward")]:
            moments[name] = replace(moments[name],
                                    gradients=min(moments[name].gradients, largest * pb))
        # the largest parameter's step (the tied embedding's comes last, after the activations)
        scratch = engine.adamw_scratch_bytes([largest * sb] * 2) + largest * mb
        moments["optimizer"] = replace(opt, moment="optimizer step in backward (largest tensor)",
                                       gradients=largest * pb, transient=scratch)
    if plan.lora_rank:  # A (r x in) and B (out x r) beside every block linear
        r, h = plan.lora_rank, config.d_model
        trained = [n for _ in range(config.n_layers) for i, o in ((1, 3), (1, 1), (1, 4), (4, 1))
                   for n in (r * i * h, o * h * r)]
    else:
        trained = numels
    trainable = sum(trained)
    state = (levers.low_bit_state_bytes(trained, plan.state_bits, param_bytes=sb)
             if plan.state_bits != 32 or plan.lora_rank else None)  # None: the engine's count
    resident_acts = None
    if plan.offload_activations:  # on the device: what the op being differentiated needs
        b_, s_, t = act.prediction_args(config, b, seq_len, spec.compute, gpu, spec.autocast)
        resident_acts = max(act.total_bytes(act.block_items(config, b_, s_, t), act.STEP_KINDS,
                                            t.gpu),
                            act.total_bytes(act.head_items(config, b_, s_, t), act.STEP_KINDS,
                                            t.gpu))
    N, z = plan.world_size, plan.zero_stage
    if z >= 3:  # the one model of ZeRO-3 / FSDP2, also lecture 07's
        gathered, sharded = (zero3_memory(config, precision=plan.precision, world_size=N,
                                          during_step=during) for during in (True, False))
    out = []
    for name, m in moments.items():
        fields_ = dict(parameters=m.parameters, master_weights=m.master_weights,
                       optimizer_state=m.optimizer_state, gradients=m.gradients,
                       activations=m.activations, transient=m.transient)
        if plan.lora_rank:
            # frozen base in the model's dtype; adapters trained (gradients, state, masters)
            fields_["parameters"] = m.parameters + trainable * pb
            fields_["master_weights"] = trainable * mb
            fields_["gradients"] = min(m.gradients, trainable * pb)
            fields_["activations"] = m.activations + (
                4 * config.n_layers * b * seq_len * plan.lora_rank * dtype_bytes(spec.compute)
                if m.activations else 0)
            if name == "optimizer":  # the adapters' AdamW scratch
                fields_["transient"] = engine.adamw_scratch_bytes([n * sb for n in trained])
        if state is not None and m.optimizer_state:
            fields_["optimizer_state"] = state
        if resident_acts is not None:
            fields_["activations"] = min(m.activations, resident_acts)
        if plan.offload_optimizer:
            fields_["optimizer_state"] = fields_["master_weights"] = 0
            if name == "optimizer":  # the step runs on the host
                fields_["transient"] = 0
        if z >= 1:
            fields_["optimizer_state"] = -(-fields_["optimizer_state"] // N)
            fields_["master_weights"] = -(-fields_["master_weights"] // N)
        if z >= 2:
            fields_["gradients"] = -(-fields_["gradients"] // N)
        if z >= 3:  # sharded, plus the units FSDP2 gathers while the passes run
            fields_["parameters"] = -(-fields_["parameters"] // N)
            if name != "optimizer":
                fields_["parameters"] += gathered.parameters - sharded.parameters
            if name.startswith("backward"):
                fields_["gradients"] += gathered.gradients - sharded.gradients
        out.append(StepMemory(m.moment, **fields_, first_step=m.first_step))
    return out


def predict_plan(config: GPTConfig, batch_size: int, plan: Plan = Plan(), *, gpu=None,
                 seq_len: int | None = None) -> StepMemory:
    """Predicted peak bytes of one steady-state step of ``batch_size`` sequences run as ``plan``.

    The memory engine (:func:`course_lib.prediction.engine.predict_moments`) predicts the moments
    of the step for the plan's precision, micro-batch (``batch_size / accumulation_steps``),
    checkpointing and chunked loss; closed forms then adjust each moment for the other
    levers:

    * optimizer in backward: the gradients of a moment shrink to the largest parameter's,
      and the optimizer moment holds that one gradient and its AdamW scratch;
    * 8-/4-bit states: :func:`course_lib.training.levers.low_bit_state_bytes`;
    * activation offloading: the device keeps what one block (or the head) needs at a
      time, the largest of the two (``save_on_cpu`` brings a tensor back when its op's
      backward runs; an upper bound on the device when the copies keep pace);
    * optimizer offloading: optimizer states and master weights on the host, the step there;
    * LoRA of rank ``r``: frozen parameters keep only their weights; gradients, states and
      master weights are the adapters' (:func:`course_lib.training.levers.lora_parameter_count`);
      activations stay, plus each adapter's ``b x s x r`` intermediate;
    * ZeRO stage 1/2/3 over ``world_size`` GPUs: optimizer states and master weights, then
      gradients, then parameters divided by ``N`` (Rajbhandari et al. 2020); stage 3 plus the
      units FSDP2 gathers (:func:`course_lib.prediction.formulas.zero3_memory`): their
      parameters in the passes, their unsharded gradients in the backward pass.

    Args:
        config (GPTConfig): the model.
        batch_size (int): sequences per optimizer step.
        plan (Plan): the settings.
        gpu (str or GPU, optional): where the step runs (as the engine's ``gpu``).
        seq_len (int, optional): tokens per sequence (None: ``config.seq_len``).

    Returns:
        StepMemory: the worst moment.

    Raises:
        ValueError: naming the argument: a bad config, batch, plan field or combination
            (optimizer in backward with accumulation).
    """
    check_config(config)
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    _check_plan(plan)
    if plan.lora_rank is not None:  # a rank beyond the layer's width is no low-rank adapter
        positive_int("plan.lora_rank", plan.lora_rank, maximum=config.d_model)
    seq_len = config.seq_len if seq_len is None else positive_int("seq_len", seq_len)
    return max(_plan_moments(config, batch_size, plan, gpu, seq_len), key=lambda m: m.total)


def _check_plan(plan) -> Plan:
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a course_lib.planning.fit_ladder.Plan, got {type(plan).__name__}")
    plan.__post_init__()  # a frozen dataclass can still be changed through object.__setattr__
    if plan.in_backward and plan.accumulation_steps > 1:
        raise ValueError("in_backward cannot be combined with accumulation_steps > 1: the "
                         "optimizer would step after every micro-batch")
    return plan


def plan_seconds(config: GPTConfig, batch_size: int, plan: Plan, gpu: str, *,
                 seq_len: int | None = None, utilization: float | None = None) -> float:
    """Predicted seconds of one optimizer step run as ``plan`` on the preset ``gpu``.

    The course's one time model (:func:`course_lib.prediction.time_model.step_time`, from the datasheet of
    :data:`course_lib.device.GPUS`): FLOPs at a utilisation of the compute dtype's peak, the
    pointwise and optimizer bytes at the memory bandwidth, operators at a fixed cost each, and
    the transfers at the links, not overlapped. The plan's levers enter as:

    * the chunked loss: ``+ 2 N h V`` FLOPs, its second head matmul;
    * LoRA of rank ``r``: ``+ 6 N`` FLOPs per adapter parameter
      (:func:`course_lib.training.levers.lora_parameter_count`), ``-`` the frozen weights' gradient
      matmuls (:func:`course_lib.training.levers.frozen_linear_flops`); the optimizer steps the adapters
      only;
    * 8-/4-bit states: their quantisation's bytes (:func:`course_lib.prediction.time_model.optimizer_bytes`);
    * offloading: the kept activations out and back, or the gradients out, the parameters back
      and the optimizer's bytes at the host's bandwidth; ZeRO: ``2 P`` (stages 1, 2) or ``3 P``
      (stage 3) values over the peer link, and the optimizer's bytes over ``world_size``.

    Args:
        config (GPTConfig): the model.
        batch_size (int): sequences per optimizer step.
        plan (Plan): the settings.
        gpu (str): a preset name of :data:`course_lib.device.GPUS`.
        seq_len (int, optional): tokens per sequence, at most ``config.seq_len``.
        utilization (float, optional): share of the datasheet peak FLOP/s reached, in (0, 1];
            None: the time model's figure for the compute dtype.

    Returns:
        float: seconds.

    Raises:
        ValueError: naming the argument: an unknown GPU, a ``utilization`` outside (0, 1], a bad
            config, batch, plan or ``seq_len``, or ``accumulation_steps`` that do not divide
            ``batch_size``.
    """
    check_config(config)
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    _check_plan(plan)
    choice("gpu", gpu, tuple(GPUS))
    if plan.lora_rank is not None:  # a rank beyond the layer's width is no low-rank adapter
        positive_int("plan.lora_rank", plan.lora_rank, maximum=config.d_model)
    if utilization is not None:
        number("utilization", utilization, above=0.0, maximum=1.0)
    seq_len = config.seq_len if seq_len is None else positive_int("seq_len", seq_len,
                                                                  maximum=config.seq_len)
    K = plan.accumulation_steps
    if batch_size % K:
        raise ValueError(f"accumulation_steps must divide batch_size={batch_size}, got {K}")
    tokens = batch_size * seq_len
    extra, trained = 0, None
    if plan.loss_chunk is not None:
        extra += 2 * tokens * config.d_model * config.vocab_size
    if plan.lora_rank:
        trained = levers.lora_parameter_count(config, plan.lora_rank)
        extra += 6 * tokens * trained - levers.frozen_linear_flops(config, tokens)
    return time_model.step_seconds(
        config, batch_size // K, K, mode=plan.mode, every=plan.every, precision=plan.precision,
        seq_len=seq_len, gpu=gpu, utilisation=utilization, state_bits=plan.state_bits,
        offload_activations=plan.offload_activations, offload_optimizer=plan.offload_optimizer,
        trained_params=trained, extra_flops=extra, zero_stage=plan.zero_stage,
        world_size=plan.world_size)


@dataclass(frozen=True)
class Rung:
    """One lever of :func:`ladder`, applied alone to the plain step.

    Attributes:
        lever (str): the lever's name.
        group (str): one of :data:`LADDER_GROUPS`; levers of one group replace each other in
            the combination (two checkpointing modes, say).
        plan (Plan): the plain step with this lever.
        memory (StepMemory): its predicted peak moment.
        bytes_saved (int): predicted peak bytes it removes (negative: it adds).
        time_paid (float): the step's predicted time it adds, as a fraction of the plain step's
            (negative: it speeds the step up).
        how (str): "engine" where the memory engine predicts the lever itself, "engine +
            formula" where a closed form adjusts the engine's moments.
    """

    lever: str
    group: str
    plan: Plan
    memory: StepMemory
    bytes_saved: int
    time_paid: float
    how: str

    @property
    def bytes_per_time(self) -> float:
        """Bytes saved per unit of time paid: per the plain step's whole time (``time_paid``
        1.0); inf for a lever that costs no time."""
        return self.bytes_saved / self.time_paid if self.time_paid > 0 else math.inf


@dataclass(frozen=True)
class Ladder:
    """What :func:`ladder` found: every lever alone, and the combination that fits.

    The combination adds levers one by one until the step is under the GPU's memory.

    Attributes:
        config (GPTConfig): the model.
        gpu (str): the GPU preset's name.
        budget_bytes (int): the memory to fit in, in bytes.
        batch_size (int): sequences per optimizer step.
        seq_len (int): tokens per sequence.
        baseline (StepMemory): the plain step's peak.
        rungs (tuple of Rung): every lever alone, best first (:func:`rank_key`).
        steps (tuple): the combination, lever by lever: ``((lever, StepMemory after adding it,
            time paid so far), ...)``.
        plan (Plan): the combination's settings.
        fits (bool): whether the combination's peak is within ``budget_bytes``.
        listed (tuple of Rung): the rungs in the course's order, which a chart keeps from one
            setting to the next.
    """

    config: GPTConfig
    gpu: str
    budget_bytes: int
    batch_size: int
    seq_len: int
    baseline: StepMemory
    rungs: tuple
    steps: tuple
    plan: Plan
    fits: bool
    listed: tuple = ()

    @property
    def memory(self) -> StepMemory:
        """The predicted peak of the combination."""
        return self.steps[-1][1] if self.steps else self.baseline

    def table(self) -> str:
        """The rungs as a text table, in rank order: bytes saved, time paid, bytes per time.

        "per +1 %" is the bytes saved per percent of the plain step's time paid ("free" for a
        lever that costs no time, "-" for one that saves nothing).

        Returns:
            str: a header and one line per rung (at most 98 characters a line).
        """
        w = max(len(r.lever) for r in self.rungs)
        lines = [f"{'lever':{w}s} {'saves':>10s} {'time':>7s} {'per +1 %':>10s} {'peak':>10s}"
                 "  how"]
        for r in self.rungs:
            per = ("-" if r.bytes_saved <= 0 else "free" if r.bytes_per_time == math.inf
                   else format_bytes(r.bytes_per_time / 100))
            lines.append(f"{r.lever:{w}s} {format_bytes(r.bytes_saved):>10s} "
                         f"{r.time_paid:>+7.1%} {per:>10s} {format_bytes(r.memory.total):>10s}"
                         f"  {r.how}")
        return "\n".join(lines)


def _ladder_rungs(config, batch_size, gpu, seq_len, *, loss_chunk, lora_rank, world_size):
    half = mixed_precision_for(GPUS[gpu])
    levers_ = [(f"precision {half}", "precision", dict(precision=half))]
    if batch_size > 1:
        levers_.append(("accumulation: 1 sequence per micro-batch", "accumulation",
                        dict(accumulation_steps=batch_size)))
    for mode, every in FIT_POLICIES[1:]:
        levers_.append((f"checkpointing {ckpt.policy_label(mode, every)}", "checkpointing",
                        dict(mode=mode, every=every)))
    levers_ += [(f"chunked loss ({loss_chunk} tokens)", "chunked loss", dict(loss_chunk=loss_chunk)),
                ("optimizer step in backward", "optimizer in backward", dict(in_backward=True)),
                ("8-bit AdamW states", "optimizer states", dict(state_bits=8)),
                ("4-bit AdamW states", "optimizer states", dict(state_bits=4)),
                ("offload activations (save_on_cpu)", "offload activations",
                 dict(offload_activations=True)),
                ("offload optimizer states", "offload optimizer", dict(offload_optimizer=True)),
                (f"LoRA rank {lora_rank} (base frozen)", "LoRA", dict(lora_rank=lora_rank))]
    levers_ += [(f"ZeRO-{z} on {world_size} GPUs", "ZeRO",
                 dict(zero_stage=z, world_size=world_size)) for z in (1, 2, 3)]
    return levers_


_ENGINE_GROUPS = ("precision", "accumulation", "checkpointing", "chunked loss")


def rank_key(rung: Rung) -> tuple:
    """Where a rung stands on the ladder: sort rungs by this key, best first.

    Bytes saved per time paid, in four bands: levers that save bytes at no time (the most
    time gained first, then the most bytes), then the levers that cost time by bytes saved
    per unit of time paid (:attr:`Rung.bytes_per_time`, the most first), then those that
    save nothing at this setting, and last the job-changing levers (:data:`JOB_CHANGING`) in
    the same order among themselves.

    Args:
        rung (Rung): one lever alone.

    Returns:
        tuple: a sort key.
    """
    free = round(rung.time_paid, 6) <= 0  # rounded: float noise around 0 is no time paid
    return (rung.group in JOB_CHANGING, rung.bytes_saved <= 0, not free,
            round(rung.time_paid, 6) if free else -rung.bytes_per_time, -rung.bytes_saved)


def ladder(config: GPTConfig, gpu: str, *, batch_size: int = 8, seq_len: int | None = None,
           budget_bytes: int | None = None, loss_chunk: int = 1024, lora_rank: int | None = None,
           world_size: int = 8, utilization: float | None = None) -> Ladder:
    """Every lever of the course for training ``config`` on ``gpu``, ranked, and the mix that fits.

    The plain step is fp32 AdamW, the whole batch of ``batch_size`` sequences at once,
    nothing checkpointed, offloaded or sharded: the one baseline of every saving and every
    price. Each lever alone (a :class:`Rung`) is predicted with :func:`predict_plan` (bytes
    saved) and :func:`plan_seconds` (time paid, as a fraction of the plain step's predicted
    time: datasheet figures, not a measurement); the rungs are ranked by bytes saved per time
    paid (:func:`rank_key`: the levers that cost no time first, the job-changing levers,
    :data:`JOB_CHANGING`: LoRA trains other parameters, ZeRO needs ``world_size`` GPUs,
    last). The combination then adds the rungs in that order, each one only if it lowers the
    predicted peak in the company of those already in (a lever of a group already in
    replaces it if that is lower), until the step fits ``budget_bytes`` (default the GPU's
    memory as PyTorch reports it, ``GPUS[gpu].total_memory``).

    Args:
        config (GPTConfig): the model.
        gpu (str): a preset name of :data:`course_lib.device.GPUS`.
        batch_size (int): sequences per optimizer step.
        seq_len (int, optional): tokens per sequence, at most ``config.seq_len``.
        budget_bytes (int, optional): device bytes to fit in (default
            ``GPUS[gpu].total_memory``).
        loss_chunk (int): tokens per chunk of the chunked loss.
        lora_rank (int, optional): the adapters' rank, from 1 to ``config.d_model`` (None: 16,
            or ``config.d_model`` if smaller).
        world_size (int): GPUs for the ZeRO rungs.
        utilization (float): share of the GPU's peak FLOP/s the step reaches
            (:func:`plan_seconds`).

    Returns:
        Ladder: the rungs, the combination and whether it fits; the same (frozen) object for
        the same arguments, of the last 256 settings asked (a widget moved back redraws at once).

    Raises:
        ValueError: naming the argument.

    Example:
        >>> cfg = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
        >>> result = ladder(cfg, "T4", batch_size=8)
        >>> result.fits, result.rungs[0].time_paid < 0
        (True, True)
    """
    check_config(config)
    choice("gpu", gpu, tuple(GPUS))
    batch_size = positive_int("batch_size", batch_size, maximum=MAX_BATCH)
    seq_len = config.seq_len if seq_len is None else positive_int("seq_len", seq_len)
    if seq_len > config.seq_len:
        raise ValueError(f"seq_len must be at most config.seq_len={config.seq_len}, got {seq_len}")
    budget = GPUS[gpu].total_memory if budget_bytes is None else positive_int(
        "budget_bytes", budget_bytes, maximum=MAX_BYTES)
    loss_chunk = positive_int("loss_chunk", loss_chunk, maximum=MAX_COUNT)
    lora_rank = min(16, config.d_model) if lora_rank is None else positive_int(
        "lora_rank", lora_rank, maximum=config.d_model)
    world_size = positive_int("world_size", world_size, maximum=MAX_WORLD_SIZE)
    if utilization is not None:
        utilization = number("utilization", utilization, above=0.0, maximum=1.0)
    return _ladder(config, gpu, batch_size, seq_len, budget, loss_chunk, lora_rank, world_size,
                   utilization)


@functools.lru_cache(maxsize=256)
def _ladder(config: GPTConfig, gpu: str, batch_size: int, seq_len: int, budget: int,
            loss_chunk: int, lora_rank: int, world_size: int, utilization: float | None) -> Ladder:
    """:func:`ladder` of checked arguments, cached (at most 256 settings): lecture 08's widget
    asks again for settings a learner has seen, and each costs some thirty predictions. A
    :class:`Ladder` is frozen, so the same one can be handed out again."""
    base_plan = Plan()

    def memory(plan):
        return predict_plan(config, batch_size, plan, gpu=gpu, seq_len=seq_len)

    def seconds(plan):
        return plan_seconds(config, batch_size, plan, gpu, seq_len=seq_len,
                            utilization=utilization)

    baseline, base_time = memory(base_plan), seconds(base_plan)
    rungs = []
    for lever, group, change in _ladder_rungs(config, batch_size, gpu, seq_len,
                                              loss_chunk=loss_chunk, lora_rank=lora_rank,
                                              world_size=world_size):
        plan = replace(base_plan, **change)
        m = memory(plan)
        rungs.append(Rung(lever, group, plan, m, baseline.total - m.total,
                          seconds(plan) / base_time - 1,
                          "engine" if group in _ENGINE_GROUPS else "engine + formula"))
    listed = tuple(rungs)
    rungs.sort(key=rank_key)

    plan, current, steps = base_plan, baseline, []
    for rung in rungs:
        if current.total <= budget:
            break
        change = {k: getattr(rung.plan, k) for k in vars(rung.plan)
                  if getattr(rung.plan, k) != getattr(base_plan, k)}
        trial = replace(plan, **change)
        try:
            m = memory(trial)
        except ValueError:  # an incompatible pair (optimizer in backward with accumulation)
            continue
        if m.total < current.total:
            plan, current = trial, m
            steps.append((rung.lever, m, seconds(plan) / base_time - 1))
    return Ladder(config, gpu, budget, batch_size, seq_len, baseline, tuple(rungs), tuple(steps),
                  plan, current.total <= budget, listed)



__all__ = ["LADDER_GROUPS", "JOB_CHANGING", "Plan", "predict_plan", "plan_seconds", "Rung", "Ladder",
           "rank_key", "ladder"]
