"""01-08: the course GPT, a small, readable, nanoGPT-style decoder-only transformer.

Pre-LayerNorm blocks with a 4h GELU MLP, learned position embeddings and a head tied to the
token embedding (Radford et al. 2019; Karpathy's nanoGPT ``model.py``), the model Korthikanti
et al. (2022) count activations for. Hooks later lectures use: ``GPT.blocks``,
``GPT.run_blocks(x)`` (checkpointing replaces it per instance) and
``CausalSelfAttention.core(q, k, v)`` (what "selective" recomputation recomputes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model import fused
from course_lib.validation import (
    WrongTypeError,
    available_device as as_device,
    boolean,
    choice,
    integer,
    number,
    positive_int,
    tensor,
)

#: The course GPT's attention: written out op by op, or ``F.scaled_dot_product_attention``.
ATTENTION_KINDS = ("explicit", "sdpa")
#: The largest value of each size of a :class:`GPTConfig` (well above any real model's).
CONFIG_MAXIMUM = {"vocab_size": 2**22, "seq_len": 2**20, "d_model": 2**16, "n_heads": 2**12,
                  "n_layers": 2**10}
#: Seeds are what ``torch.Generator.manual_seed`` takes without wrapping around.
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a course GPT; every field is validated (``ValueError`` names the field).

    Sizes are ints from 1 to :data:`CONFIG_MAXIMUM`, ``d_model`` divisible by ``n_heads``;
    ``dropout`` in ``[0, 1)``; ``attention`` one of :data:`ATTENTION_KINDS`. Frozen and hashable:
    change a shape with ``dataclasses.replace(config, n_layers=4)``.
    Raises:
        ValueError: naming the field, for a wrong type or a value out of range.
    """

    #: Tokens in the vocabulary (GPT-2: 50257); the logits, ``B * T * vocab_size``, are the
    #: largest activation (lecture 08's chunked loss).
    vocab_size: int = 256
    #: Context length T (GPT-2: 1024); the explicit attention's scores grow as ``T^2``.
    seq_len: int = 64
    #: Width h of the residual stream (GPT-2 small: 768): ``12 h^2`` parameters per layer.
    d_model: int = 64
    #: Attention heads (GPT-2 small: 12): no parameter, but ``n_heads * T * T`` explicit scores.
    n_heads: int = 4
    #: Transformer blocks L (GPT-2 small: 12), the unit checkpointing works in.
    n_layers: int = 2
    #: Dropout on the embeddings, attention probabilities and residual branches; above 0 the
    #: dropout layers keep their masks for the backward pass.
    dropout: float = 0.0
    #: ``"sdpa"`` (PyTorch's fused attention) or ``"explicit"`` (keeps the T x T matrices).
    attention: str = "sdpa"
    #: Biases in the Linear layers and LayerNorms, as GPT-2 has.
    bias: bool = True
    #: The MLP's bias and GELU as the course kernel :func:`course_lib.model.fused.bias_gelu`,
    #: one op a checkpoint policy can save or recompute (lecture 05). Needs ``bias=True``.
    fused_mlp: bool = False
    #: Each residual add as the course kernel :func:`course_lib.model.fused.bias_dropout_add`
    #: (the projection's bias moves into it, as in Megatron-LM): no dropout mask kept, the
    #: backward draws it again from a seed. Needs ``bias=True``.
    fused_residual: bool = False

    def __post_init__(self):
        for name, maximum in CONFIG_MAXIMUM.items():  # kept as what validation returns: an
            # int, so that torch.tensor(2) or numpy.int64(2) cannot ride along into the sums
            object.__setattr__(self, name, positive_int(name, getattr(self, name),
                                                        maximum=maximum))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model must be divisible by n_heads, got d_model={self.d_model}, "
                             f"n_heads={self.n_heads}")
        object.__setattr__(self, "dropout", number("dropout", self.dropout, minimum=0.0,
                                                   below=1.0))
        choice("attention", self.attention, ATTENTION_KINDS)
        boolean("bias", self.bias)
        for name in ("fused_mlp", "fused_residual"):
            if boolean(name, getattr(self, name)) and not self.bias:
                raise ValueError(f"{name}=True needs bias=True (the kernel adds the bias), got "
                                 "bias=False")

    @property
    def d_head(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused QKV projection, the core, an output
    projection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        config = check_config(config)
        self.n_heads, self.dropout, self.kind = config.n_heads, config.dropout, config.attention
        self.fused_residual = config.fused_residual
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.attn_drop = nn.Dropout(config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``softmax(QK^T / sqrt(d_head)) V`` of ``(B, heads, T, d_head)`` tensors, causal."""
        if self.kind == "sdpa":
            p = self.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return self.attn_drop(scores.softmax(dim=-1)) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """QKV projection, :meth:`core` per head, output projection and dropout."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        if self.fused_residual:  # the bias and the dropout run in the block's kernel
            return F.linear(y, self.proj.weight)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """The 4h GELU feed-forward network: ``Linear(h, 4h)``, GELU, ``Linear(4h, h)``, dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        config = check_config(config)
        self.fused, self.fused_residual = config.fused_mlp, config.fused_residual
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``drop(proj(gelu(fc(x))))``; fused: ``drop(proj(bias_gelu(x @ W.T, b)))``."""
        if not self.fused:
            hidden = self.act(self.fc(x))
        else:
            hidden = F.linear(x, self.fc.weight)  # x @ W.T: aten.mm, no bias
            # Under autocast the matmul ran in 16 bit: the kernel takes one dtype, so the bias follows.
            hidden = fused.bias_gelu(hidden, self.fc.bias.to(hidden.dtype))
        if self.fused_residual:  # the bias and the dropout run in the block's kernel
            return F.linear(hidden, self.proj.weight)
        return self.drop(self.proj(hidden))


class Block(nn.Module):
    """One pre-LayerNorm transformer layer: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    With ``config.fused_residual`` each add is ``fused.bias_dropout_add(branch, proj.bias, x, p)``,
    whose dropout keeps a seed, not a mask.
    Args:
        config (GPTConfig): the model's shape.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        config = check_config(config)
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)
        self.fused_residual, self.dropout = config.fused_residual, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer applied to ``(B, T, d_model)`` activations.
        Args:
            x (torch.Tensor): ``(B, T, d_model)`` activations.
        Returns:
            torch.Tensor: the layer's output, ``x``'s shape.
        """
        if not self.fused_residual:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self._add(x, self.attn(self.ln1(x)), self.attn.proj.bias)
        return self._add(x, self.mlp(self.ln2(x)), self.mlp.proj.bias)

    def _add(self, x: torch.Tensor, branch: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        # Under autocast the branch is 16-bit and the stream fp32: the kernel adds in the
        # stream's dtype, as the unfused add promotes. Without dropout no seed is drawn, so
        # PyTorch's random numbers run as in the unfused model.
        return fused.bias_dropout_add(branch.to(x.dtype), bias.to(x.dtype), x, p,
                                      0 if p == 0 else None)


class GPT(nn.Module):
    """``model(idx)`` -> logits ``(B, T, vocab)``; ``model(idx, targets)`` -> ``(logits, loss)``.

    ``loss`` is the mean cross-entropy (in at least fp32) over targets that are not
    ``ignore_index``, as ``F.cross_entropy``; GPT-2's initialisation (std 0.02). The forward never
    waits for the device: ids out of range raise ``ValueError`` on the CPU, but on a GPU they are
    read only with ``model.check_ids = True`` (else a bad id is a device-side assert, as in any
    PyTorch model): check them on the host, where the data is made (:func:`check_batch`).
    Args:
        config (GPTConfig): the model's shape.

    Example:
        >>> logits, loss = GPT(GPTConfig())(*random_tokens(GPTConfig(), 2))
        >>> logits.shape, loss.dtype
        (torch.Size([2, 64, 256]), torch.float32)
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        config = check_config(config)
        self.config = config
        self.check_ids = False  # True: read the ids on a GPU (one host-device sync per forward)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The transformer blocks on ``(B, T, d_model)``; checkpointing replaces this per instance.
        Args:
            x (torch.Tensor): the embeddings, ``(B, T, d_model)``.
        Returns:
            torch.Tensor: the last block's output, ``x``'s shape.
        """
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                ignore_index: int = -100):
        """Logits of ``(B, T)`` int64 ids ``idx``; ``(logits, loss)`` with int64 ``targets``.
        Args:
            idx (torch.Tensor): ``(B, T)`` int64 (or int32) token ids, ``T <= config.seq_len``.
            targets (torch.Tensor, optional): int64 ids of ``idx``'s shape.
            ignore_index (int): a target id the loss skips.
        Returns:
            torch.Tensor or tuple: logits ``(B, T, vocab_size)``, or ``(logits, loss)``.
        Raises:
            ValueError: naming ``idx`` or ``targets``, for a wrong shape, dtype or id.
        """
        _check_tokens(self.config, idx, targets, ("idx", "targets"))
        vocab = self.config.vocab_size
        if self.check_ids:
            _check_ids(idx, targets, vocab, ignore_index)
        pos = torch.arange(idx.size(1), device=idx.device)
        try:
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        except IndexError:
            _check_ids(idx, None, vocab, ignore_index)
            raise
        logits = self.lm_head(self.ln_f(self.run_blocks(x)))
        if targets is None:
            return logits
        # The loss in at least fp32 (16-bit logits lose too much in log-softmax), fp64 kept as is.
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        try:
            loss = F.cross_entropy(wide.view(-1, wide.size(-1)), targets.view(-1),
                                   ignore_index=ignore_index)
        except (IndexError, RuntimeError):
            _check_ids(idx, targets, vocab, ignore_index)
            raise
        return logits, loss


def check_batch(model, inputs, targets, *, names: tuple = ("inputs", "targets"),
                ignore_index: int = -100) -> None:
    """Refuse a batch ``model(inputs, targets)`` cannot train on, naming the caller's parameters.

    Course GPT: ``(B, T)`` int64 (or int32) inputs, T <= ``config.seq_len``, int64 targets of
    that shape, ids in ``[0, vocab_size)`` (``ignore_index`` among targets; read only on the
    CPU). Any other module: two tensors with the same leading dimension.
    """
    x_name, y_name = names
    ignore_index = integer("ignore_index", ignore_index, minimum=-(2**63), maximum=2**63 - 1)
    tensor(x_name, inputs)
    tensor(y_name, targets)
    if not isinstance(model, GPT):
        if inputs.dim() == 0 or targets.dim() == 0 or inputs.size(0) != targets.size(0):
            raise ValueError(f"{x_name} and {y_name} must share their batch size (leading "
                             f"dimension), got shapes {tuple(inputs.shape)} and "
                             f"{tuple(targets.shape)}")
        return
    _check_tokens(model.config, inputs, targets, names)
    if inputs.device.type == "cpu" and targets.device.type == "cpu":
        _check_ids(inputs, targets, model.config.vocab_size, ignore_index, names)


def _check_tokens(config: GPTConfig, idx, targets, names: tuple) -> None:
    """Refuse ids (and targets) of a shape or dtype ``GPT(config)`` cannot take."""
    x_name, y_name = names
    B, T = tensor(x_name, idx, integral=True, dim=2).shape
    if T > config.seq_len:
        raise ValueError(f"sequence length {T} of {x_name} exceeds config.seq_len="
                         f"{config.seq_len}")
    if B == 0 or T == 0:  # the mean loss of no tokens would be NaN
        raise ValueError(f"{x_name} must hold at least one token, got shape {tuple(idx.shape)}")
    if idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{x_name} must hold int64 (or int32) token ids, got {idx.dtype}")
    if targets is not None:
        tensor(y_name, targets, integral=True)
        if targets.shape != idx.shape or targets.dtype != torch.int64:
            raise ValueError(f"{y_name} must be int64 of {x_name}'s shape {tuple(idx.shape)}, "
                             f"got {targets.dtype} of shape {tuple(targets.shape)}")


def _check_ids(idx, targets, vocab: int, ignore_index: int,
               names: tuple = ("idx", "targets")) -> None:
    """Refuse a token id outside ``[0, vocab)`` (``ignore_index`` allowed among the targets)."""
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"{names[0]} must hold token ids in [0, {vocab}), got ids from {low} to "
                         f"{high}")
    if targets is not None:
        kept = targets[targets != ignore_index]
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab):
            raise ValueError(f"{names[1]} must hold token ids in [0, {vocab}) or ignore_index "
                             f"({ignore_index}), got ids from {int(kept.min())} to "
                             f"{int(kept.max())}")


def check_config(config, name: str = "config") -> GPTConfig:
    """``config`` if it is a :class:`GPTConfig` (the check every function taking one makes)."""
    if not isinstance(config, GPTConfig):
        raise WrongTypeError(f"{name} must be a course_lib.model.gpt.GPTConfig, got "
                             f"{type(config).__name__}")
    return config


def gpt_param_count(config: GPTConfig) -> int:
    """Parameters of ``GPT(config)``, closed form: ``V*h + T*h + L*(12h^2 + 13h) + 2h``.

    Per layer: QKV ``3h^2 + 3h``, projection ``h^2 + h``, MLP ``8h^2 + 5h``, LayerNorms ``4h``;
    the head is tied to the embedding. Without biases: ``L*12h^2`` and LayerNorm weights only.
    Args:
        config (GPTConfig): the model's shape.
    Returns:
        int: the parameter count.

    Example:
        >>> gpt_param_count(GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12,
        ...                           n_layers=12))  # GPT-2 small
        124439808
    """
    return sum(param_numels(config))


#: The linear layers of a block, ``(name, in, out)`` in units of ``d_model``, in forward order:
#: the one place the block's shape is written.
BLOCK_SHAPES = (("attn.qkv", 1, 3), ("attn.proj", 1, 1), ("mlp.fc", 1, 4), ("mlp.proj", 4, 1))


def param_numels(config: GPTConfig) -> list[int]:
    """Elements of each parameter tensor of ``GPT(config)``, in ``model.parameters()`` order
    (embeddings, each block's LayerNorm 1, QKV, projection, LayerNorm 2, MLP, the final
    LayerNorm), by closed form, so that planners can call it thousands of times.
    Args:
        config (GPTConfig): the model's shape.
    Returns:
        list[int]: one count per parameter tensor.
    """
    h, bias = check_config(config).d_model, config.bias

    def linear(n_in, n_out):
        return [n_in * n_out] + ([n_out] if bias else [])

    norm = [h, h] if bias else [h]
    (qkv, proj, fc, out) = (linear(i * h, o * h) for _, i, o in BLOCK_SHAPES)
    block = [*norm, *qkv, *proj, *norm, *fc, *out]
    return [config.vocab_size * h, config.seq_len * h, *block * config.n_layers, *norm]


def random_tokens(config: GPTConfig, batch_size: int, seq_len: int | None = None, *,
                  seed: int = 0, device: torch.device | str = "cpu"):
    """``(inputs, targets)``: two ``(batch_size, seq_len)`` int64 tensors of random ids, the
    targets shifted by one as in language modelling (``seq_len`` defaults to the config's).
    Args:
        config (GPTConfig): the model the ids are for (``vocab_size``, ``seq_len``).
        batch_size (int): sequences, 1 to 2**20.
        seq_len (int, optional): tokens per sequence, at most ``config.seq_len``.
        seed (int): the generator's seed, 0 to :data:`MAX_SEED`.
        device (torch.device or str): where the tensors go.
    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(inputs, targets)``.
    Raises:
        ValueError: naming the argument, for a wrong type or a value out of range.

    Example:
        >>> x, y = random_tokens(GPTConfig(), 4, seed=1)
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([4, 64]), True)
    """
    check_config(config)
    batch_size = positive_int("batch_size", batch_size, maximum=2**20)
    T = config.seq_len if seq_len is None else positive_int("seq_len", seq_len,
                                                            maximum=config.seq_len)
    seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
    device = as_device("device", device)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (batch_size, T + 1), generator=g)
    # clone(): with one row, contiguous() would return views of one shared storage,
    # and memory measurements would count inputs and targets as one tensor.
    return data[:, :-1].clone().to(device), data[:, 1:].clone().to(device)
