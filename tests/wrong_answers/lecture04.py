"""Typical wrong answers to the exercises of lecture 04 (see tests/wrong_answers/__init__.py)."""

from torch.utils.checkpoint import checkpoint

from course_lib.prediction import checkpointed
from course_lib.prediction.predict import Step, predict
from course_lib.training import checkpointing as ckpt


def _no_checkpoint(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def _one_region_for_all(blocks, x):
    def run_all(x):
        for block in blocks:
            x = block(x)
        return x

    return checkpoint(run_all, x, use_reentrant=False)


def _reentrant(blocks, x):
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=True)
    return x


def _rng_not_preserved(blocks, x):
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
    return x


def _costs(config, batch_size):
    """``{k: (peak bytes, flops)}`` of sqrt mode with ``k`` segments."""
    return {k: (predict(Step(config, batch_size, mode="sqrt", segments=k)).total,
                checkpointed.step_flops(config, batch_size, "sqrt", segments=k)[0])
            for k in range(1, config.n_layers + 1)}


def _cheapest(costs, fits):
    return min(fits, key=lambda k: (costs[k][1], k)) if fits else None


def _always_sqrt(config, batch_size, budget):
    return ckpt.sqrt_segments(config.n_layers)


def _least_memory(config, batch_size, budget):
    costs = _costs(config, batch_size)
    fits = [k for k, c in costs.items() if c[0] <= budget]
    return min(fits, key=lambda k: costs[k][0]) if fits else None


def _most_segments_that_fit(config, batch_size, budget):
    fits = [k for k, c in _costs(config, batch_size).items() if c[0] <= budget]
    return max(fits) if fits else None


def _fewest_segments_that_fit(config, batch_size, budget):
    fits = [k for k, c in _costs(config, batch_size).items() if c[0] <= budget]
    return min(fits) if fits else None


def _strictly_below(config, batch_size, budget):
    costs = _costs(config, batch_size)
    return _cheapest(costs, [k for k, c in costs.items() if c[0] < budget])


def _never_none(config, batch_size, budget):
    costs = _costs(config, batch_size)
    fits = [k for k, c in costs.items() if c[0] <= budget]
    return _cheapest(costs, fits) or config.n_layers


WRONG = {
    "check_checkpoint_blocks": [
        ("runs the blocks without checkpointing", {"checkpoint_blocks": _no_checkpoint}),
        ("one checkpoint around the whole loop", {"checkpoint_blocks": _one_region_for_all}),
        ("use_reentrant=True", {"checkpoint_blocks": _reentrant}),
        ("preserve_rng_state=False with dropout", {"checkpoint_blocks": _rng_not_preserved}),
    ],
    "check_choose_segments": [
        ("always round(sqrt(n)) segments", {"choose_segments": _always_sqrt}),
        ("the least memory, whatever it costs", {"choose_segments": _least_memory}),
        ("the most segments that fit", {"choose_segments": _most_segments_that_fit}),
        ("the fewest segments that fit", {"choose_segments": _fewest_segments_that_fit}),
        ("peak < budget instead of <=", {"choose_segments": _strictly_below}),
        ("n_layers segments when nothing fits", {"choose_segments": _never_none}),
    ],
}
