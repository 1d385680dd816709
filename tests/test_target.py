"""course_lib.prediction.target: a precision and a GPU resolved once, and the device's rules."""

import pytest
import torch

from course_lib.device import GPUS
from course_lib.model import kernels
from course_lib.model.gpt import GPTConfig
from course_lib.prediction.formulas import PRECISION
from course_lib.prediction.target import Target


@pytest.mark.parametrize("name", list(PRECISION))
def test_a_precision_gives_its_compute_dtype_and_autocast(name):
    spec = PRECISION[name]
    t = Target.of(name, "A100 80GB")
    assert (t.compute, t.autocast, t.precision, t.gpu) == (spec.compute, spec.autocast, spec,
                                                          GPUS["A100 80GB"])
    # autocast runs a 16-bit compute over an fp32 stream; otherwise the stream is the compute
    assert t.stream == (torch.float32 if spec.autocast else spec.compute)


def test_the_device_rules_are_the_kernels_modules():
    cpu, t4 = Target.resolve(torch.float16), Target.of("autocast-fp16", "T4")
    assert cpu.gpu is None and cpu.precision is None
    assert (cpu.mask(torch.float16), t4.mask(torch.float16)) == (torch.float16, torch.bool)
    assert (cpu.allocated(1), t4.allocated(1), t4.allocated(513)) == (1, 512, 1024)
    assert t4.stats == torch.float32  # LayerNorm's statistics of an fp32 stream
    config = GPTConfig(n_layers=1)
    assert t4.attention_kernel(config) == kernels.attention_kernel(config, torch.float16, "T4")


@pytest.mark.parametrize("call,match", [
    (lambda: Target.of("fp8"), "precision"),
    (lambda: Target.of("fp32", "V100"), "gpu"),
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
    act.model_saved(config, 2, gpu="A100 80GB")
    assert len(calls) == 1
