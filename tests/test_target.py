"""course_lib.prediction.target: a precision and a GPU resolved once, and the device's rules."""

import pytest
import torch

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig
from course_lib.prediction.formulas import PRECISION
from course_lib.prediction.target import Target


@pytest.mark.parametrize("name", list(PRECISION))
def test_a_precision_gives_its_compute_dtype_and_autocast(name):
    spec = PRECISION[name]
    t = Target.resolve(spec.compute, "A100 80GB", spec.autocast)
    assert (t.compute, t.autocast, t.gpu) == (spec.compute, spec.autocast, GPUS["A100 80GB"])
    # autocast runs a 16-bit compute over an fp32 stream; otherwise the stream is the compute
    assert t.stream == (torch.float32 if spec.autocast else spec.compute)


def test_the_device_rules_are_the_kernels_modules():
    cpu, t4 = Target.resolve(torch.float16), Target.resolve(torch.float16, "T4", autocast=True)
    assert cpu.gpu is None
    assert (cpu.mask(torch.float16), t4.mask(torch.float16)) == (torch.float16, torch.bool)
    assert t4.stats == torch.float32  # LayerNorm's statistics of an fp32 stream


@pytest.mark.parametrize("call,match", [
    (lambda: Target.resolve(torch.float32, "V100"), "gpu"),
    (lambda: Target.resolve(torch.int64), "dtype"),
    (lambda: Target.resolve(torch.float32, autocast=True), "autocast"),
    (lambda: Target.resolve(torch.float16, autocast=1), "autocast"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_public_entry_resolves_its_target_once(monkeypatch):
    """Inside, the items are built from the target resolved at the entry (``*_items(config, b, s,
    t)``), not by public functions that would resolve it again."""
    from course_lib.prediction import activations as act, checkpointed

    calls = []
    resolve = Target.resolve.__func__
    monkeypatch.setattr(Target, "resolve", classmethod(
        lambda cls, *a, **k: calls.append(a) or resolve(cls, *a, **k)))
    config = GPTConfig(n_layers=3, dropout=0.1)
    checkpointed.kept_layout(config, 2, "blocks", 1, None, None, torch.bfloat16, "T4", True)
    assert len(calls) == 1
    calls.clear()
    act.predict_saved_bytes(config, 2, gpu="A100 80GB")
    assert len(calls) == 1
