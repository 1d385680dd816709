"""course_lib.prediction.step and .predict: one value made and checked once, one entry that
predicts its memory and time; the levers' closed forms against counts made by hand."""

import dataclasses
from dataclasses import replace

import pytest
import torch

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig, gpt_param_count, param_numels
from course_lib.prediction import time_model
from course_lib.prediction.activations import block_saved
from course_lib.prediction.formulas import PRECISION
from course_lib.prediction.predict import Prediction, Step, predict

GPT2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=2)


def test_a_step_is_resolved_once_and_a_replaced_field_is_checked_again():
    step = Step(SMALL, 4, gpu="T4")
    assert step.gpu is GPUS["T4"] and step.seq_len == 32 and step.batch_size == 4
    assert replace(step, accumulation_steps=3).batch_size == 12
    assert Step(SMALL, 4, gpu="T4") == step and hash(Step(SMALL, 4, gpu="T4")) == hash(step)
    with pytest.raises(ValueError, match="micro_batch_size"):
        replace(step, micro_batch_size=0)
    with pytest.raises(ValueError, match="seq_len"):
        replace(step, seq_len=33)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.micro_batch_size = 8


@pytest.mark.parametrize("name", list(PRECISION))
def test_a_step_carries_its_precisions_dtypes(name):
    step, spec = Step(SMALL, precision=name, gpu="A100 80GB"), PRECISION[name]
    assert (step.compute, step.autocast) == (spec.compute, spec.autocast)
    # autocast runs a 16-bit compute over an fp32 stream; otherwise the stream is the compute
    assert step.stream == (torch.float32 if spec.autocast else spec.compute)


def test_a_step_carries_its_devices_rules():
    cpu, t4 = Step(SMALL, precision="fp16-mixed"), Step(SMALL, precision="autocast-fp16", gpu="T4")
    assert (cpu.mask(torch.float16), t4.mask(torch.float16)) == (torch.float16, torch.bool)
    assert (cpu.stats, t4.stats) == (torch.float16, torch.float32)  # LayerNorm's statistics


@pytest.mark.parametrize("kwargs,match", [
    (dict(gpu="V100"), "gpu"), (dict(dtype=torch.int64), "dtype"),
    (dict(autocast=True), "autocast"), (dict(dtype=torch.float16, autocast=1), "autocast"),
])
def test_the_counts_name_a_bad_dtype_or_device(kwargs, match):
    with pytest.raises(ValueError, match=match):
        block_saved(SMALL, 2, **kwargs)


@pytest.mark.parametrize("call, kind", [
    (lambda: Step({"n_layers": 2}), TypeError), (lambda: Step(SMALL, 2.0), TypeError),
    (lambda: Step(SMALL, True), TypeError), (lambda: Step(SMALL, precision=16), ValueError),
    (lambda: predict((SMALL, 4)), TypeError), (lambda: predict(Step(SMALL), "T4"), TypeError)])
def test_a_wrong_type_is_a_type_error(call, kind):
    with pytest.raises(kind):
        call()


def test_the_prediction_reads_the_step_moment_by_moment():
    p = predict(Step(SMALL, 4, 2, precision="bf16-mixed", mode="blocks", gpu="T4"))
    assert isinstance(p, Prediction) and p.step.accumulation_steps == 2
    assert list(p.phases) == ["between steps", *p.moments]
    assert p.phases["between steps"] == p.moments["optimizer"].model_states  # steady state
    assert p.total == max(m.total for m in p.moments.values()) == max(p.phases.values())
    assert p.peak is max(p.moments.values(), key=lambda m: m.total)
    first = predict(Step(SMALL, 4, first_step=True))
    assert first.phases["between steps"] == first.peak.parameters  # no m and v before it


def test_the_time_is_computed_when_asked_with_the_stated_speed():
    step = Step(GPT2, 8, gpu="A100 80GB")
    sheet = time_model.device_speed("A100 80GB")
    assert predict(step).time == predict(step, sheet).time  # a preset's speed is its datasheet
    slow = replace(sheet, utilisation=0.2)
    t, u = predict(step, sheet).time, predict(step, slow).time
    # only the matmuls slow down, in proportion to the share of the peak reached
    assert u.compute_seconds == pytest.approx(t.compute_seconds * t.utilisation / 0.2)
    assert u.seconds - u.compute_seconds == pytest.approx(t.seconds - t.compute_seconds)


def test_the_chunked_loss_and_lora_add_their_flops_counted_by_hand():
    step = Step(GPT2, 8, gpu="T4")
    N, h, V, L = 8 * 1024, 768, 50257, 12
    plain = predict(step).time.flops
    assert predict(replace(step, loss_chunk=1024)).time.flops - plain == 2 * N * h * V
    r = 8
    adapters = L * r * (h + 3 * h + h + h + h + 4 * h + 4 * h + h)  # r (in + out) per linear
    frozen = 2 * N * (L * 12 * h * h + h * V)  # the weight gradients a frozen model skips
    assert predict(replace(step, lora_rank=r)).time.flops - plain == 6 * N * adapters - frozen


def test_the_levers_change_the_categories_they_name():
    step = Step(GPT2, 4, precision="bf16-mixed", gpu="A100 80GB")
    plain = predict(step).moments["optimizer"]
    P = gpt_param_count(GPT2)
    assert plain.master_weights == 4 * P and plain.optimizer_state >= 8 * P
    for N in (2, 8):  # ZeRO 1 and 2 divide the states, then the gradients (Rajbhandari 2020)
        z1 = predict(replace(step, zero_stage=1, world_size=N)).moments["optimizer"]
        assert z1.optimizer_state == -(-plain.optimizer_state // N)
        assert z1.master_weights == -(-plain.master_weights // N)
        z2 = predict(replace(step, zero_stage=2, world_size=N)).moments["optimizer"]
        assert z2.gradients == -(-plain.gradients // N)
    off = predict(replace(step, offload_optimizer=True)).moments["optimizer"]
    assert off.optimizer_state == off.master_weights == off.transient == 0
    r = 16
    lora = predict(replace(step, lora_rank=r)).moments["optimizer"]
    trainable = 16 * 768 * r * 12
    assert lora.master_weights == 4 * trainable
    assert lora.parameters == plain.parameters + 2 * trainable  # the frozen base and the adapters
    inb = predict(replace(step, in_backward=True))
    assert inb.moments["optimizer"].gradients == 2 * max(param_numels(GPT2))
    eight = predict(replace(step, state_bits=8)).moments["optimizer"].optimizer_state
    assert 2.0 * P < eight < 2.2 * P  # 1 byte per value, 2 states, fp32 block scales, counters
