"""course_lib.views.activation_views: lecture 02's threshold against a brute-force search with the engine,
and its figures and widget laid out so that nothing hides the bars."""

import dataclasses

import pytest
import torch
from matplotlib.figure import Figure

from course_lib.device import GPU, GPUS
from course_lib.measurement.memory import step_breakdown, training_step
from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.prediction.predict import Step, predict
from course_lib.units import GiB
from course_lib.views import activation_views as views

GPT2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12,
                 dropout=0.1, attention="sdpa")


def _brute_force(config, gpu, precision, capacity, foreach):
    b = 0
    while predict(Step(config, b + 1, precision=precision, gpu=gpu,
                       foreach=foreach)).total <= capacity:
        b += 1
    return b


@pytest.mark.parametrize("precision, kernel", [("fp16-mixed", "efficient"), ("bf16-mixed", "math")])
def test_the_t4_threshold_is_the_largest_batch_the_engine_fits(precision, kernel):
    t = views.oom_threshold(Step(GPT2, 8, precision=precision, gpu="T4"))
    t4 = GPUS["T4"]
    assert t.kernel == kernel
    # AdamW as PyTorch runs it on a GPU (foreach), against what PyTorch reports
    assert t.largest == _brute_force(GPT2, "T4", precision, t4.total_memory, True)
    assert t.memory[t.largest - 1].total <= t4.total_memory < t.memory[t.oom - 1].total
    assert len(t.memory) == 16 and t.oom == t.largest + 1
    parts = t.parts_at_largest  # what the peak's bytes are, the model's states at most 16 B/param
    assert list(parts) == ["activations", "in flight", "model states"]
    assert 0 < sum(parts.values()) <= t.memory[t.largest - 1].total
    assert parts["model states"] <= 16 * 124_439_808


def test_the_committed_thresholds_of_lecture_02():
    """GPT-2 small at 1,024 tokens on a T4 (PyTorch's 14.58 GiB): 14 sequences in fp16-mixed,
    5 in bf16-mixed, whichever AdamW implementation."""
    for foreach in (False, True):
        for precision, largest in (("fp16-mixed", 14), ("bf16-mixed", 5)):
            step = Step(GPT2, precision=precision, gpu="T4", foreach=foreach)
            assert views.oom_threshold(step).largest == largest


def test_the_capacity_is_the_cards_free_memory_on_a_live_card():
    small = GPU("small card", GiB, (7, 5), smi_memory=15360 * 2**20)
    t = views.oom_threshold(Step(GPT2, gpu=small))
    assert t.largest == 0 and t.oom == 1 and len(t.memory) == 16
    live = GPU("this card", 16 * GiB, (8, 0), free_memory=10 * GiB, live=True)
    t = views.oom_threshold(Step(GPT2, 20, precision="fp16-mixed", gpu=live))
    assert t.largest == _brute_force(GPT2, live, "fp16-mixed", 10 * GiB, True) < 20
    assert len(t.memory) == 32  # enough for the outlined batch


def test_bad_threshold_arguments():
    with pytest.raises(ValueError, match="gpu must name a GPU"):
        views.oom_threshold(Step(GPT2))
    with pytest.raises(TypeError, match="step must be"):
        views.oom_threshold(GPT2)
    with pytest.raises(TypeError, match="title must be"):
        views.oom_threshold(Step(GPT2, gpu="T4")).figure(title=3)


def _disjoint(a, b) -> bool:
    return a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0


def test_the_threshold_figure_keeps_its_legend_and_labels_off_the_bars():
    t = views.oom_threshold(Step(GPT2, 8, precision="fp16-mixed", gpu="T4"))
    fig = t.figure(title="GPT-2 small")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(renderer)
    assert _disjoint(legend, ax.get_window_extent(renderer))  # beside the plot, not on it
    assert legend.x1 <= fig.bbox.x1  # and inside the figure
    texts = {t.get_text(): t for t in ax.texts if t.get_text()}
    assert "T4: 14.58 GiB as PyTorch reports it (nvidia-smi: 15,360 MiB)" in texts
    assert "out of memory from batch 15" in texts
    a, b = (texts[k].get_window_extent(renderer) for k in texts)
    assert _disjoint(a, b)
    top = max(m.total for m in t.memory) / GiB  # the OOM label sits above every bar
    oom = texts["out of memory from batch 15"]
    assert ax.transData.inverted().transform((0, oom.get_window_extent(renderer).y0))[1] > top
    assert all(t.get_fontsize() >= 8 for t in fig.findobj(lambda o: hasattr(o, "get_fontsize")))


def test_the_widget_redraws_for_every_control():
    box = views.oom_widget()
    assert set(box.controls) == {"gpu", "width", "layers", "seq", "attention", "precision",
                                 "foreach", "batch"}
    seen = {box.image.value}
    for name, value in [("precision", "bf16-mixed"), ("gpu", "A100 80GB"), ("width", "1600 (GPT-2 XL)"),
                        ("layers", 40), ("seq", 2048), ("attention", "explicit"),
                        ("foreach", False), ("batch", 50)]:
        box.controls[name].value = value
        assert box.image.layout.display is None, name  # a figure, not an error message
        seen.add(box.image.value)
    assert len(seen) == 9
    verdict = box.artists["verdict"].get_text()
    assert verdict.startswith(("batch 50 does NOT fit", "not even batch 1 fits"))


def test_the_widget_draws_enough_batches_for_the_threshold():
    assert views._shown(8, 15) == 16 and views._shown(8, 40) == 64 and views._shown(64, 2) == 64
    assert views._shown(1, 10_000) == views._MAX_SHOWN


def test_the_widget_rejects_bad_arguments():
    for kwargs, name in [(dict(gpu="P100"), "gpu"), (dict(precision="fp8"), "precision"),
                         (dict(batch=0), "batch")]:
        with pytest.raises(ValueError, match=name):
            views.oom_widget(**kwargs)


def test_scaling_and_step_figures():
    fig = views.scaling_figure([1, 2], [10, 10], [5, 10], [8, 16], {"a": [1, 4], "b": [1, 2]})
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    assert views.show(fig).data[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="activations"):
        views.scaling_figure([1, 2], [10, 10], [5], [8, 16], {"a": [1, 4]})
    with pytest.raises(ValueError, match="curves"):
        views.scaling_figure([1, 2], [10, 10], [5, 10], [8, 16], {})
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x, y = random_tokens(cfg, 2)
    training_step(model, opt, x, y)
    steps = {"one": step_breakdown(model, opt, x, y), "two": step_breakdown(model, opt, x, y)}
    fig = views.step_figure(steps)
    assert [ax.get_title() for ax in fig.axes] == ["one", "two"]
    with pytest.raises(ValueError, match="steps"):
        views.step_figure({"one": dataclasses.asdict(steps["one"])})
    with pytest.raises(ValueError, match="fig"):
        views.show("a figure")
