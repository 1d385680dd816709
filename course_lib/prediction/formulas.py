"""Memory of training, in bytes: model states (analytic and measured) and transformer activations.

Model states are what training keeps for every parameter between steps
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 3.1):

=================  ======  ==============  ==========  ============================
precision          params  grads           master      each optimizer state tensor
=================  ======  ==============  ==========  ============================
``"fp32"``         4       4               0           4
``"fp16-mixed"``   2       2 (+4 buffer)   4 (fp32)    4 (fp32)
``"bf16-mixed"``   2       2 (4 buffer)    4 (fp32)    4 (fp32)
``"bf16"``         2       2 (4 buffer)    0           2
``"autocast-*"``   4       4               0           4
=================  ======  ==============  ==========  ============================

SGD keeps no state tensor, SGD with momentum one (the momentum buffer), Adam
and AdamW two (``m`` and ``v``). Mixed-precision Adam is therefore
``2 + 2 + 4 + 4 + 4 = 16`` bytes per parameter, the paper's ``K = 12`` bytes of
optimizer state (master weights, m, v) on top of 16-bit weights and gradients.
With an fp32 gradient buffer (Megatron-LM's ``main_grad``; its distributed optimizer's
table): bf16 parameters add each 16-bit gradient into the fp32 buffer and free it,
``2 + 4 + 4 + 4 + 4 = 18``; fp16 parameters keep their fp16 gradients and the optimizer
copies them into fp32 main gradients, ``2 + 2 + 4 + 4 + 4 + 4 = 20``.
fp32 Adam is also 16 (``4 + 4 + 8``), SGD 8, SGD with momentum 12.

The table is :data:`PRECISION`'s, whose dtypes every module reads (the memory engine,
the training set-up of :mod:`course_lib.prediction.step_setup`, the planners): one
:class:`Precision` per name, from which the bytes above are derived.

``"mixed"`` here is the recipe of Megatron-LM and DeepSpeed: a 16-bit model plus
an fp32 master copy. ``torch.autocast`` is different: it keeps the parameters in
fp32 and casts them per op, so its model states are those of ``"fp32"``.

ZeRO data parallelism over ``N`` ranks shards, per stage, the optimizer states
and master weights (stage 1), also the gradients (stage 2), also the parameters
(stage 3). Per device, mixed-precision Adam: stage 1 ``4P + 12P/N``, stage 2
``2P + 14P/N``, stage 3 ``16P/N`` bytes. A sharded tensor of ``P`` elements holds
``ceil(P/N)`` elements per rank (the flat buffer is padded to a multiple of N, as
DeepSpeed and FSDP do), so the figures are exact integers. That is between steps; during one,
FSDP2 also holds whole units (:func:`zero3_memory`, lectures 07 and 08).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace

import torch

from course_lib.device import pick_dtype, resolve_gpu
from course_lib.model.gpt import GPT, check_config
from course_lib.units import dtype_bytes, storage_bytes
from course_lib.validation import MAX_COUNT, boolean, choice, integer, positive_int

#: The most parameters :func:`training_memory` counts (about 10**15, a thousand times GPT-4's).
MAX_PARAMS = 2**50
#: The most data-parallel ranks.
MAX_WORLD_SIZE = 2**24

#: The optimizers and ZeRO stages the model-state formulas cover.
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "selective", "full")

#: State tensors per parameter tensor that each optimizer keeps (momentum buffer; Adam's m, v).
STATE_TENSORS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}



@dataclass(frozen=True)
class Precision:
    """A precision's dtypes: parameters (and gradients), compute, AdamW's states; whether it keeps
    fp32 master weights, runs under ``torch.autocast``, scales the loss (``GradScaler``)."""

    name: str
    params: torch.dtype
    compute: torch.dtype
    master: bool
    state: torch.dtype
    autocast: bool
    grad_scaler: bool

    @property
    def element_bytes(self) -> tuple[int, int, int, int]:
        """Bytes per parameter of ``(params, grads, master weights, each optimizer state)``."""
        weight = dtype_bytes(self.params)
        return weight, weight, dtype_bytes(torch.float32) * self.master, dtype_bytes(self.state)


_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
#: Every precision of the course by name: the one table of its dtypes (see the module doc).
PRECISION = {
    "fp32": Precision("fp32", _F32, _F32, False, _F32, False, False),
    "fp16-mixed": Precision("fp16-mixed", _F16, _F16, True, _F32, False, True),
    "bf16-mixed": Precision("bf16-mixed", _BF16, _BF16, True, _F32, False, False),
    "bf16": Precision("bf16", _BF16, _BF16, False, _BF16, False, False),
    # torch.autocast keeps the model in fp32; its 16-bit weight copies are activations
    "autocast-fp16": Precision("autocast-fp16", _F32, _F16, False, _F32, True, True),
    "autocast-bf16": Precision("autocast-bf16", _F32, _BF16, False, _F32, True, False),
}
PRECISIONS = tuple(PRECISION)


def precision_of(precision: str, name: str = "precision") -> Precision:
    """The :class:`Precision` named ``precision`` (of :data:`PRECISIONS`; else a ValueError naming
    ``name``)."""
    return PRECISION[choice(name, precision, PRECISIONS)]


def mixed_precision_for(gpu=None) -> str:
    """The mixed precision of :data:`PRECISIONS` a device trains in.

    ``"fp16-mixed"`` (with a GradScaler) on a GPU without bf16 tensor cores (a T4),
    ``"bf16-mixed"`` on Ampere and newer and on the CPU (which has no fp16 speed to speak of);
    :func:`course_lib.device.pick_dtype` decides.

    Args:
        gpu (str or GPU, optional): None (the CPU), a name of :data:`course_lib.device.GPUS`, "cuda"
            (this kernel's GPU) or a :class:`~course_lib.device.GPU`.

    Returns:
        str: ``"fp16-mixed"`` or ``"bf16-mixed"``.

    Raises:
        ValueError: naming ``gpu``, for anything else.

    Example:
        >>> mixed_precision_for("T4"), mixed_precision_for("A100 80GB")
        ('fp16-mixed', 'bf16-mixed')
    """
    card = resolve_gpu(gpu)
    if card is None:
        return "bf16-mixed"
    return "fp16-mixed" if pick_dtype(card) == torch.float16 else "bf16-mixed"



@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of model states on one device; ``total`` is the sum of the four parts.

    The fields are four of the course's memory categories, :data:`course_lib.units.MEMORY_CATEGORIES`.

    Attributes:
        parameters (int): bytes of the parameters.
        gradients (int): bytes of the gradients, with the fp32 gradient-accumulation buffer when
            there is one.
        optimizer_state (int): bytes of the optimizer's state tensors (AdamW's m and v).
        master_weights (int): bytes of the fp32 master copies (mixed precision).
        total (int): the sum of the four, computed (not an argument).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    master_weights: int
    total: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "total", self.parameters + self.gradients
                           + self.optimizer_state + self.master_weights)

    def as_dict(self) -> dict[str, int]:
        """The five fields by name, in bytes (``dataclasses.asdict``).

        Returns:
            dict: ``{"parameters": ..., "gradients": ..., "optimizer_state": ...,
            "master_weights": ..., "total": ...}``.
        """
        return asdict(self)


def _count(name: str, value, maximum: int = MAX_PARAMS) -> int:
    """A positive int; whole floats such as ``7e9`` are accepted and converted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return positive_int(name, value, maximum=maximum)


def _choice(name: str, value, allowed: tuple):
    if all(isinstance(a, int) for a in allowed):  # numbers: an int (numpy's too), never a bool
        try:
            value = integer(name, value)
        except ValueError:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None
    try:
        ok = value in allowed
    except TypeError:
        ok = False
    if isinstance(value, bool | float) or not ok:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def training_memory(n_params: int, *, optimizer: str = "adamw", precision: str = "fp32",
                    zero_stage: int = 0, world_size: int = 1,
                    fp32_grad_buffer: bool = False) -> TrainingMemory:
    """Bytes per device of parameters, gradients, optimizer states and master weights.

    ``zero_stage`` 0-3 over ``world_size`` data-parallel ranks follows the ZeRO paper
    (Rajbhandari et al. 2020, section 5): stage 1 shards optimizer states and master weights,
    stage 2 also gradients, stage 3 also parameters; stage 0 replicates all. A sharded tensor
    holds ``ceil(P / N)`` elements per rank.

    Mixed-precision AdamW: ``training_memory(P, precision="bf16-mixed").total == 16 * P``.
    Activations, temporaries and allocator overhead are not model states and are
    not counted (see :func:`transformer_activation_bytes` for activations).

    Args:
        n_params (int): parameters P, an int (or a whole float such as ``7e9``) from 1 to
            :data:`MAX_PARAMS`.
        optimizer (str): one of :data:`OPTIMIZERS`.
        precision (str): one of :data:`PRECISIONS` (see the module table).
        zero_stage (int): 0, 1, 2 or 3.
        world_size (int): data-parallel ranks N, from 1 to :data:`MAX_WORLD_SIZE` (a whole
            float is accepted).
        fp32_grad_buffer (bool): give 16-bit parameters an fp32 gradient buffer (counted in
            ``gradients``), as Megatron-LM accumulates in: bf16 gradients are added into it and
            freed (4 bytes/param instead of 2), fp16 gradients are kept beside it (2 + 4); with
            fp32 gradients (``"fp32"``, autocast) they already are that buffer and nothing
            changes.

    Returns:
        TrainingMemory: bytes of each model state on one device, and their ``total``.

    Raises:
        ValueError: naming the parameter, for a bad value.

    Example:
        >>> training_memory(7_000_000_000, precision="bf16-mixed").total  # 16 bytes * 7e9
        112000000000
        >>> training_memory(7_000_000_000, precision="bf16-mixed", zero_stage=3,
        ...                 world_size=8).total  # over 8 ranks
        14000000000
    """
    P = _count("n_params", n_params)
    _choice("optimizer", optimizer, OPTIMIZERS)
    _choice("precision", precision, PRECISIONS)
    stage = _choice("zero_stage", zero_stage, ZERO_STAGES)
    N = _count("world_size", world_size, MAX_WORLD_SIZE)
    if not isinstance(fp32_grad_buffer, bool):
        raise ValueError(f"fp32_grad_buffer must be True or False, got {fp32_grad_buffer!r}")
    param_b, grad_b, master_b, state_b = PRECISION[precision].element_bytes
    if fp32_grad_buffer and grad_b == 2:
        grad_b = 6 if precision == "fp16-mixed" else 4
    shard = -(-P // N) if stage else P  # ceil(P / N) in exact integers

    def elements(sharded_from: int) -> int:
        return shard if stage >= sharded_from else P

    return TrainingMemory(
        parameters=param_b * elements(3),
        gradients=grad_b * elements(2),
        optimizer_state=STATE_TENSORS[optimizer] * state_b * elements(1),
        master_weights=master_b * elements(1),
    )


@functools.lru_cache(maxsize=64)
def _fsdp_units(config) -> tuple[int, int, int]:
    """Elements of ``GPT(config)``, of its root unit and of its largest block unit (the units of
    ``fully_shard`` on each block, then on the model), read from a one-block model on ``meta``
    (every block is alike)."""
    with torch.device("meta"):
        model = GPT(replace(config, n_layers=1))
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - block  # a tied weight once
    return root + config.n_layers * block, root, block


def zero3_memory(config, *, optimizer: str = "adamw", precision: str = "fp32", world_size: int = 1,
                 during_step: bool = True) -> TrainingMemory:
    """07-08: model states per rank under ZeRO-3 / FSDP2, between steps or during one.

    Between steps a rank keeps ``1/N`` of every state: ``training_memory(P, zero_stage=3,
    world_size=N)``, ``16P/N`` for mixed-precision AdamW (Rajbhandari et al. 2020, section 5).
    During a step it also holds whole units (PyTorch's FSDP2 docs, ``fully_shard``; Zhao et al.
    2023): with ``fully_shard`` on each block and then on the model, the units are the blocks
    and the root (embeddings, final norm, the tied head)::

        parameters += (root + 2 * block) * param_bytes
            # all-gathered: the root, the block that runs, the next one (prefetched)
        gradients  += (root + max(root, 2 * block)) * grad_bytes
            # unsharded: the root's, and a unit's with their copy in the reduce-scatter buffer

    Assumptions, FSDP2's defaults: ``reshard_after_forward=True`` for the blocks (a block is
    gathered again for its backward), the root kept gathered from forward to backward (FSDP2
    does not reshard the root after forward), one unit prefetched; the root's gradients live
    from the head's backward (the first) to the root's reduce-scatter (the last). ``block`` is
    the largest block. An upper bound: it counts every gradient shard (they all exist only
    once the backward pass is over) and adds the largest gathered parameters and gradients of
    different moments. Activations are not model states and are not counted.

    Args:
        config (GPTConfig): the model (:class:`course_lib.model.gpt.GPTConfig`).
        optimizer (str): one of :data:`OPTIMIZERS`.
        precision (str): one of :data:`PRECISIONS`.
        world_size (int): data-parallel ranks N, from 1 to :data:`MAX_WORLD_SIZE`.
        during_step (bool): add the gathered units (True) or only the shards (False).

    Returns:
        TrainingMemory: bytes per rank of each model state.

    Raises:
        TypeError: naming ``config`` (not a ``GPTConfig``) or ``during_step`` (not a bool).
        ValueError: naming the parameter, as :func:`training_memory`.

    Example:
        >>> from course_lib.model.gpt import GPTConfig
        >>> gpt2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
        >>> zero3_memory(gpt2, precision="bf16-mixed", world_size=8, during_step=False).total
        248879616
        >>> zero3_memory(gpt2, precision="bf16-mixed", world_size=8).total  # the root is large
        513543168
    """
    boolean("during_step", during_step)
    P, root, block = _fsdp_units(check_config(config))
    shards = training_memory(P, optimizer=optimizer, precision=precision, zero_stage=3,
                             world_size=world_size)
    if not during_step:
        return shards
    param_b, grad_b, _, _ = PRECISION[precision].element_bytes
    return replace(shards, parameters=shards.parameters + (root + 2 * block) * param_b,
                   gradients=shards.gradients + (root + max(root, 2 * block)) * grad_b)


def bytes_per_param(optimizer: str = "adamw", precision: str = "fp32", *,
                    fp32_grad_buffer: bool = False) -> int:
    """Bytes of model states per parameter without sharding (mixed-precision Adam: 16).

    Args:
        optimizer (str): one of :data:`OPTIMIZERS`.
        precision (str): one of :data:`PRECISIONS`.
        fp32_grad_buffer (bool): as for :func:`training_memory` (bf16-mixed: 18, fp16-mixed: 20).

    Returns:
        int: ``training_memory(1, ...).total``.

    Raises:
        ValueError: naming the parameter, as :func:`training_memory` does.

    Example:
        >>> bytes_per_param("adamw", "bf16-mixed"), bytes_per_param("sgd", "fp32")
        (16, 8)
    """
    return training_memory(1, optimizer=optimizer, precision=precision,
                           fp32_grad_buffer=fp32_grad_buffer).total


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                      master_params=(), include_step: bool = True) -> TrainingMemory:
    """Measured model states: the storage bytes of what a training step keeps alive.

    * ``parameters``: the model's parameters (a tied weight counts once);
    * ``gradients``: their ``.grad`` tensors, and those of the master weights;
    * ``master_weights``: fp32 copies of the parameters that the optimizer updates (mixed
      precision, as Megatron-LM and DeepSpeed do it): the ``master`` list of an optimizer
      that keeps one (:class:`course_lib.training.mixed_precision.MasterWeightAdamW`), and
      ``master_params``, for copies made by hand;
    * ``optimizer_state``: every tensor in ``optimizer.state``. AdamW also keeps a
      scalar ``step`` tensor per parameter tensor (4 bytes each, a counter, not a
      per-element state); ``include_step=False`` leaves those out.

    Each storage counts once (:func:`course_lib.units.storage_bytes`). Works on real tensors
    and on the ``meta`` device (storages there have a size but no memory), so a 70B optimizer
    step can be "measured" without allocating.

    Args:
        model (torch.nn.Module): the model whose parameters and gradients are counted.
        optimizer (torch.optim.Optimizer, optional): its optimizer, for the states (and the
            master weights of a :class:`~course_lib.training.mixed_precision.MasterWeightAdamW`).
        master_params (iterable of torch.Tensor): master copies made by hand.
        include_step (bool): count AdamW's per-tensor ``step`` counters.

    Returns:
        TrainingMemory: the measured bytes of each model state.

    Raises:
        ValueError: naming ``model`` (not an ``nn.Module``), ``optimizer`` (not a
            ``torch.optim.Optimizer`` or None) or ``master_params`` (not tensors).
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer or None, "
                         f"got {type(optimizer).__name__}")
    try:
        master = list(master_params) if not isinstance(master_params, torch.Tensor | str) else None
    except TypeError:
        master = None
    params = list(model.parameters())
    if master is None or not all(isinstance(t, torch.Tensor) for t in master):
        raise ValueError("master_params must be an iterable of tensors")
    master += getattr(optimizer, "master", [])
    states = [] if optimizer is None else [
        value for state in optimizer.state.values() for key, value in state.items()
        if isinstance(value, torch.Tensor) and (include_step or key != "step")]
    return TrainingMemory(
        parameters=storage_bytes(params),
        gradients=storage_bytes(p.grad for p in params + master if p.grad is not None),
        optimizer_state=storage_bytes(states),
        master_weights=storage_bytes(master),
    )


def transformer_activation_bytes(seq_len: int, batch_size: int, d_model: int, n_heads: int,
                                 n_layers: int = 1, recompute: str = "none") -> int:
    """Activation bytes a GPT-style transformer keeps for backward (Korthikanti et al. 2022).

    Per layer, with 16-bit activations, 1-byte dropout masks and a 4h GELU MLP
    ("Reducing Activation Recomputation in Large Transformer Models", eqs. 1-2, no
    tensor or sequence parallelism), ``s`` = seq_len, ``b`` = batch_size,
    ``h`` = d_model, ``a`` = n_heads:

    * ``recompute="none"``: ``s*b*h*(34 + 5*a*s/h)`` bytes, of which ``5*a*s*s*b``
      are the attention scores, softmax output and its dropout mask;
    * ``recompute="selective"`` (recompute the attention core): ``34*s*b*h``;
    * ``recompute="full"`` (keep only each layer's input): ``2*s*b*h``.

    Args:
        seq_len (int): s, tokens per sequence, >= 1.
        batch_size (int): b, sequences per micro-batch, >= 1.
        d_model (int): h, the hidden size, >= 1.
        n_heads (int): a, attention heads, >= 1.
        n_layers (int): transformer layers, >= 1.
        recompute (str): ``"none"``, ``"selective"`` or ``"full"``.

    Returns:
        int: the per-layer bytes times ``n_layers``.

    Raises:
        ValueError: naming the parameter, for a non-positive or non-integer size or an unknown
            ``recompute``.

    Example:
        >>> transformer_activation_bytes(2048, 1, 12288, 96, recompute="selective")  # 34*s*b*h
        855638016
    """
    s, b, h, a, L = (positive_int(n, v, maximum=MAX_COUNT) for n, v in (
        ("seq_len", seq_len), ("batch_size", batch_size), ("d_model", d_model),
        ("n_heads", n_heads), ("n_layers", n_layers)))
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if recompute == "full":
        per_layer = 2 * s * b * h
    elif recompute == "selective":
        per_layer = 34 * s * b * h
    else:
        per_layer = 34 * s * b * h + 5 * a * s * s * b
    return per_layer * L
