"""Load hooks that let a checkpoint saved under another backend, level or optimizer-state precision load
into what lowprec prepared."""

from __future__ import annotations

import torch

from ..backends import strip_backend_entries
from ..optim.fused_adam_form import per_parameter_steps, write_masters
from ..optim.low_bit_adam import plain_adam_state_dict
from ..planning.plan import PrecisionPlan
from .notices import warn_once


class ForeignBackendEntries:
    """A load_state_dict pre-hook on a converted model: a checkpoint saved under another backend or level
    loads its weights (cast to this run's storage by copy_) instead of failing on the other backend's own
    entries after half the tensors were copied. The other backend's entries (msamp's scales and amax
    histories, TE's _extra_state) are dropped, and this backend's own entries the checkpoint lacks keep their
    current values: that scaling state restarts, which the warning says. Parameters and buffers of the model
    itself are left to strict loading."""

    def __init__(self, plan: PrecisionPlan, backend=None):
        self.plan = plan
        self.backend = backend

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
        incoming = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        own = module.state_dict()
        self._convert_or_refuse(module, state_dict, prefix, own, incoming)
        backend_keys = (set(incoming) - set(strip_backend_entries(incoming))) | (set(own) - set(
            strip_backend_entries(own)))
        foreign = [k for k in incoming if k in backend_keys and k not in own]
        absent = [k for k in own if k in backend_keys and k not in incoming]
        if not foreign and not absent:
            return
        for key in foreign:
            del state_dict[prefix + key]
        for key in absent:
            state_dict[prefix + key] = own[key]
        warn_once(
            f"lowprec: the checkpoint loaded into this {self.plan.backend} model was saved under another backend or "
            f"level: its weights were loaded; {len(foreign)} entries of the other backend's scaling state were "
            f"dropped and {len(absent)} of this one's kept their current values (its scaling starts afresh)")

    def _convert_or_refuse(self, module, state_dict: dict, prefix: str, own: dict, incoming: dict) -> None:
        """Before anything is copied (this hook runs on the model itself, ahead of its modules): this backend's
        entries saved under other settings converted (msamp's amax windows of another length), and a checkpoint
        that still does not fit refused whole: a tensor of another shape, a scale no GEMM can use. torch would
        raise on a shape only after copying every tensor before it."""
        converted, refused = self.backend.convert_own_entries(own, incoming) if self.backend else ({}, [])
        # parameters and buffers only: an _extra_state (TE's) is a blob whose length follows its contents, and
        # torch hands it to set_extra_state whatever its shape. DeepSpeed ZeRO-3 holds partitioned parameters as
        # empty tensors: nothing to compare.
        tensors = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        for key, value in incoming.items():
            mine = own.get(key)
            if (key in tensors and key not in converted and isinstance(value, torch.Tensor)
                    and isinstance(mine, torch.Tensor) and mine.numel() > 0
                    and tuple(value.shape) != tuple(mine.shape)):
                refused.append(f"{key}: shape {tuple(value.shape)} in the checkpoint, {tuple(mine.shape)} in the "
                               "model")
        if refused:
            raise ValueError(
                f"lowprec: this checkpoint does not fit the {self.plan.backend} model it is loaded into, and nothing "
                "was loaded:\n  " + "\n  ".join(refused[:10]) + (f"\n  ... and {len(refused) - 10} more"
                                                                 if len(refused) > 10 else ""))
        for key, value in converted.items():
            state_dict[prefix + key] = value
        if converted:
            warn_once(f"lowprec: {len(converted)} amax histories in the checkpoint had another length "
                      "(amax_history_len): their most recent steps were kept")


def from_low_bit_states(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A load_state_dict pre-hook on an optimizer that keeps FP32 moments (see its use in prepare()); one without
    master weights (torch's Adam/AdamW) takes a TE FusedAdam checkpoint (te's fp8_weights) too, its FP32 masters
    written into the parameters (`fused_adam_form`)."""
    if getattr(optimizer, "master_weights", False):  # TE's FusedAdam: te's own pre-hook converts (from_adam_form)
        return state_dict
    state_dict, masters = per_parameter_steps(plain_adam_state_dict(state_dict))
    write_masters(optimizer.param_groups, state_dict["param_groups"], masters)
    return state_dict
