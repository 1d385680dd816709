"""course_lib.views.ladder_view: lecture 08's opening figure, the ladder's chart and its widget."""

import pytest

from course_lib.device import GPUS
from course_lib.model.gpt import GPTConfig
from course_lib.planning import fit_ladder
from course_lib.prediction.predict import Step, predict
from course_lib.units import GiB, MiB, format_bytes
from course_lib.views import ladder_view

GPT2 = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t.get_text() for t in fig.texts]


# A T4 as PyTorch reports it (14.58 GiB) and as nvidia-smi does (15,360 MiB)
T4_LABEL = f"T4: {GPUS['T4'].total_memory / GiB:.2f} GiB as PyTorch reports it (nvidia-smi: 15,360 MiB)"


def test_peak_parts_stack_to_the_peak_and_label_the_card():
    peak = predict(Step(GPT2, 8, gpu="T4")).peak
    fig = ladder_view.peak_parts_figure({"GPT-2 small": peak}, "T4")
    ax = fig.axes[0]
    right_edge = max(p.get_x() + p.get_width() for p in ax.patches)
    assert right_edge == pytest.approx(peak.total / GiB)
    assert ax.lines[0].get_xdata()[0] == pytest.approx(GPUS["T4"].total_memory / GiB)
    assert T4_LABEL in " ".join(_texts(fig))
    assert len(ax.get_legend().get_texts()) == len(ladder_view._PARTS)
    with pytest.raises(ValueError, match="jobs"):
        ladder_view.peak_parts_figure({}, "T4")
    with pytest.raises(ValueError, match="jobs"):
        ladder_view.peak_parts_figure({"x": 1}, "T4")
    with pytest.raises(ValueError, match="gpu"):
        ladder_view.peak_parts_figure({"GPT-2 small": peak}, "V100")


def test_the_ladder_chart_draws_each_rung_its_rank_and_the_labelled_budget():
    result = fit_ladder.ladder(GPT2, "T4", batch_size=32)
    fig = ladder_view.ladder_figure(result, "GPT-2 small")
    ax = fig.axes[0]
    widths = [bar.get_x() + bar.get_width() for bar in ax.patches[:1 + len(result.listed)]]
    assert widths[0] == pytest.approx(result.baseline.total / GiB)
    assert widths[1:] == pytest.approx([r.memory.total / GiB for r in result.listed])
    texts = " ".join(_texts(fig))
    assert "#1," in texts and f"#{len(result.rungs)}," in texts
    assert "T4: 14.58 GiB" in texts  # nvidia-smi's figure is in the climb under the chart
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "the card's memory, as PyTorch reports it" in legend
    budget = [line for line in ax.lines if line.get_linestyle() == "--"][0]
    assert budget.get_xdata()[0] == pytest.approx(result.budget_bytes / GiB)
    assert ax.get_xscale() == "log"  # terabytes and a T4's line, both readable
    assert ax.get_xlim()[0] <= min(widths) and max(widths) <= ax.get_xlim()[1]


@pytest.mark.parametrize("model, gpu, seq_len, batch", [
    ("GPT-2 small (124M)", "T4", 1024, 16), ("GPT-2 XL (1.5B)", "T4", 4096, 16),
    ("1.2B, 128k vocabulary", "H200", 8192, 16), ("GPT-2 small (124M)", "A100 80GB", 2048, 1),
    ("1.2B, 128k vocabulary", "H100 80GB", 8192, 1)])
def test_the_card_line_crosses_no_words_and_its_own_stay_in_the_axes(model, gpu, seq_len, batch):
    result = fit_ladder.ladder(ladder_view.LADDER_MODELS[model], gpu, batch_size=batch,
                               seq_len=seq_len)
    fig = ladder_view.ladder_figure(result, model)
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    line = ax.transData.transform((result.budget_bytes / GiB, 0))[0]
    frame = ax.get_window_extent(renderer)
    for text in ax.texts:
        if not text.get_text().strip():
            continue
        box = text.get_window_extent(renderer)
        pad = 0.5 * box.width / len(text.get_text())  # about half a space each side
        assert not box.x0 + pad < line < box.x1 - pad, text.get_text()
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1, text.get_text()


def test_the_widget_fits_one_screen_with_its_controls_and_climb():
    box = ladder_view.ladder_explorer()
    width, height = box.figure.get_size_inches() * box.figure.dpi
    # 900 px screens: two rows of controls, the climb's 3-8 lines (about 150 px) below
    assert width <= 1000 and height <= 450


def test_the_offload_figure_stacks_the_price_on_the_plain_step():
    fig = ladder_view.offload_price_figure({"T4": (5.5, 8.8), "H100 80GB": (0.66, 1.5)})
    ax = fig.axes[0]
    ends = [p.get_x() + p.get_width() for p in ax.patches]
    assert ends == pytest.approx([5.5, 0.66, 8.8, 1.5])
    texts = " ".join(_texts(fig))
    assert "8.8 s (+60%)" in texts and "(+127%)" in texts
    assert "16 GB/s to the host" in " ".join(t.get_text() for t in ax.get_yticklabels())
    for bad in ({}, {"V100": (1, 2)}, {"T4": (1,)}, {"T4": (2, 1)}, {"T4": (0, 1)}):
        with pytest.raises(ValueError, match="seconds"):
            ladder_view.offload_price_figure(bad)


def test_climb_text_names_each_rung_and_fits_the_page():
    result = fit_ladder.ladder(ladder_view.LADDER_MODELS["GPT-2 XL (1.5B)"], "T4", batch_size=16,
                               seq_len=4096)
    text = ladder_view.climb_text(result)
    lines = text.splitlines()
    assert len(lines) == 2 + len(result.climb) and lines[-1].startswith("fits")
    assert lines[0] == f"the plain step: {format_bytes(result.baseline.total)}; {T4_LABEL}"
    assert all(len(line) < 100 for line in lines)
    with pytest.raises(TypeError, match="result"):
        ladder_view.climb_text("ladder")
    with pytest.raises(TypeError, match="result"):
        ladder_view.ladder_figure(result.step)


def test_the_explorer_redraws_for_every_control_and_refuses_bad_choices(capsys):
    box = ladder_view.ladder_explorer()
    first = box.image.value
    for name, value in (("gpu", "H200"), ("batch_size", 1), ("seq_len", 8192),
                        ("model", "1.2B, 128k vocabulary")):
        box.controls[name].value = value
        assert box.image.layout.display is None, name
    assert box.image.value != first
    assert "H200" in " ".join(t.get_text() for t in box.artists["ax"].texts)
    # the setting is printed over the climb, not drawn: no glyphs to rasterise on each change
    last = capsys.readouterr().out.split("1.2B, 128k vocabulary, ")[-1]
    assert last.startswith("1 x 8,192 tokens per step on a H200: each lever alone\nthe plain step")
    for kwargs, name in (({"model": "GPT-5"}, "model"), ({"gpu": "V100"}, "gpu"),
                         ({"seq_len": 100}, "seq_len"), ({"batch_size": 3}, "batch_size")):
        with pytest.raises(ValueError, match=name):
            ladder_view.ladder_explorer(**kwargs)


def test_the_legend_names_master_weights_only_where_a_step_keeps_them():
    fp32 = predict(Step(GPT2, 8, gpu="T4")).peak
    mixed = predict(Step(GPT2, 8, precision="fp16-mixed", gpu="T4")).peak
    legend = {name: [t.get_text() for t in ladder_view.peak_parts_figure(
        {name: peak}, "T4").axes[0].get_legend().get_texts()]
        for name, peak in (("fp32", fp32), ("mixed", mixed))}
    assert not any("master" in text for text in legend["fp32"])
    assert any("master weights" in text for text in legend["mixed"])


def test_the_chunked_loss_figure_draws_measured_dots_and_predicted_lines():
    fig = ladder_view.chunked_loss_figure([16384, 32768], {"plain": [2 * MiB, 4 * MiB]},
                                          {"plain": [2 * MiB, 5 * MiB]})
    ax = fig.axes[0]
    assert [list(line.get_ydata()) for line in ax.lines] == [[2.0, 4.0], [2.0, 5.0]]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16k", "32k"]
    with pytest.raises(ValueError, match="measured"):
        ladder_view.chunked_loss_figure([16384, 32768], {"plain": [1]}, {"plain": [1, 2]})
    with pytest.raises(ValueError, match="predicted"):
        ladder_view.chunked_loss_figure([16384], {"plain": [1]}, {"chunked": [1]})


def test_the_state_bytes_figure_draws_each_run_over_fp32s_eight_bytes():
    fig = ladder_view.state_bytes_figure([1024, 4096], {"8-bit": [8.0, 2.53], "4-bit": [8.0, 1.3]})
    ax = fig.axes[0]
    assert [list(line.get_ydata()) for line in ax.lines] == [[8.0, 2.53], [8.0, 1.3], [8, 8]]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1,024", "4,096"]
    with pytest.raises(ValueError, match="per_element"):
        ladder_view.state_bytes_figure([1024, 4096], {"8-bit": [8.0]})
    with pytest.raises(ValueError, match="sizes"):
        ladder_view.state_bytes_figure([0, 4096], {"8-bit": [8.0, 2.5]})


def test_the_loss_curves_legend_sits_below_the_curves():
    fig = ladder_view.loss_curves_figure({"fp32": [3.0, 1.0, 0.8], "8-bit": [3.1, 1.1, 0.8]},
                                         floor=0.693)
    ax = fig.axes[0]
    legend = ax.get_legend()
    fig.canvas.draw()
    box = legend.get_window_extent().transformed(fig.transFigure.inverted())
    axes = ax.get_position()
    assert box.y1 <= axes.y0  # below the axes: it covers no curve
    assert len(legend.get_texts()) == 3
    with pytest.raises(ValueError, match="curves"):
        ladder_view.loss_curves_figure({"a": [1, 2], "b": [1]}, floor=0.5)
    with pytest.raises(ValueError, match="floor"):
        ladder_view.loss_curves_figure({"a": [1, 2]}, floor=-1)
