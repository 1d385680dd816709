"""Typical wrong answers to the exercises of lecture 03 (see tests/wrong_answers/__init__.py)."""

import torch
import torch.nn.functional as F


def _no_division_by_k(model, inputs, targets, micro_batch_size):
    model.zero_grad()
    total = 0.0
    for i in range(0, inputs.size(0), micro_batch_size):
        _, loss = model(inputs[i:i + micro_batch_size], targets[i:i + micro_batch_size])
        loss.backward()
        total += loss.item()
    return total


def _divides_by_batch_size(model, inputs, targets, micro_batch_size):
    model.zero_grad()
    total = 0.0
    for i in range(0, inputs.size(0), micro_batch_size):
        _, loss = model(inputs[i:i + micro_batch_size], targets[i:i + micro_batch_size])
        (loss / inputs.size(0)).backward()
        total += loss.item() / inputs.size(0)
    return total


def _forgets_zero_grad(model, inputs, targets, micro_batch_size):
    K = inputs.size(0) // micro_batch_size
    total = 0.0
    for i in range(0, inputs.size(0), micro_batch_size):
        _, loss = model(inputs[i:i + micro_batch_size], targets[i:i + micro_batch_size])
        (loss / K).backward()
        total += loss.item() / K
    return total


def _one_big_batch(model, inputs, targets, micro_batch_size):
    model.zero_grad()
    _, loss = model(inputs, targets)
    loss.backward()
    return loss.item()


def _returns_last_micro_loss(model, inputs, targets, micro_batch_size):
    model.zero_grad()
    K = inputs.size(0) // micro_batch_size
    for i in range(0, inputs.size(0), micro_batch_size):
        _, loss = model(inputs[i:i + micro_batch_size], targets[i:i + micro_batch_size])
        (loss / K).backward()
    return loss.item()


def _steps_per_micro_batch_zeroing(model, inputs, targets, micro_batch_size):
    """Zeroes inside the loop: only the last micro-batch's gradient survives."""
    K = inputs.size(0) // micro_batch_size
    total = 0.0
    for i in range(0, inputs.size(0), micro_batch_size):
        model.zero_grad()
        _, loss = model(inputs[i:i + micro_batch_size], targets[i:i + micro_batch_size])
        (loss / K).backward()
        total += loss.item() / K
    return total


def _padded_mean_of_means(model, inputs, targets, micro_batch_size):
    model.zero_grad()
    K = inputs.size(0) // micro_batch_size
    total = 0.0
    for i in range(0, inputs.size(0), micro_batch_size):
        y = targets[i:i + micro_batch_size]
        if (y != -100).any():
            _, loss = model(inputs[i:i + micro_batch_size], y)
            (loss / K).backward()
            total += loss.item() / K
    return total


def _exercise_one_loop(model, inputs, targets, micro_batch_size):
    """Right without padding: loss / K for every micro-batch, empty ones included."""
    model.zero_grad()
    K = inputs.size(0) // micro_batch_size
    total = 0.0
    for i in range(0, inputs.size(0), micro_batch_size):
        _, loss = model(inputs[i:i + micro_batch_size], targets[i:i + micro_batch_size])
        (loss / K).backward()
        total += loss.item() / K
    return total


def _padded_counts_padding(model, inputs, targets, micro_batch_size):
    """Divides by all positions, padding included."""
    model.zero_grad()
    total = 0.0
    for i in range(0, inputs.size(0), micro_batch_size):
        logits = model(inputs[i:i + micro_batch_size])
        loss = F.cross_entropy(logits.flatten(0, 1), targets[i:i + micro_batch_size].flatten(),
                               reduction="sum")
        (loss / targets.numel()).backward()
        total += loss.item() / targets.numel()
    return total


def _padded_nan_on_empty(model, inputs, targets, micro_batch_size):
    """Right gradients, but mean loss * n_k is NaN * 0 = NaN on an all-padding micro-batch."""
    model.zero_grad()
    N = (targets != -100).sum()
    total = 0.0
    for i in range(0, inputs.size(0), micro_batch_size):
        y = targets[i:i + micro_batch_size]
        _, loss = model(inputs[i:i + micro_batch_size], y)
        part = loss * (y != -100).sum() / N
        part.backward()
        total += part.item()
    return total


def _coupled_by_type(model, x):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def _all_norms(model, x):
    norms = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm)
    return [n for n, m in model.named_modules() if isinstance(m, norms)]


def _compares_whole_output(model, x):
    """Flags every module: the whole output changes when other samples change."""
    return [n for n, m in model.named_modules() if not list(m.children())]


def _unseeded_dropout(model, x):
    inputs = {}
    leaves = {n: m for n, m in model.named_modules() if not list(m.children())}
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: inputs.__setitem__(n, a[0]))
               for n, m in leaves.items()]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    coupled = []
    with torch.no_grad():
        for name, inp in inputs.items():
            other = inp.clone()
            other[1:] = torch.randn_like(other[1:])
            if not torch.allclose(leaves[name](inp)[0], leaves[name](other)[0]):
                coupled.append(name)
    return coupled


WRONG = {
    "check_accumulate_gradients": [
        ("no division by K: gradients K times too large", {"accumulate_gradients": _no_division_by_k}),
        ("divides by the batch size instead of K", {"accumulate_gradients": _divides_by_batch_size}),
        ("forgets to zero the old gradients", {"accumulate_gradients": _forgets_zero_grad}),
        ("one forward pass over the whole batch", {"accumulate_gradients": _one_big_batch}),
        ("returns the last micro-batch's loss", {"accumulate_gradients": _returns_last_micro_loss}),
        ("zeroes the gradients inside the loop", {"accumulate_gradients": _steps_per_micro_batch_zeroing}),
    ],
    "check_accumulate_padded": [
        ("mean of micro-batch means (the Trainer bug)", {"accumulate_padded": _padded_mean_of_means}),
        ("counts padding positions as tokens", {"accumulate_padded": _padded_counts_padding}),
        ("NaN loss from an all-padding micro-batch", {"accumulate_padded": _padded_nan_on_empty}),
        ("exercise 1's loop, unchanged", {"accumulate_padded": _exercise_one_loop}),
    ],
    "check_batch_coupled_modules": [
        ("finds BatchNorm by its type", {"batch_coupled_modules": _coupled_by_type}),
        ("flags every normalisation layer", {"batch_coupled_modules": _all_norms}),
        ("compares the whole output, not one sample's", {"batch_coupled_modules": _compares_whole_output}),
        ("does not re-seed before Dropout", {"batch_coupled_modules": _unseeded_dropout}),
    ],
}


def _epoch_divides_by_k(model, optimizer, inputs, targets, micro_batch_size, accumulation_steps):
    """The last window still divided by K: its step gets k / K of the gradient."""
    micro = list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro):
        _, loss = model(x, y)
        (loss / accumulation_steps).backward()
        if (i + 1) % accumulation_steps == 0 or i + 1 == len(micro):
            optimizer.step()
            optimizer.zero_grad()


def _epoch_drops_last_window(model, optimizer, inputs, targets, micro_batch_size,
                             accumulation_steps):
    """The loop as usually written: no step for the micro-batches left at the end."""
    micro = list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro):
        _, loss = model(x, y)
        (loss / accumulation_steps).backward()
        if (i + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()


def _epoch_never_zeroes(model, optimizer, inputs, targets, micro_batch_size, accumulation_steps):
    """Right weights per window, but the gradients of one window leak into the next."""
    micro = list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))
    for start in range(0, len(micro), accumulation_steps):
        window = micro[start:start + accumulation_steps]
        for x, y in window:
            _, loss = model(x, y)
            (loss / len(window)).backward()
        optimizer.step()


def _epoch_steps_every_micro_batch(model, optimizer, inputs, targets, micro_batch_size,
                                   accumulation_steps):
    """No accumulation at all: a step per micro-batch."""
    for x, y in zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)):
        optimizer.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()


def _epoch_one_big_step(model, optimizer, inputs, targets, micro_batch_size, accumulation_steps):
    """The whole epoch accumulated into one step."""
    micro = list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))
    optimizer.zero_grad()
    for x, y in micro:
        _, loss = model(x, y)
        (loss / len(micro)).backward()
    optimizer.step()


WRONG["check_epoch_windows"] = [
    ("the last window divided by K", {"train_epoch": _epoch_divides_by_k}),
    ("no step for the last partial window", {"train_epoch": _epoch_drops_last_window}),
    ("never zeroes between windows", {"train_epoch": _epoch_never_zeroes}),
    ("a step per micro-batch", {"train_epoch": _epoch_steps_every_micro_batch}),
    ("the whole epoch in one step", {"train_epoch": _epoch_one_big_step}),
]


def _decoys(model, inputs, micro_batch_size):
    """Micro-batch forward calls that a forward hook counts, with no gradient behind them."""
    with torch.no_grad():
        for i in range(0, inputs.size(0), micro_batch_size):
            model(inputs[i:i + micro_batch_size])


def _forward_bypass(model, inputs, targets, micro_batch_size):
    """The whole batch through ``model.forward`` (no hook fires), decoy micro-batches for show."""
    model.zero_grad()
    _decoys(model, inputs, micro_batch_size)
    _, loss = model.forward(inputs, targets)
    loss.backward()
    return loss.item()


def _padded_forward_bypass(model, inputs, targets, micro_batch_size):
    model.zero_grad()
    _decoys(model, inputs, micro_batch_size)
    logits = model.forward(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item()


def _epoch_forward_bypass(model, optimizer, inputs, targets, micro_batch_size,
                          accumulation_steps):
    window = micro_batch_size * accumulation_steps
    for start in range(0, inputs.size(0), window):
        x, y = inputs[start:start + window], targets[start:start + window]
        optimizer.zero_grad()
        _decoys(model, x, micro_batch_size)
        model.forward(x, y)[1].backward()
        optimizer.step()


WRONG["check_accumulate_gradients"].append(
    ("the whole batch through model.forward, decoy micro-batches under no_grad",
     {"accumulate_gradients": _forward_bypass}))
WRONG["check_accumulate_padded"].append(
    ("the whole batch through model.forward, decoy micro-batches under no_grad",
     {"accumulate_padded": _padded_forward_bypass}))
WRONG["check_epoch_windows"].append(
    ("each window through model.forward at once, decoy micro-batches under no_grad",
     {"train_epoch": _epoch_forward_bypass}))
