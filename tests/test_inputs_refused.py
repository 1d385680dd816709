"""Inputs that used to give a number, keep state, or break later: each refused at once, with a
ValueError naming the caller's parameter, and nothing changed by the refused call."""

import numpy as np
import pytest
import torch

from course_lib.model.gpt import GPT, GPTConfig
from course_lib.prediction import formulas
from course_lib.training import loop
from course_lib.validation import number

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)


@pytest.mark.parametrize("stage", [1.0, True, np.bool_(True), torch.tensor(True), "1", 4, -1])
def test_zero_stage_is_an_int_from_0_to_3(stage):
    with pytest.raises(ValueError, match="zero_stage"):
        formulas.training_memory(1000, zero_stage=stage, world_size=2)


def test_zero_stage_takes_numpy_and_torch_ints():
    want = formulas.training_memory(1000, zero_stage=2, world_size=4).total
    for stage in (np.int64(2), torch.tensor(2)):
        assert formulas.training_memory(1000, zero_stage=stage, world_size=4).total == want


@pytest.mark.parametrize("targets, match", [(None, "targets"), (torch.zeros(3), "one target")])
def test_batches_need_a_target_per_sample(targets, match):
    with pytest.raises(ValueError, match=match):
        loop.batches_of(torch.zeros(4, 8), targets, 2)


def test_a_refused_on_step_changes_no_weight():
    torch.manual_seed(0)
    model = GPT(CFG)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="on_step"):
        loop.train(model, torch.optim.SGD(model.parameters(), lr=1.0),
                       [(x, x), (x, x)], micro_batch_size=4, on_step="x")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_numbers_beyond_float_are_a_value_error(value):
    with pytest.raises(ValueError, match="lr must be a finite number"):
        number("lr", value)


def test_toy_language_on_gpt2s_vocabulary_is_quick_and_sizes_have_a_maximum():
    import time

    from course_lib.model.toy_data import markov_tokens

    start = time.perf_counter()
    x, y = markov_tokens(2, 16, 50257, branching=4)
    assert time.perf_counter() - start < 5 and int(x.max()) < 50257
    assert torch.equal(x[:, 1:], y[:, :-1])
    for kwargs, name in ((dict(vocab_size=2**19), "vocab_size"), (dict(seq_len=2**18), "seq_len"),
                         (dict(n_sequences=2**20, seq_len=2**7), "n_sequences"),
                         (dict(branching=2000, vocab_size=4096), "branching")):
        with pytest.raises(ValueError, match=name):
            markov_tokens(**{"n_sequences": 1, "seq_len": 8, **kwargs})


@pytest.mark.parametrize("kwargs", [dict(repeats=10**9), dict(warmup=10**9)])
def test_step_times_runs_have_a_maximum(kwargs):
    from course_lib.measurement.timing import step_times

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        step_times({"a": lambda: None}, **kwargs)


@pytest.mark.parametrize("name", ["predict_kept_bytes", "checkpoint_cost"])
def test_a_misspelt_keyword_is_a_type_error_not_the_default(name):
    from course_lib.prediction import checkpointed

    fn = getattr(checkpointed, name)
    with pytest.raises(TypeError, match="dtyp"):
        fn(CFG, 2, dtyp=torch.bfloat16)
    # spelt right, the keyword is used, not ignored
    assert fn(CFG, 2, dtype=torch.bfloat16) != fn(CFG, 2)
