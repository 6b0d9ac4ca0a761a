"""Load hooks that let a checkpoint saved under another backend, level or optimizer-state precision load
into what lowprec prepared."""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from ..backends import strip_backend_entries
from ..optim.fused_adam_form import per_parameter_steps, write_masters
from ..optim.low_bit_adam import LowBitAdamW, adam_checkpoint_problem, plain_adam_state_dict
from ..planning.plan import PrecisionPlan
from .notices import warn_once


class CheckpointMismatch(ValueError, RuntimeError):
    """A model checkpoint refused before anything was copied. A RuntimeError too: torch raises one for missing and
    unexpected keys, and code that catches it (to retry with strict=False) keeps working."""


class ForeignBackendEntries:
    """A load_state_dict pre-hook on a converted model: a checkpoint saved under another backend or level
    loads its weights (cast to this run's storage by copy_) instead of failing on the other backend's own
    entries after half the tensors were copied. The other backend's entries (msamp's scales and amax
    histories, TE's _extra_state) are dropped, and this backend's own entries the checkpoint lacks keep their
    current values: that scaling state restarts, which the warning says. Under strict loading a parameter or
    buffer of the model the checkpoint lacks, or an entry the model has no place for, is refused here: torch
    raises on them only after copying every tensor it could (and msamp's amax histories with them)."""

    def __init__(self, plan: PrecisionPlan, backend=None):
        self.plan = plan
        self.backend = backend

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs) -> None:
        incoming = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        own = module.state_dict()
        backend_keys = (set(incoming) - set(strip_backend_entries(incoming))) | (set(own) - set(
            strip_backend_entries(own)))
        foreign = [k for k in incoming if k in backend_keys and k not in own]
        absent = [k for k in own if k in backend_keys and k not in incoming]
        unmatched = _unmatched_keys(own, (set(incoming) - set(foreign)) | set(absent),
                                    getattr(state_dict, "_metadata", None) or {}, prefix) if _strict_load() else []
        self._convert_or_refuse(module, state_dict, prefix, own, incoming, unmatched)
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

    def _convert_or_refuse(self, module, state_dict: dict, prefix: str, own: dict, incoming: dict,
                           unmatched: list[str]) -> None:
        """Before anything is copied (this hook runs on the model itself, ahead of its modules): this backend's
        entries saved under other settings converted (msamp's amax windows of another length), and a checkpoint
        that still does not fit refused whole: a tensor of another shape, a scale no GEMM can use, the keys
        strict loading would not match (`unmatched`). torch would raise on them only after copying every tensor
        before them."""
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
        refused += unmatched
        if refused:
            raise CheckpointMismatch(
                f"lowprec: this checkpoint does not fit the {self.plan.backend} model it is loaded into, and nothing "
                "was loaded:\n  " + "\n  ".join(refused[:10]) + (f"\n  ... and {len(refused) - 10} more"
                                                                 if len(refused) > 10 else "")
                + ("\n(load_state_dict(..., strict=False) loads the entries that match)" if unmatched else ""))
        for key, value in converted.items():
            state_dict[prefix + key] = value
        if converted:
            warn_once(f"lowprec: {len(converted)} amax histories in the checkpoint had another length "
                      "(amax_history_len): their most recent steps were kept")


def _strict_load() -> bool:
    """Whether the load_state_dict a pre-hook runs in is strict. torch hands its module hooks strict=True whatever
    the call was given (it filters the keys by `strict` only after copying), so it is read from that call's frame;
    False, torch's own check alone, where there is none (a module's _load_from_state_dict called directly)."""
    code = inspect.unwrap(nn.Module.load_state_dict).__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None and bool(frame.f_locals.get("strict", False))


def _unmatched_keys(own: dict, keys: set[str], metadata: dict, prefix: str) -> list[str]:
    """The keys torch's strict load of `keys` into a model whose state dict is `own` reports missing or
    unexpected. An entry below one of the model's (`weight.x`) is not unexpected, as in torch; nor is a
    BatchNorm's num_batches_tracked missing from a checkpoint older than it (no version 2 in its metadata), which
    torch's load fills in."""
    def filled_by_torch(key: str) -> bool:
        owner, _, name = key.rpartition(".")
        version = (metadata.get((prefix + owner) if owner else prefix[:-1]) or {}).get("version")
        return name == "num_batches_tracked" and (version is None or version < 2)

    def matched(key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:i]) in own for i in range(1, len(parts) + 1))

    missing = [f"{k}: in the model, missing from the checkpoint" for k in own
               if k not in keys and not filled_by_torch(k)]
    return missing + [f"{k}: in the checkpoint, not in the model (unexpected)" for k in sorted(keys) if not matched(k)]


def _is_torch_adam(optimizer: torch.optim.Optimizer) -> bool:
    # TE's FusedAdam (master weights) converts with te's own pre-hook (from_adam_form)
    return isinstance(optimizer, torch.optim.Adam) and not getattr(optimizer, "master_weights", False)


def from_low_bit_states(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A load_state_dict pre-hook on an optimizer that keeps FP32 moments (see its use in prepare()); one without
    master weights (torch's Adam/AdamW) takes a TE FusedAdam checkpoint (te's fp8_weights) too, its FP32 masters
    written into the parameters (`fused_adam_form`). Into torch's Adam/AdamW, a checkpoint of another optimizer or
    model is refused before anything changes, as LowBitAdamW's load refuses it (`adam_checkpoint_problem`)."""
    if getattr(optimizer, "master_weights", False):  # TE's FusedAdam: te's own pre-hook converts (from_adam_form)
        return state_dict
    state_dict, masters = per_parameter_steps(plain_adam_state_dict(state_dict))
    problem = adam_checkpoint_problem(optimizer.param_groups, state_dict) if _is_torch_adam(optimizer) else None
    if problem is not None:
        raise ValueError(f"{type(optimizer).__name__}.load_state_dict: {problem}; nothing was loaded")
    write_masters(optimizer.param_groups, state_dict["param_groups"], masters)
    return state_dict


def optimizer_load_problem(optimizer: torch.optim.Optimizer, state_dict: dict) -> str | None:
    """Why `optimizer.load_state_dict(state_dict)` would refuse, or None, found without changing anything: torch's
    check of the parameter groups and the Adam checks of LowBitAdamW's load and of `from_low_bit_states`. None of
    their conversions run: they read every moment and write FusedAdam's masters into the parameters."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer
    mine = [len(g["params"]) for g in inner.param_groups]
    saved = [len(g["params"]) for g in state_dict.get("param_groups", [])]
    if mine != saved:
        return f"parameter groups of {saved} parameters in the checkpoint, {mine} in the optimizer"
    if isinstance(inner, LowBitAdamW) or _is_torch_adam(inner):
        return adam_checkpoint_problem(inner.param_groups, per_parameter_steps(state_dict)[0])
    return None
