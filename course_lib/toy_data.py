"""03: a toy language whose best possible loss is known exactly, for the lectures' training runs.

:func:`markov_tokens` samples sequences from a random Markov chain in which
each token has ``branching`` equally likely successors. A small GPT learns it
in a few hundred steps, and no model can do better than ``ln(branching)`` nats
per token (:func:`markov_entropy`): a training curve has a floor to aim at,
which random tokens (``course_lib.models.random_tokens``, a floor of
``ln(vocab_size)``, nothing to learn) do not give.
"""

from __future__ import annotations

import math

import torch

from .models import MAX_SEED
from .validation import MAX_COUNT, integer, positive_int
from .validation import device as as_device


def markov_tokens(n_sequences: int, seq_len: int, vocab_size: int = 64, *, branching: int = 2,
                  seed: int = 0, device: torch.device | str = "cpu"):
    """``(inputs, targets)`` sampled from a random Markov chain: a toy language a small GPT can learn.

    Each token has ``branching`` possible successors (drawn once from ``seed``),
    each equally likely, so the best achievable loss is ``ln(branching)`` nats
    per token (:func:`markov_entropy`), against ``ln(vocab_size)`` for a model
    that knows nothing. Shapes ``(n_sequences, seq_len)``, targets shifted by one.

    Args:
        n_sequences (int): sequences, an int from 1 to 2**24.
        seq_len (int): tokens per sequence, from 1 to 2**20.
        vocab_size (int): tokens of the language, from 1 to 2**16.
        branching (int): successors per token, from 1 to ``vocab_size``.
        seed (int): an int in ``[0, 2**63 - 1]``.
        device (torch.device or str): where the tensors go (``"cpu"``, ``"cuda"``, a
            ``torch.device``).

    Returns:
        ``(inputs, targets)``, two ``(n_sequences, seq_len)`` int64 tensors;
        ``targets[:, t]`` is the token after ``inputs[:, t]``.

    Raises:
        ValueError: naming the parameter, for a bad value (a bool, a float, out of range,
            ``device="gpu"``).

    Example::

        x, y = markov_tokens(64, 32, vocab_size=64, branching=2, seed=0)
    """
    for name, value, maximum in (("n_sequences", n_sequences, 2**24), ("seq_len", seq_len, 2**20),
                                 ("vocab_size", vocab_size, 2**16)):
        positive_int(name, value, maximum=maximum)
    positive_int("branching", branching, maximum=vocab_size)
    seed = integer("seed", seed, minimum=0, maximum=MAX_SEED)
    device = as_device("device", device)
    g = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab_size, generator=g)[:branching]
                              for _ in range(vocab_size)])
    tokens = torch.empty(n_sequences, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (n_sequences,), generator=g)
    choices = torch.randint(0, branching, (n_sequences, seq_len), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def markov_entropy(branching: int = 2) -> float:
    """The loss floor of :func:`markov_tokens`: ``ln(branching)`` nats per token.

    The entropy of a uniform choice among ``branching`` successors (Shannon 1948);
    the cross-entropy of any model on this language is at least that.

    Args:
        branching (int): successors per token, an int from 1 to 2**40.

    Returns:
        ``ln(branching)``, in nats per token (a float).

    Raises:
        ValueError: if ``branching`` is not a positive int.

    Example::

        markov_entropy(2)  # 0.693... = ln 2
    """
    return math.log(positive_int("branching", branching, maximum=MAX_COUNT))
