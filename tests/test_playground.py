"""The accumulation playground: settings, cache, and memory predicted against measured."""

import pytest
import torch

from course_lib import playground as pgm
from course_lib.models import GPT, GPTConfig, count_parameters
from course_lib.training import train

CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)


@pytest.fixture(scope="module")
def playground():
    return pgm.Playground(CFG, samples=32, lr=1e-2)


def test_effective_batch_and_steps():
    assert pgm.effective_batch(4, 8) == 32
    assert pgm.optimizer_steps(100, 4, 8) == 3
    with pytest.raises(ValueError, match="accumulation_steps"):
        pgm.effective_batch(4, 0)
    with pytest.raises(ValueError, match="samples"):
        pgm.optimizer_steps(0, 1, 1)


def test_resident_bytes_counts_weights_and_adam_state_once():
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    P = count_parameters(model)
    assert pgm.resident_bytes(model, opt) == 4 * P  # tied embedding counted once, no state yet
    x = torch.randint(0, 16, (2, 8))
    train(model, opt, [(x, x)], micro_batch_size=2)
    # + m and v (4 bytes each per parameter) + one step counter per parameter tensor
    n_tensors = len(list(model.parameters()))
    assert pgm.resident_bytes(model, opt) == 12 * P + 4 * n_tensors


def test_same_effective_batch_gives_the_same_curve_and_less_memory(playground):
    big = playground.run(4, 1)
    pieces = playground.run(1, 4)
    assert big.effective_batch == pieces.effective_batch == 4
    assert big.optimizer_steps == pieces.optimizer_steps == 8 == len(big.losses)
    assert big.samples_seen == tuple(range(4, 33, 4))
    assert max(abs(u - v) for u, v in zip(big.losses, pieces.losses)) < 1e-4
    assert pieces.measured_peak < big.measured_peak
    assert playground.cached(4, 1) is big and playground.run(4, 1) is big
    assert playground.cached(2, 2) is None


def test_memory_is_flat_in_k_and_predicted_by_the_engine(playground):
    one, two, four = playground.run(2, 1), playground.run(2, 2), playground.run(2, 4)
    assert two.measured_peak == four.measured_peak
    assert playground.predict_peak(2, 2) == playground.predict_peak(2, 4)
    assert one.predicted_peak == one.measured_peak               # one micro-batch: to the byte
    # from K = 2 on the engine bounds the pass's new gradients from above: a few bytes here
    assert 0 <= four.predicted_peak - four.measured_peak <= 0.005 * four.measured_peak
    # independent floor: 16 bytes per parameter of weights, gradients and AdamW's m and v
    assert four.measured_peak > 16 * count_parameters(GPT(CFG))


def test_checkpointing_lowers_the_peak_and_keeps_the_curve(playground):
    plain, ckpt = playground.run(4, 2), playground.run(4, 2, True)
    assert ckpt.measured_peak < plain.measured_peak
    assert playground.predict_peak(4, 2, True) < playground.predict_peak(4, 2)
    assert ckpt.measured_peak <= ckpt.predicted_peak              # an upper bound from K = 2 on
    assert max(abs(u - v) for u, v in zip(plain.losses, ckpt.losses)) < 1e-5


def test_on_step_reports_every_optimizer_step():
    seen = []
    run = pgm.Playground(CFG, samples=16).run(2, 2, on_step=lambda step, loss: seen.append((step, loss)))
    assert [step for step, _ in seen] == [1, 2, 3, 4]
    assert tuple(loss for _, loss in seen) == run.losses


def test_bad_settings(playground):
    with pytest.raises(ValueError, match="two optimizer steps"):
        playground.run(16, 2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        playground.run(0, 2)
    with pytest.raises(ValueError, match="config"):
        pgm.Playground({"d_model": 8})
    with pytest.raises(ValueError, match="lr"):
        pgm.Playground(CFG, lr=0)
