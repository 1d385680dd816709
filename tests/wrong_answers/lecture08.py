"""Typical wrong answers to the exercises of lecture 08 (see tests/wrong_answers/__init__.py)."""

import torch
import torch.nn.functional as F


def _fuse_with_a_gradient_hook(model, make_optimizer):
    # Tensor.register_hook runs before the gradient is added into p.grad: nothing to step yet.
    for p in model.parameters():
        if p.requires_grad:
            opt = make_optimizer([p])
            p.register_hook(lambda grad, opt=opt: (opt.step(), opt.zero_grad(set_to_none=True))
                            and None)


def _fuse_without_zero_grad(model, make_optimizer):
    for p in model.parameters():
        if p.requires_grad:
            opt = make_optimizer([p])
            p.register_post_accumulate_grad_hook(lambda param, opt=opt: opt.step())


def _fuse_every_tensor_occurrence(model, make_optimizer):
    # remove_duplicate=False lists a shared weight twice: two optimizers step it twice.
    for _, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            opt = make_optimizer([p])

            def hook(param, opt=opt):
                opt.step()
                opt.zero_grad(set_to_none=True)

            p.register_post_accumulate_grad_hook(hook)


def _fuse_frozen_too(model, make_optimizer):
    for p in model.parameters():
        opt = make_optimizer([p])

        def hook(param, opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

        p.register_post_accumulate_grad_hook(hook)


def _chunked_mean_over_all_tokens(hidden, weight, targets, chunk_size):
    total = 0.0
    for i in range(0, hidden.size(0), chunk_size):
        z = hidden[i:i + chunk_size] @ weight.T
        total = total + F.cross_entropy(z, targets[i:i + chunk_size], reduction="sum")
    return total / targets.numel()


def _chunked_drops_the_last_chunk(hidden, weight, targets, chunk_size):
    total, n = 0.0, hidden.size(0)
    for i in range(0, n - n % chunk_size, chunk_size):
        z = hidden[i:i + chunk_size] @ weight.T
        total = total + F.cross_entropy(z, targets[i:i + chunk_size], reduction="sum")
    return total / (targets != -100).sum()


def _chunked_after_the_full_logits(hidden, weight, targets, chunk_size):
    logits = hidden @ weight.T
    total = sum(F.cross_entropy(z, t, reduction="sum")
                for z, t in zip(logits.split(chunk_size), targets.split(chunk_size)))
    return total / (targets != -100).sum()


def _chunked_mean_of_chunk_means(hidden, weight, targets, chunk_size):
    means = [F.cross_entropy(hidden[i:i + chunk_size] @ weight.T, targets[i:i + chunk_size])
             for i in range(0, hidden.size(0), chunk_size)]
    return sum(means) / len(means)


def _chunked_naive_logsumexp(hidden, weight, targets, chunk_size):
    total = 0.0
    for i in range(0, hidden.size(0), chunk_size):
        z, t = hidden[i:i + chunk_size] @ weight.T, targets[i:i + chunk_size]
        keep = t != -100
        lse = torch.log(torch.exp(z).sum(dim=1))
        picked = z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
        total = total + ((lse - picked) * keep).sum()
    return total / (targets != -100).sum()


def _state_bytes_without_scales(numel, bits):
    if numel >= 4096 and numel % (256 if bits == 8 else 128) == 0:
        return 2 * (numel * bits // 8 + 4 * (256 if bits == 8 else 16))
    return 8 * numel


def _state_bytes_quantizes_everything(numel, bits):
    block, qmap = (256, 256) if bits == 8 else (128, 16)
    return 2 * (numel * bits // 8 + 4 * (numel // block) + 4 * qmap)


def _state_bytes_one_state(numel, bits):
    block, qmap = (256, 256) if bits == 8 else (128, 16)
    if numel >= 4096 and numel % block == 0:
        return numel * bits // 8 + 4 * (numel // block) + 4 * qmap
    return 4 * numel


def _state_bytes_without_maps(numel, bits):
    block = 256 if bits == 8 else 128
    if numel >= 4096 and numel % block == 0:
        return 2 * (numel * bits // 8 + 4 * (numel // block))
    return 8 * numel


def _state_bytes_bits_as_bytes(numel, bits):
    block, qmap = (256, 256) if bits == 8 else (128, 16)
    if numel >= 4096 and numel % block == 0:
        return 2 * (numel * bits + 4 * (numel // block) + 4 * qmap)
    return 8 * numel


WRONG = {
    "check_fuse_optimizer": [
        ("steps in a gradient hook, before accumulation", {"fuse_optimizer":
                                                           _fuse_with_a_gradient_hook}),
        ("never frees the gradient", {"fuse_optimizer": _fuse_without_zero_grad}),
        ("one optimizer per occurrence of a shared weight", {"fuse_optimizer":
                                                             _fuse_every_tensor_occurrence}),
        ("hooks frozen parameters too", {"fuse_optimizer": _fuse_frozen_too}),
    ],
    "check_chunked_loss": [
        ("divides by every token, ignored ones included", {"chunked_loss":
                                                           _chunked_mean_over_all_tokens}),
        ("drops the last, shorter chunk", {"chunked_loss": _chunked_drops_the_last_chunk}),
        ("computes the full logits, then splits them", {"chunked_loss":
                                                        _chunked_after_the_full_logits}),
        ("averages the chunks' means", {"chunked_loss": _chunked_mean_of_chunk_means}),
        ("log(sum(exp)) without the maximum", {"chunked_loss": _chunked_naive_logsumexp}),
    ],
    "check_quantized_state_bytes": [
        ("forgets the block scales", {"quantized_state_bytes": _state_bytes_without_scales}),
        ("quantizes small tensors too", {"quantized_state_bytes":
                                         _state_bytes_quantizes_everything}),
        ("counts m only", {"quantized_state_bytes": _state_bytes_one_state}),
        ("forgets the quantization maps", {"quantized_state_bytes": _state_bytes_without_maps}),
        ("bits counted as bytes", {"quantized_state_bytes": _state_bytes_bits_as_bytes}),
    ],
}


def _rank_cheapest_first(levers):
    return [name for name, _, _ in sorted(levers, key=lambda lv: (lv[2], -lv[1]))]


def _rank_by_bytes_saved(levers):
    return [name for name, _, _ in sorted(levers, key=lambda lv: -lv[1])]


def _rank_by_ratio_everywhere(levers):
    # bytes / time for every lever: a free lever's ratio is infinite or negative, not "first"
    def ratio(lv):
        return lv[1] / lv[2] if lv[2] else float("inf")
    return [name for name, _, _ in sorted(levers, key=lambda lv: -ratio(lv))]


def _rank_free_levers_that_save_nothing_first(levers):
    free = sorted((lv for lv in levers if lv[2] <= 0), key=lambda lv: (lv[2], -lv[1]))
    paid = sorted((lv for lv in levers if lv[2] > 0), key=lambda lv: -lv[1] / lv[2])
    return [name for name, _, _ in free + paid]


def _rank_free_levers_by_bytes(levers):
    free = sorted((lv for lv in levers if lv[1] > 0 and lv[2] <= 0), key=lambda lv: -lv[1])
    paid = sorted((lv for lv in levers if lv[1] > 0 and lv[2] > 0), key=lambda lv: -lv[1] / lv[2])
    return [name for name, _, _ in free + paid + [lv for lv in levers if lv[1] <= 0]]


WRONG["check_rank_levers"] = [
    ("cheapest first: by time paid alone", {"rank_levers": _rank_cheapest_first}),
    ("by bytes saved alone", {"rank_levers": _rank_by_bytes_saved}),
    ("bytes / time for every lever, free ones included", {"rank_levers":
                                                          _rank_by_ratio_everywhere}),
    ("a free lever that saves nothing ranked with the free ones", {
        "rank_levers": _rank_free_levers_that_save_nothing_first}),
    ("free levers by bytes saved, not by time gained", {"rank_levers": _rank_free_levers_by_bytes}),
]
