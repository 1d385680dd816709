"""01: mixed precision's optimizer: AdamW on fp32 master copies of a 16-bit model.

Lecture 01 counts its bytes (2 + 2 + 4 + 4 + 4 = 16 per parameter); lectures 02, 06 and
08 train and measure with it (:func:`course_lib.prediction.step_setup.build` picks it for the mixed
precisions of :data:`course_lib.prediction.formulas.PRECISIONS`).
"""

from __future__ import annotations

import inspect

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW on fp32 master copies of a 16-bit model's parameters (mixed precision, Megatron-style).

    The model holds fp16 or bf16 parameters and gets 16-bit gradients; this optimizer keeps an
    fp32 copy of every parameter (the master weights, :attr:`master`) and AdamW's ``m`` and
    ``v`` in fp32: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter (Micikevicius et al. 2018, "Mixed
    Precision Training"; Rajbhandari et al. 2020, ZeRO, section 3.1). It is a
    ``torch.optim.AdamW`` whose parameters (``param_groups``) are the master weights, so
    ``optimizer.state`` holds their ``m``, ``v`` and ``step``, and whatever takes an optimizer
    takes it. One step:

    1. :meth:`prepare_grads`: each 16-bit gradient becomes an fp32 gradient of its master copy,
       and the 16-bit one is freed;
    2. AdamW updates the master weights, in fp32;
    3. the new weights, rounded to 16 bits, are copied into the model, and the fp32 gradients
       are freed.

    While step 2 runs, the fp32 gradients make it 18 bytes per parameter.
    :func:`course_lib.training.loop.train` calls :meth:`prepare_grads` itself before clipping and
    before a ``GradScaler`` unscales, so both see the fp32 master gradients: that is how fp16
    training with loss scaling works here (``GradScaler.unscale_`` refuses fp16 gradients).
    bf16 needs no loss scaling. :meth:`state_dict` also holds the master weights, which the
    model's own 16-bit ``state_dict`` has only rounded.

    Args:
        params: the 16-bit model's parameters (``model.parameters()``); those that do not
            require grad are left out.
        **adamw_kwargs: ``torch.optim.AdamW``'s (``lr``, ``betas``, ``weight_decay``, ...);
            ``foreach`` is left to PyTorch's default (per tensor on the CPU, foreach on a GPU),
            which :func:`course_lib.prediction.predict.predict` predicts by default.

    Raises:
        ValueError: naming ``params``, for anything but distinct tensors, at least one requiring
            grad.

    Example:
        >>> from course_lib.model.gpt import GPT, GPTConfig, random_tokens
        >>> model = GPT(GPTConfig()).to(torch.bfloat16)
        >>> optimizer = MasterWeightAdamW(model.parameters(), lr=1e-3)
        >>> model(*random_tokens(GPTConfig(), 2))[1].backward()
        >>> optimizer.step()
        >>> optimizer.master[0].dtype, model.lm_head.weight.dtype, model.lm_head.weight.grad
        (torch.float32, torch.bfloat16, None)
    """

    def __init__(self, params, **adamw_kwargs):
        try:
            params = list(params)
        except TypeError:
            raise ValueError(f"params must be an iterable of tensors, got {params!r}") from None
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise ValueError(f"params must be an iterable of tensors (model.parameters()), got "
                             f"{[type(p).__name__ for p in params]}")
        if len({id(p) for p in params}) < len(params):  # two masters: the stale one would win
            raise ValueError("params must not hold a tensor twice (model.parameters() lists "
                             "each once)")
        self.model_params = [p for p in params if p.requires_grad]
        if not self.model_params:
            raise ValueError("params must hold at least one tensor that requires grad")
        self.master = [p.detach().float().requires_grad_(True) for p in self.model_params]
        super().__init__(self.master, **adamw_kwargs)

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Move every 16-bit gradient of the model to its fp32 master copy (once per step)."""
        for p, master in zip(self.model_params, self.master):
            if p.grad is not None:
                master.grad = p.grad.float()
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on the master weights, then the model's 16-bit weights from them.

        Calls :meth:`prepare_grads` first (nothing to move if it was called already), and frees the
        fp32 gradients after the copy.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss, as for any
                ``torch.optim`` optimizer.

        Returns:
            The closure's loss, or None without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.prepare_grads()
        _adamw_step(self)
        for p, master in zip(self.model_params, self.master):
            p.copy_(master)
            master.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients of the master weights and of the model, both.

        Args:
            set_to_none (bool): set them to None (frees their memory, the default) rather than
                zeroing them in place.
        """
        # Not Optimizer.zero_grad: it adds a profiler record, which step_ops would count as an
        # operator of every step.
        for t in (*self.model_params, *self.master):
            if t.grad is not None:
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.zero_()

    def __getstate__(self) -> dict:
        # torch.optim.Optimizer keeps only its defaults, state and param groups: copies
        # (copy.deepcopy, pickle) also need the model's parameters and the master list.
        return {**super().__getstate__(), "model_params": self.model_params,
                "master": self.master}

    def state_dict(self) -> dict:
        """AdamW's state dict and the fp32 master weights (``"master_weights"``, in order).

        Returns:
            dict: ``torch.optim.AdamW.state_dict()`` with a ``"master_weights"`` list of tensors
            (detached, not copied).
        """
        return {**super().state_dict(), "master_weights": [m.detach() for m in self.master]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`: AdamW's state, and the master weights if it holds them.

        The model's 16-bit parameters are not changed: load the model's own ``state_dict`` too.

        Args:
            state_dict (dict): what :meth:`state_dict` returned (a plain AdamW state dict, without
                ``"master_weights"``, loads AdamW's state only).

        Raises:
            ValueError: naming ``state_dict``, for master weights of other shapes.
        """
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_weights", None)
        if saved is not None and (
                not isinstance(saved, list | tuple) or len(saved) != len(self.master)
                or any(not isinstance(s, torch.Tensor) or s.shape != m.shape
                       for s, m in zip(saved, self.master))):
            raise ValueError(f"state_dict must hold master weights of the shapes "
                             f"{[tuple(m.shape) for m in self.master]}, got {saved!r:.200}")
        super().load_state_dict(state_dict)
        if saved is not None:
            with torch.no_grad():
                for master, value in zip(self.master, saved):
                    master.copy_(value)


def _adamw_step(optimizer: MasterWeightAdamW) -> None:
    """``torch.optim.AdamW.step`` without the profiler record ``torch.optim`` wraps around it:
    :meth:`MasterWeightAdamW.step` records its own."""
    inspect.unwrap(torch.optim.AdamW.step, stop=lambda f: not getattr(f, "hooked", False))(
        optimizer)


__all__ = ["MasterWeightAdamW"]
