"""Whether a model file `Accelerator.load_state` is about to read fits its model, read without loading a tensor.

Accelerate loads a `model.safetensors` through safetensors' `load_model`, which loads non-strict and raises on
missing or unexpected keys only afterwards: every tensor that matched was already copied, so a checkpoint of another
model (a layer more, a head less) half-loaded and then raised. The keys are compared first here, as that strict check
compares them: names of tensors that share storage (tied weights, saved once) count once, and each backend's own
entries (scales, amax histories, TE's `_extra_state`) are left to `checkpoints.ForeignBackendEntries`, which converts
those of another backend or level.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..backends import strip_backend_entries

MODEL_FILES = ("model{ending}.safetensors", "pytorch_model{ending}.bin")  # Accelerate's names, in its order


def model_file(folder: str, index: int) -> str | None:
    """The file Accelerate's load_state reads for model `index` in `folder`, or None where there is none."""
    ending = f"_{index}" if index > 0 else ""
    for name in MODEL_FILES:
        path = os.path.join(folder, name.format(ending=ending))
        if os.path.isfile(path):
            return path
    return None


def load_mapped(path: str, **load_kwargs):
    """A torch.save file as Accelerate's `load` reads it, memory-mapped: no tensor's bytes are read until used.
    Only torch.save's zip format maps: an older file is read whole."""
    from accelerate.utils import load

    try:
        return load(path, map_location="cpu", **{**load_kwargs, "mmap": True})
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return load(path, map_location="cpu", **load_kwargs)


def saved_keys(path: str) -> set[str]:
    """The entry names of a model file: from safetensors' header, or a torch.save file memory-mapped."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            return set(fh.keys())
    return set(load_mapped(path))


def _storage(tensor: torch.Tensor) -> tuple | None:
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    return tensor.device, tensor.untyped_storage().data_ptr()


def model_file_problem(model: nn.Module, path: str) -> str | None:
    """The keys a strict load of the file at `path` into `model` would find missing or unexpected, or None."""
    own = model.state_dict()
    # by name alone: te's strip dequantises FP8-only weights, a model-sized copy for a check of names
    plain = set(strip_backend_entries(dict.fromkeys(own)))
    saved = set(strip_backend_entries(dict.fromkeys(saved_keys(path))))
    tied: dict[tuple, set[str]] = {}
    for key in plain:
        if isinstance(own[key], torch.Tensor) and (where := _storage(own[key])) is not None:
            tied.setdefault(where, set()).add(key)
    groups = {key: names for names in tied.values() for key in names}
    missing = sorted(k for k in plain - saved if not (groups.get(k, {k}) & saved))
    unexpected = sorted(saved - plain)
    if not missing and not unexpected:
        return None
    lines = [f"{k}: in the model, missing from the file" for k in missing]
    lines += [f"{k}: in the file, not in the model (unexpected)" for k in unexpected]
    more = f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else ""
    return f"{os.path.basename(path)} does not fit the model:\n  " + "\n  ".join(lines[:10]) + more
