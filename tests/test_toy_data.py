"""The toy language of the training runs: a Markov chain with a known loss floor."""

import math

import pytest
import torch

from course_lib.model.toy_data import markov_entropy, markov_tokens


def test_markov_tokens_follow_their_chain_and_entropy():
    x, y = markov_tokens(64, 16, 10, branching=3, seed=1)
    assert x.shape == y.shape == (64, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    successors = {}
    for a, b in zip(x.flatten().tolist(), y.flatten().tolist()):
        successors.setdefault(a, set()).add(b)
    assert all(len(s) <= 3 for s in successors.values())
    assert markov_entropy(3) == pytest.approx(math.log(3))
    assert torch.equal(markov_tokens(4, 5, seed=2)[0], markov_tokens(4, 5, seed=2)[0])


def test_bad_inputs_name_the_parameter():
    with pytest.raises(ValueError, match="branching"):
        markov_tokens(2, 4, 4, branching=5)
    with pytest.raises(ValueError, match="branching"):
        markov_entropy(0)
