"""`Accelerator.clip_grad_norm_` / `clip_grad_value_` (a mixin of lowprec.Accelerator) for gradients Accelerate's
own would not see: a backend's kept outside `.grad` (msamp's FP8 weight gradients), and none at all where each
parameter was stepped in backward (`optimizer_in_backward`)."""

from __future__ import annotations

import torch

from .steps_in_backward import refuse_clipping


class GradientClipping:
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Accelerate's `clip_grad_norm_`, counting the gradients a backend keeps outside `.grad`
        (msamp's FP8 weight gradients) in the norm and clipping them too."""
        refuse_clipping(self._optimizers)
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        for _, backend, _ in self._lowprec:
            total = backend.clip_grad_norm_(parameters, max_norm, norm_type)
            if total is not None:
                return total
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        """Accelerate's `clip_grad_value_`, refused where a backend keeps weight gradients outside `.grad`: it
        would clamp the others and leave those as they are."""
        refuse_clipping(self._optimizers, "clip_grad_value_")
        for _, backend, _ in self._lowprec:
            where = backend.gradients_outside_grad()
            if where:
                raise ValueError(
                    f"clip_grad_value_ with backend={backend.name!r}: its weight gradients are kept {where}, which "
                    "torch's clip_grad_value_ does not see, so they would go unclipped. Use "
                    "accelerator.clip_grad_norm_, which clips them too")
        return super().clip_grad_value_(parameters, clip_value)
