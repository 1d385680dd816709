"""01: mixed precision's optimizer: AdamW on fp32 master copies of a 16-bit model.

Lecture 01 counts its bytes (2 + 2 + 4 + 4 + 4 = 16 per parameter); lectures 02, 06 and
08 train and measure with it (:func:`course_lib.step_setup.build` picks it for the mixed
precisions of :data:`course_lib.engine.PRECISIONS`).
"""

from __future__ import annotations

import torch


class MasterWeightAdamW:
    """AdamW on fp32 master copies of a 16-bit model's parameters (mixed precision, Megatron-style).

    The model holds fp16 or bf16 parameters and gets 16-bit gradients; this optimizer
    keeps an fp32 copy of every parameter (the master weights) and AdamW's
    ``m`` and ``v`` in fp32: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter
    (Micikevicius et al. 2018, "Mixed Precision Training"; Rajbhandari et al.
    2020, ZeRO, section 3.1). :meth:`prepare_grads` turns each 16-bit gradient into
    an fp32 one on the master copy (freeing the 16-bit one); ``step()`` does that if
    it was not done, runs AdamW, and copies the master weights back into the model.
    While it runs, the fp32 gradients briefly make it 18 bytes per parameter.

    :func:`course_lib.training.train` calls :meth:`prepare_grads` before clipping and
    before a ``GradScaler`` unscales, so both see the fp32 master gradients
    (``param_groups`` are the master weights'): that is how fp16 training with loss
    scaling works here (``GradScaler`` refuses to unscale fp16 gradients). bf16 needs
    no loss scaling. ``optimizer`` is the inner ``torch.optim.AdamW``.
    """

    def __init__(self, params, **adamw_kwargs):
        try:
            params = list(params)
        except TypeError:
            raise ValueError(f"params must be an iterable of tensors, got {params!r}") from None
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise ValueError(f"params must be an iterable of tensors (model.parameters()), got "
                             f"{[type(p).__name__ for p in params]}")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params must hold at least one tensor that requires grad")
        self.master = [p.detach().float().requires_grad_(True) for p in self.params]
        adamw_kwargs.setdefault("foreach", False)
        self.optimizer = torch.optim.AdamW(self.master, **adamw_kwargs)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Move every 16-bit gradient of the model to its fp32 master copy (once per step)."""
        for p, master in zip(self.params, self.master):
            if p.grad is not None:
                master.grad = p.grad.float()
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.prepare_grads()
        self.optimizer.step()
        for p, master in zip(self.params, self.master):
            p.copy_(master)
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in (*self.params, *self.master):
            t.grad = None


__all__ = ["MasterWeightAdamW"]
