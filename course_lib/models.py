"""The course GPT: a small, readable, nanoGPT-style decoder-only transformer.

Pre-LayerNorm blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` with a 4h GELU MLP,
learned position embeddings and a language-model head tied to the token
embedding (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners"; Karpathy's nanoGPT ``model.py``). It is the model that lectures 1-7
measure, so its structure is kept close to the one Korthikanti et al. (2022,
"Reducing Activation Recomputation in Large Transformer Models") count
activations for.

The attention is selectable because it changes activation memory:

* ``attention="explicit"``: ``softmax(QK^T / sqrt(d_head))`` written out, which
  keeps the ``n_heads * T * T`` score and probability matrices (and the dropout
  mask on them) for the backward pass, as in Korthikanti et al.'s count;
* ``attention="sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``,
  whose fused kernels recompute the scores in the backward pass and keep only
  ``O(T)`` statistics per head.

Hooks that later lectures use: ``GPT.blocks`` is an ``nn.ModuleList``,
``GPT.run_blocks(x)`` runs them (checkpointing replaces it per instance), and
``CausalSelfAttention.core(q, k, v)`` is the attention core alone (what
Megatron's "selective" recomputation recomputes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .validation import positive_int

ATTENTION_KINDS = ("explicit", "sdpa")


@dataclass
class GPTConfig:
    """Shape of a course GPT; every field is validated (``ValueError`` names the field)."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0
    attention: str = "sdpa"
    bias: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
            positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model must be divisible by n_heads, got d_model={self.d_model}, "
                             f"n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads, self.dropout, self.kind = config.n_heads, config.dropout, config.attention
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.attn_drop = nn.Dropout(config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``(B, heads, T, d_head)`` tensors: the part with T x T intermediates."""
        if self.kind == "sdpa":
            p = self.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return self.attn_drop(scores.softmax(dim=-1)) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer layer."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``model(idx)`` -> logits ``(B, T, vocab)``; ``model(idx, targets)`` -> ``(logits, loss)``.

    ``loss`` is the mean cross-entropy over target tokens that are not
    ``ignore_index`` (-100), as ``F.cross_entropy`` computes it.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
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
        """Run the transformer blocks; activation checkpointing replaces this per instance."""
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                ignore_index: int = -100):
        T = idx.size(1)
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds config.seq_len={self.config.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        logits = self.lm_head(self.ln_f(self.run_blocks(x)))
        if targets is None:
            return logits
        # The loss in at least fp32 (16-bit logits lose too much in log-softmax), fp64 kept as is.
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(wide.view(-1, wide.size(-1)), targets.view(-1),
                               ignore_index=ignore_index)
        return logits, loss


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once); works on ``meta``."""
    return sum(p.numel() for p in model.parameters())


def gpt_param_count(config: GPTConfig) -> int:
    """Closed form for :class:`GPT`: ``V*h + T*h + L*(12h^2 + 13h) + 2h`` with biases.

    Per layer: QKV ``3h^2 + 3h``, output projection ``h^2 + h``, MLP ``8h^2 + 5h``,
    two LayerNorms ``4h``; the head is tied to the embedding; the final LayerNorm
    adds ``2h``. Without biases: ``L*12h^2`` and LayerNorm weights only.
    """
    h, L = config.d_model, config.n_layers
    per_layer = 12 * h * h + (13 * h if config.bias else 2 * h)
    final_ln = 2 * h if config.bias else h
    return config.vocab_size * h + config.seq_len * h + L * per_layer + final_ln


def param_numels(config: GPTConfig) -> list[int]:
    """Elements of each parameter tensor of ``GPT(config)``, in ``model.parameters()`` order.

    Token and position embeddings (``V*h``, ``T*h``; the LM head is tied to the
    first), then per block LayerNorm 1 (``h``, ``h``), QKV (``3h*h``, ``3h``),
    out-projection (``h*h``, ``h``), LayerNorm 2, MLP (``4h*h``, ``4h``, ``4h*h``, ``h``),
    then the final LayerNorm. Biases only when ``config.bias``. Sums to
    :func:`gpt_param_count`; closed form, so planners can call it thousands of times.
    """
    h, bias = config.d_model, config.bias

    def linear(n_in, n_out):
        return [n_in * n_out] + ([n_out] if bias else [])

    norm = [h, h] if bias else [h]
    block = [*norm, *linear(h, 3 * h), *linear(h, h), *norm, *linear(h, 4 * h), *linear(4 * h, h)]
    return [config.vocab_size * h, config.seq_len * h, *block * config.n_layers, *norm]


def random_tokens(config: GPTConfig, batch_size: int, seq_len: int | None = None, *,
                  seed: int = 0, device: torch.device | str = "cpu"):
    """``(inputs, targets)`` of random token ids, shifted by one as in language modelling."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    T = config.seq_len if seq_len is None else seq_len
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (batch_size, T + 1), generator=g)
    # clone(): with one row, contiguous() would return views of one shared storage,
    # and memory measurements would count inputs and targets as one tensor.
    return data[:, :-1].clone().to(device), data[:, 1:].clone().to(device)
