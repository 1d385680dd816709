"""01: mixed precision's optimizer: AdamW on fp32 master copies of a 16-bit model.

Lecture 01 counts its bytes (2 + 2 + 4 + 4 + 4 = 16 per parameter); lectures 02, 06 and 08 train
and measure with it (:func:`course_lib.prediction.step_setup.build` picks it).
"""

from __future__ import annotations

import inspect

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW on fp32 master copies of a 16-bit model's parameters (mixed precision, Megatron-style).

    The model holds fp16 or bf16 parameters and gradients; this optimizer keeps fp32 master
    weights (:attr:`master`, its ``param_groups``) and AdamW's ``m`` and ``v`` in fp32:
    2 + 2 + 4 + 4 + 4 = 16 bytes per parameter (Micikevicius et al. 2018; ZeRO, section 3.1),
    18 while the fp32 gradients live. One step: :meth:`prepare_grads` turns each 16-bit gradient
    into its master's fp32 one; AdamW updates the masters; they are copied, rounded, into the
    model. :func:`course_lib.training.loop.train` calls :meth:`prepare_grads` before clipping and
    before a ``GradScaler`` unscales (``unscale_`` refuses fp16 gradients).

    Args:
        params: the 16-bit model's parameters; those that do not require grad are left out.
        **adamw_kwargs: ``torch.optim.AdamW``'s (``lr``, ``betas``, ``weight_decay``, ...).

    Raises:
        ValueError: naming the parameter, for a bad value.
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
        Args:
            closure (callable, optional): reevaluates the model and returns the loss.
        Returns:
            the closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.prepare_grads()
        # AdamW.step without the profiler record torch.optim wraps around it: step records its own
        inspect.unwrap(torch.optim.AdamW.step, stop=lambda f: not getattr(f, "hooked", False))(self)
        for p, master in zip(self.model_params, self.master):
            p.copy_(master)
            master.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients of the master weights and of the model, both.
        Args:
            set_to_none (bool): drop the gradients rather than fill them with zeros.
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
        # Optimizer keeps only its defaults, state and groups: copies need the two lists too.
        return {**super().__getstate__(), "model_params": self.model_params,
                "master": self.master}

    def state_dict(self) -> dict:
        """AdamW's state dict with the fp32 master weights (``"master_weights"``, detached).
        Returns:
            dict: the state.
        """
        return {**super().state_dict(), "master_weights": [m.detach() for m in self.master]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`: AdamW's state, and the master weights if it holds them.

        The model's 16-bit parameters are not changed: load the model's own ``state_dict`` too.
        Args:
            state_dict (dict): what :meth:`state_dict` returned.
        Raises:
            ValueError: naming the parameter, for a bad value.
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
