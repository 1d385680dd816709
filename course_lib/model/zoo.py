"""01: published model shapes to count (the GPUs they are meant to fit on: :data:`course_lib.device.GPUS`).

:data:`PRESETS` holds GPT-2 (as the course :class:`~course_lib.model.gpt.GPT`) and Llama 2/3
(a Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, a SwiGLU MLP, no
biases; Touvron et al. 2023, Meta 2024) with the parameter counts their checkpoints report.
:func:`build_model` builds one on the ``meta`` device: shapes without storage, so that a 405B
model is counted in a second on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model.gpt import CONFIG_MAXIMUM, GPT, GPTConfig
from course_lib.validation import (
    WrongTypeError,
    available_device as as_device,
    boolean,
    number,
    positive_int,
    tensor,
)

#: The largest value of each size of a Llama config (the course GPT's maxima, and a SwiGLU
#: width of up to 2**20; Llama 3.1 405B has 53,248).
LLAMA_MAXIMUM = {**CONFIG_MAXIMUM, "n_kv_heads": CONFIG_MAXIMUM["n_heads"], "d_ff": 2**20}
#: The largest RoPE base a config takes, far above any published one (Llama 3: 500,000).
MAX_ROPE_BASE = 2.0**40


@dataclass(frozen=True)
class _LlamaConfig:
    """Shape of a Llama-style model; every field is validated (``ValueError`` names it)."""

    vocab_size: int = 256  # Llama 2: 32000, Llama 3: 128256
    d_model: int = 64  # Llama 2 7B: 4096
    n_layers: int = 2
    n_heads: int = 4  # d_model / n_heads must be even: rotary embeddings rotate pairs
    n_kv_heads: int = 2  # below n_heads: grouped-query attention, smaller K and V projections
    d_ff: int = 172  # SwiGLU hidden size (Llama 2 7B: 11008, about 8h/3)
    tie_embeddings: bool = False  # the head shares the embedding (Llama 3.2 1B and 3B)
    seq_len: int = 64  # the longest sequence forward takes (rotary: no parameter)
    rope_base: float = 10000.0  # Llama 2: 10000, Llama 3: 500000

    def __post_init__(self):
        for name, maximum in LLAMA_MAXIMUM.items():  # stored as ints, as GPTConfig stores them
            object.__setattr__(self, name, positive_int(name, getattr(self, name), maximum=maximum))
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model must be n_heads times an even head size, got "
                             f"d_model={self.d_model}, n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads must divide n_heads, got n_kv_heads={self.n_kv_heads}, "
                             f"n_heads={self.n_heads}")
        boolean("tie_embeddings", self.tie_embeddings)
        number("rope_base", self.rope_base, above=0.0, maximum=MAX_ROPE_BASE)

    @property
    def d_head(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads


def _rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of ``(B, heads, T, d_head)`` (Su et al. 2021), Hugging Face's "rotate half"."""
    T, d = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class _LlamaBlock(nn.Module):
    """``x + attn(norm(x))``, ``x + mlp(norm(x))``: GQA attention, SwiGLU MLP, RMSNorm, no biases."""

    def __init__(self, config: _LlamaConfig):
        super().__init__()
        self.config = config
        h, kv = config.d_model, config.n_kv_heads * config.d_head
        self.attn_norm = nn.RMSNorm(h, eps=1e-5)
        self.q, self.k, self.v = (nn.Linear(h, n, bias=False) for n in (h, kv, kv))
        self.o = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=1e-5)
        self.gate, self.up = (nn.Linear(h, config.d_ff, bias=False) for _ in range(2))
        self.down = nn.Linear(config.d_ff, h, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Causal grouped-query attention of ``x``."""
        c, (B, T, _) = self.config, x.shape
        q, k, v = (proj(x).view(B, T, -1, c.d_head).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        q, k = _rotate(q, c.rope_base), _rotate(k, c.rope_base)
        group = c.n_heads // c.n_kv_heads  # each key/value head serves `group` query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer applied to ``x``; the MLP is ``down(silu(gate(h)) * up(h))``."""
        x = x + self.attention(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _Llama(nn.Module):
    """``model(idx)`` -> logits; ``model(idx, targets)`` -> ``(logits, loss)``, as the course GPT;
    PyTorch's default initialisation: it is counted and measured, not trained."""

    def __init__(self, config: _LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(_LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=1e-5)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits of ``idx``, and the mean cross-entropy (in fp32) when ``targets`` are given."""
        if tensor("idx", idx, integral=True, dim=2).size(1) > self.config.seq_len:
            raise ValueError(f"sequence length {idx.size(1)} exceeds config.seq_len="
                             f"{self.config.seq_len}")
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss


def build_model(config, *, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The course GPT or Llama of ``config`` (a preset's ``config``) on ``device``.

    On ``"meta"`` (the default) parameters have shapes and dtypes but no storage: nothing is
    allocated, so 405B parameters are counted in about a second.
    Args:
        config (GPTConfig or LlamaConfig): the model's shape.
        device (str or torch.device): where the parameters live.
        dtype (torch.dtype): the parameters' floating-point dtype.
    Returns:
        nn.Module: the model.
    Raises:
        ValueError: naming the argument, for a wrong ``config``, ``device`` or ``dtype``.

    Example:
        >>> sum(p.numel() for p in build_model(PRESETS["Llama 3.1 8B"].config).parameters())
        8030261248
    """
    if not isinstance(config, GPTConfig | _LlamaConfig):
        raise WrongTypeError(f"config must be a GPTConfig or a LlamaConfig, got {config!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    device = as_device("device", device)
    with device:
        model = GPT(config) if isinstance(config, GPTConfig) else _Llama(config)
    return model.to(dtype)


@dataclass(frozen=True)
class _Preset:
    """A published model: its shape, its parameter count and where the count comes from."""

    name: str
    config: GPTConfig | _LlamaConfig
    published_params: int
    source: str


def _gpt2(d_model: int, n_layers: int, n_heads: int) -> GPTConfig:
    return GPTConfig(vocab_size=50257, seq_len=1024, d_model=d_model, n_heads=n_heads,
                     n_layers=n_layers)


def _llama(vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, tie=False) -> _LlamaConfig:
    return _LlamaConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                        n_kv_heads=n_kv_heads, d_ff=d_ff, tie_embeddings=tie, seq_len=4096)


_HF = "num_parameters() of the Hugging Face checkpoint"
#: Published models by name, with the exact parameter counts of their checkpoints.
PRESETS: dict[str, _Preset] = {p.name: p for p in (
    _Preset("GPT-2 124M", _gpt2(768, 12, 12), 124_439_808, f"{_HF} openai-community/gpt2"),
    _Preset("GPT-2 1.5B", _gpt2(1600, 48, 25), 1_557_611_200, f"{_HF} openai-community/gpt2-xl"),
    _Preset("Llama 3.2 1B", _llama(128256, 2048, 16, 32, 8, 8192, tie=True), 1_235_814_400,
            f"{_HF} meta-llama/Llama-3.2-1B"),
    _Preset("Llama 2 7B", _llama(32000, 4096, 32, 32, 32, 11008), 6_738_415_616,
            f"{_HF} meta-llama/Llama-2-7b-hf"),
    _Preset("Llama 3.1 8B", _llama(128256, 4096, 32, 32, 8, 14336), 8_030_261_248,
            f"{_HF} meta-llama/Llama-3.1-8B"),
    _Preset("Llama 2 70B", _llama(32000, 8192, 80, 64, 8, 28672), 68_976_648_192,
            f"{_HF} meta-llama/Llama-2-70b-hf"),
    _Preset("Llama 3.1 70B", _llama(128256, 8192, 80, 64, 8, 28672), 70_553_706_496,
            f"{_HF} meta-llama/Llama-3.1-70B"),
    _Preset("Llama 3.1 405B", _llama(128256, 16384, 126, 128, 8, 53248), 405_853_388_800,
            f"{_HF} meta-llama/Llama-3.1-405B"),
)}
