"""Memory of training, in bytes: model states (analytic and measured) and transformer activations.

Model states are what training keeps for every parameter between steps (Rajbhandari et al.
2020, "ZeRO", section 3.1). Bytes per parameter, from :data:`PRECISION`, the one table of the
course's precisions that every module reads:

=================  ======  ==============  ==========  ============================
precision          params  grads           master      each optimizer state tensor
=================  ======  ==============  ==========  ============================
``"fp32"``         4       4               0           4
``"fp16-mixed"``   2       2 (+4 buffer)   4 (fp32)    4 (fp32)
``"bf16-mixed"``   2       2 (4 buffer)    4 (fp32)    4 (fp32)
``"bf16"``         2       2 (4 buffer)    0           2
``"autocast-*"``   4       4               0           4
=================  ======  ==============  ==========  ============================

Adam keeps two state tensors (``m``, ``v``), SGD with momentum one, SGD none: mixed-precision
Adam is ``2 + 2 + 4 + 4 + 4 = 16`` bytes per parameter, the paper's ``K = 12``; Megatron-LM's
fp32 gradient buffer makes it 18 (bf16) or 20 (fp16). ``torch.autocast`` keeps fp32 parameters
and casts per op, so its model states are those of ``"fp32"``. ZeRO shards them over ranks
(:func:`training_memory`); during a step FSDP2 also holds whole units (:func:`zero3_memory`).
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

#: State tensors per parameter tensor that each optimizer keeps (momentum buffer; Adam's m, v).
STATE_TENSORS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class _Precision:
    """A precision's dtypes and whether it keeps master weights, autocasts, scales the loss."""

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
    "fp32": _Precision("fp32", _F32, _F32, False, _F32, False, False),
    "fp16-mixed": _Precision("fp16-mixed", _F16, _F16, True, _F32, False, True),
    "bf16-mixed": _Precision("bf16-mixed", _BF16, _BF16, True, _F32, False, False),
    "bf16": _Precision("bf16", _BF16, _BF16, False, _BF16, False, False),
    # torch.autocast keeps the model in fp32; its 16-bit weight copies are activations
    "autocast-fp16": _Precision("autocast-fp16", _F32, _F16, False, _F32, True, True),
    "autocast-bf16": _Precision("autocast-bf16", _F32, _BF16, False, _F32, True, False),
}
PRECISIONS = tuple(PRECISION)


def precision_of(precision: str, name: str = "precision") -> _Precision:
    """The record of :data:`PRECISION` named ``precision`` (else a ValueError naming ``name``)."""
    return PRECISION[choice(name, precision, PRECISIONS)]


def mixed_precision_for(gpu=None) -> str:
    """The mixed precision a device trains in: ``"fp16-mixed"`` (with a GradScaler) on a GPU
    without bf16 tensor cores, else ``"bf16-mixed"`` (:func:`course_lib.device.pick_dtype`).
    Args:
        gpu (str or GPU, optional): what :func:`course_lib.device.resolve_gpu` takes (None: CPU).
    Returns:
        str: ``"fp16-mixed"`` or ``"bf16-mixed"``.
    Example:
        >>> mixed_precision_for("T4"), mixed_precision_for("A100 80GB")
        ('fp16-mixed', 'bf16-mixed')
    """
    card = resolve_gpu(gpu)
    return "fp16-mixed" if card is not None and pick_dtype(card) == torch.float16 else "bf16-mixed"


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of model states on one device, four of :data:`course_lib.units.MEMORY_CATEGORIES`
    (``gradients`` with the fp32 accumulation buffer when there is one), and their ``total``.
    Attributes:
        parameters, gradients, optimizer_state, master_weights, total (int): the bytes.
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
            dict of str to int: the bytes by field name.
        """
        return asdict(self)


def _count(name: str, value, maximum: int = MAX_PARAMS) -> int:
    """A positive int; whole floats such as ``7e9`` are accepted and converted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return positive_int(name, value, maximum=maximum)


def training_memory(n_params: int, *, optimizer: str = "adamw", precision: str = "fp32",
                    zero_stage: int = 0, world_size: int = 1,
                    fp32_grad_buffer: bool = False) -> TrainingMemory:
    """Bytes per device of parameters, gradients, optimizer states and master weights.

    ZeRO ``zero_stage`` over ``world_size`` ranks (Rajbhandari et al. 2020, section 5) shards
    ``ceil(P / N)`` elements per rank. ``fp32_grad_buffer``: 16-bit parameters accumulate into
    an fp32 buffer, as Megatron-LM does (bf16 gradients are freed into it, fp16 ones kept).
    Args:
        n_params, zero_stage, world_size (int): parameters P; the ZeRO stage, 0 to 3; ranks N.
        optimizer, precision (str): one of :data:`OPTIMIZERS`; one of :data:`PRECISIONS`.
        fp32_grad_buffer (bool): 16-bit gradients accumulate in fp32, as above.
    Returns:
        TrainingMemory: the bytes per device.
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
    choice("optimizer", optimizer, OPTIMIZERS)
    choice("precision", precision, PRECISIONS)
    try:  # numbers: an int (numpy's too), never a bool or a float
        stage = integer("zero_stage", zero_stage, minimum=0, maximum=3)
    except ValueError:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}") from None
    N = _count("world_size", world_size, MAX_WORLD_SIZE)
    boolean("fp32_grad_buffer", fp32_grad_buffer)
    param_b, grad_b, master_b, state_b = PRECISION[precision].element_bytes
    if fp32_grad_buffer and grad_b == 2:
        grad_b = 6 if precision == "fp16-mixed" else 4
    # elements per rank of what stage 1, 2, 3 shard: ceil(P / N) in exact integers
    states, grads, params = (-(-P // N) if stage >= k else P for k in (1, 2, 3))
    return TrainingMemory(param_b * params, grad_b * grads,
                          STATE_TENSORS[optimizer] * state_b * states, master_b * states)


@functools.lru_cache(maxsize=64)
def _fsdp_units(config) -> tuple[int, int, int]:
    """Elements of ``GPT(config)``, of its root unit and of one block unit (read on ``meta``)."""
    with torch.device("meta"):
        model = GPT(replace(config, n_layers=1))
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - block  # a tied weight once
    return root + config.n_layers * block, root, block


def zero3_memory(config, *, optimizer: str = "adamw", precision: str = "fp32", world_size: int = 1,
                 during_step: bool = True) -> TrainingMemory:
    """07-08: model states per rank under ZeRO-3 / FSDP2, between steps or ``during_step``.

    Between steps a rank keeps ``1/N`` of every state (:func:`training_memory`, stage 3). During
    one, with ``fully_shard`` on each block and then on the model (FSDP2's defaults), it also
    holds whole units, the root (embeddings, final norm, tied head) gathered throughout::

        parameters += (root + 2 * block) * param_bytes
            # all-gathered: the root, the block that runs, the next one (prefetched)
        gradients  += (root + max(root, 2 * block)) * grad_bytes
            # unsharded: the root's, and a unit's with their copy in the reduce-scatter buffer

    An upper bound: every gradient shard is counted, and gathered units of different moments.
    Args:
        config (GPTConfig): the course GPT's shape.
        optimizer, precision, world_size: as :func:`training_memory`.
        during_step (bool): add the units gathered during a step.
    Returns:
        TrainingMemory: the bytes per rank.
    Raises:
        ValueError: naming the parameter, for a bad value.
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
    """Bytes of model states per parameter without sharding: ``training_memory(1, ...).total``.
    Args:
        optimizer, precision, fp32_grad_buffer: as :func:`training_memory`.
    Returns:
        int: the bytes per parameter.
    Example:
        >>> bytes_per_param("adamw", "bf16-mixed"), bytes_per_param("sgd", "fp32")
        (16, 8)
    """
    return training_memory(1, optimizer=optimizer, precision=precision,
                           fp32_grad_buffer=fp32_grad_buffer).total


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                      master_params=(), include_step: bool = True) -> TrainingMemory:
    """Measured model states: the storage bytes of what a training step keeps alive.

    ``gradients`` include the master weights'; ``master_weights`` are an optimizer's ``master``
    list (:class:`~course_lib.training.mixed_precision.MasterWeightAdamW`) plus ``master_params``;
    ``optimizer_state`` every tensor in ``optimizer.state`` (AdamW's ``step`` counters unless
    ``include_step=False``). Each storage counts once, on the ``meta`` device too.
    Args:
        model (torch.nn.Module): the trained model.
        optimizer (torch.optim.Optimizer, optional): its optimizer (None: no state).
        master_params (iterable of Tensor): master weights kept outside the optimizer.
        include_step (bool): count AdamW's ``step`` counters.
    Returns:
        TrainingMemory: the measured bytes.
    Raises:
        ValueError: naming the parameter, for a bad value.
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

    Per layer with 16-bit activations, 1-byte dropout masks and a 4h MLP (eqs. 1-2, no tensor or
    sequence parallelism): ``s*b*h*(34 + 5*a*s/h)`` (``recompute="none"``; ``5*a*s*s*b`` are the
    scores, the softmax output and its mask), ``34*s*b*h`` (``"selective"``: the attention core
    recomputed), ``2*s*b*h`` (``"full"``: only each layer's input); times ``n_layers``.
    Args:
        seq_len, batch_size, d_model, n_heads, n_layers (int): s, b, h, a, and the layers.
        recompute (str): ``"none"``, ``"selective"`` or ``"full"``.
    Returns:
        int: the bytes.
    Raises:
        ValueError: naming the parameter, for a bad value.
    Example:
        >>> transformer_activation_bytes(2048, 1, 12288, 96, recompute="selective")  # 34*s*b*h
        855638016
    """
    s, b, h, a, L = (positive_int(n, v, maximum=MAX_COUNT) for n, v in (
        ("seq_len", seq_len), ("batch_size", batch_size), ("d_model", d_model),
        ("n_heads", n_heads), ("n_layers", n_layers)))
    per_layer = {"none": 34 * s * b * h + 5 * a * s * s * b, "selective": 34 * s * b * h,
                 "full": 2 * s * b * h}
    return per_layer[choice("recompute", recompute, per_layer)] * L
