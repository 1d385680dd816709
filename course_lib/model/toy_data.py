"""03: a toy language whose best possible loss is known exactly, for the lectures' training runs.

:func:`markov_tokens` walks a random Markov chain in which each token has ``branching`` equally
likely successors: a small GPT learns it in a few hundred steps, and no model beats
``ln(branching)`` nats per token (:func:`markov_entropy`), a floor random tokens do not give.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from course_lib.model.gpt import MAX_SEED
from course_lib.validation import MAX_COUNT, available_device as as_device, integer, positive_int

#: The longest sequence, and the most tokens, one call makes (each token is one step of a
#: Python loop over the batch: 2**26 tokens take a few seconds).
MAX_SEQ_LEN, MAX_TOKENS = 2**17, 2**26
#: Successors per token at most; and up to this vocabulary, one random permutation per token
#: (the course's languages).
MAX_BRANCHING, SMALL_VOCAB = 1024, 4096
#: Above :data:`SMALL_VOCAB`, up to this many successors drawn independently; more, and each
#: token's successors are an arithmetic progression (no vocab x branching table to draw).
FEW_SUCCESSORS = 16


def markov_tokens(n_sequences: int, seq_len: int, vocab_size: int = 64, *, branching: int = 2,
                  seed: int = 0, device: torch.device | str = "cpu"):
    """``(inputs, targets)`` sampled from a random Markov chain: a toy language a small GPT can learn.

    Each token has ``branching`` equally likely successors (drawn once from ``seed``): the best
    loss is ``ln(branching)`` nats per token (:func:`markov_entropy`), against ``ln(vocab_size)``
    for a model that knows nothing. Two ``(n_sequences, seq_len)`` int64 tensors, ``targets[:, t]``
    the token after ``inputs[:, t]``.
    Args:
        n_sequences, seq_len (int): the shape of each tensor.
        vocab_size, branching (int): tokens in the language; successors of each (<= vocab_size).
        seed (int): draws the chain and the walks.
        device (torch.device or str): where the tensors go.
    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(inputs, targets)``.
    Raises:
        ValueError: naming the argument, for a wrong type or a value out of range.

    Example:
        >>> x, y = markov_tokens(2, 8, vocab_size=16, seed=0)
        >>> x
        tensor([[12, 11,  7,  4,  2, 13, 12, 11],
                [ 9,  6, 14, 12, 11,  7,  4,  2]])
        >>> y[0]
        tensor([11,  7,  4,  2, 13, 12, 11,  3])
    """
    n_sequences = positive_int("n_sequences", n_sequences, maximum=2**24)
    seq_len = positive_int("seq_len", seq_len, maximum=MAX_SEQ_LEN)
    vocab_size = positive_int("vocab_size", vocab_size, maximum=2**18)
    if n_sequences * seq_len > MAX_TOKENS:
        raise ValueError(f"n_sequences * seq_len must be at most {MAX_TOKENS:,} tokens, got "
                         f"{n_sequences} x {seq_len}")
    branching = positive_int("branching", branching, maximum=min(vocab_size, MAX_BRANCHING))
    seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
    device = as_device("device", device)
    g = torch.Generator().manual_seed(seed)
    if vocab_size <= SMALL_VOCAB:  # the course's languages: one permutation per token
        table = torch.stack([torch.randperm(vocab_size, generator=g)[:branching].clone()
                             for _ in range(vocab_size)])
    elif branching <= FEW_SUCCESSORS:  # GPT-2's 50,257 and the like: independent draws, each
        # row redrawn while it repeats a token (rare with this few successors: a few rounds)
        table = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        rows = torch.arange(vocab_size)
        while len(rows := rows[_repeats(table[rows])]):
            table[rows] = torch.randint(0, vocab_size, (len(rows), branching), generator=g)
    else:  # many successors of a large vocabulary, where redrawing rows would take hours and a
        # table gigabytes: token i's successors are start[i] + j * stride[i] (mod vocab_size),
        # j < branching, distinct because each stride is coprime with vocab_size
        units = torch.arange(1, vocab_size)
        units = units[torch.gcd(units, torch.tensor(vocab_size)) == 1]
        start = torch.randint(0, vocab_size, (vocab_size,), generator=g).numpy()
        stride = units[torch.randint(0, len(units), (vocab_size,), generator=g)].numpy()
        table = None
    first = torch.randint(0, vocab_size, (n_sequences,), generator=g).numpy()
    choices = torch.randint(0, branching, (n_sequences, seq_len), generator=g).numpy()
    # The walk in numpy, one step per position and time-major so that a step writes one
    # contiguous row: several times quicker than in torch, whose per-call overhead dominates.
    choices = np.ascontiguousarray(choices.T, dtype=np.int16)
    table = None if table is None else table.flatten().numpy()
    walk = np.empty((seq_len + 1, n_sequences), dtype=np.int64)
    walk[0] = token = first
    for t in range(seq_len):
        walk[t + 1] = token = (table[token * branching + choices[t]] if table is not None
                               else (start[token] + choices[t] * stride[token]) % vocab_size)
    tokens = torch.from_numpy(walk).T
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def _repeats(rows: torch.Tensor) -> torch.Tensor:
    """Which rows of a 2-D tensor hold a value twice."""
    ordered = rows.sort(dim=1).values
    return (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)


def markov_entropy(branching: int = 2) -> float:
    """The loss floor of :func:`markov_tokens`: ``ln(branching)`` nats per token (Shannon 1948).

    Args:
        branching (int): successors per token.
    Returns:
        float: the entropy in nats per token.
    Raises:
        ValueError: for a ``branching`` that is not an int from 1 to :data:`MAX_COUNT`.

    Example:
        >>> markov_entropy(2)  # ln 2
        0.6931...
    """
    return math.log(positive_int("branching", branching, maximum=MAX_COUNT))
