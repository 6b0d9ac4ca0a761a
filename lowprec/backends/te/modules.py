"""TransformerEngine modules as lowprec builds them.

- `from_float` builds `te.Linear` / `te.LayerNorm` / `te.RMSNorm` from a torch module and copies its
  parameters, so the converted model starts from the same weights.
- Checkpoints without pickles: TE stores DelayedScaling state (scales, amax histories) as a pickle,
  which TE >= 2.18 refuses to load unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1. lowprec's modules
  store the same state as a byte tensor of a JSON header plus raw tensor bytes, and load it back
  without unpickling anything. TE's own pickled payloads still go through TE's gate.
- A state dict without `_extra_state` (a plain model's) loads into them with `strict=True`.
- Their Linear turns inf into NaN before TE's saturating FP8 casts (guard.py).
- Their Linear casts DelayedScaling's first step with scales from that step's tensors, not 1 (first_scales.py).
"""

from __future__ import annotations

import contextlib
import json
import pickle
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

from ...utils.imports import require
from ...utils.tensors import local_shard
from .first_scales import SeedsFirstScales
from .guard import guard_input, guard_output_grad

MAGIC = b"LOWPREC-TE-STATE1\n"
_TENSOR_SLOTS = {  # key in TE's state -> (fp8_meta entry, attribute)
    "scale_fwd": ("scaling_fwd", "scale"),
    "amax_history_fwd": ("scaling_fwd", "amax_history"),
    "scale_bwd": ("scaling_bwd", "scale"),
    "amax_history_bwd": ("scaling_bwd", "amax_history"),
}
_RECIPE_FIELDS = ("margin", "amax_history_len", "amax_compute_algo", "reduce_amax")


_TUPLE = "__tuple__"  # JSON has no tuple: {"__tuple__": [...]} stands for one, at any depth


def _jsonable(value: Any, where: str) -> Any:
    """`value` in JSON's types, tuples tagged so that they come back as tuples; `where` names it in errors."""
    if isinstance(value, tuple):
        return {_TUPLE: [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        # JSON turns other keys into strings, and a dict keyed by the tag alone would decode as a tuple.
        bad = [k for k in value if not isinstance(k, str)] or ([_TUPLE] if set(value) == {_TUPLE} else [])
        if bad:
            raise TypeError(f"cannot store {where} in a pickle-free TE checkpoint: its keys must be strings, and not "
                            f"{_TUPLE!r} alone; got {bad[0]!r}")
        return {k: _jsonable(v, f"{where}[{k!r}]") for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {where} in a pickle-free TE checkpoint: {type(value).__name__} is not one of "
                    "bool, int, float, str, None, or a tuple, list or dict of them")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_from_json(v) for v in value[_TUPLE])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def encode_state(state: dict[str, Any]) -> torch.Tensor:
    """TE's DelayedScaling checkpoint dict -> uint8 tensor (JSON header + raw tensor bytes)."""
    recipe = state.get("recipe")
    header = {
        "recipe": None if recipe is None else {
            "class": type(recipe).__name__,
            "fp8_format": getattr(getattr(recipe, "fp8_format", None), "name", None),
            **{f: getattr(recipe, f) for f in _RECIPE_FIELDS if isinstance(getattr(recipe, f, None), (int, str, bool))},
        },
        "extra": _jsonable(dict(state.get("extra_fp8_variables", {})), "fp8_meta"),
        "tensors": [],
    }
    chunks = []
    for name in _TENSOR_SLOTS:
        if name in state:
            t = state[name].detach().cpu().contiguous()
            header["tensors"].append([name, str(t.dtype).replace("torch.", ""), list(t.shape)])
            chunks.append(t.reshape(-1).view(torch.uint8))
    head = json.dumps(header).encode()
    prefix = torch.frombuffer(bytearray(MAGIC + len(head).to_bytes(8, "little") + head), dtype=torch.uint8)
    return torch.cat([prefix, *chunks])


def decode_state(payload: torch.Tensor) -> dict[str, Any] | None:
    """Inverse of `encode_state`; None if `payload` is not lowprec's format."""
    data = payload.detach().cpu().contiguous().view(torch.uint8)
    if data.numel() < len(MAGIC) + 8 or bytes(data[: len(MAGIC)].tolist()) != MAGIC:
        return None
    offset = len(MAGIC)
    size = int.from_bytes(bytes(data[offset : offset + 8].tolist()), "little")
    offset += 8
    _check_length(data, offset + size, "its JSON header")
    header = json.loads(bytes(data[offset : offset + size].tolist()).decode())
    offset += size
    state: dict[str, Any] = {"recipe": header["recipe"], "extra_fp8_variables": _from_json(header["extra"])}
    for name, dtype, shape in header["tensors"]:
        dtype = getattr(torch, dtype)
        count = int(torch.tensor(shape).prod().item()) if shape else 1
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        _check_length(data, offset + nbytes, f"tensor {name!r}")
        state[name] = data[offset : offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    if offset != data.numel():
        raise ValueError(f"lowprec TE extra state is corrupt: its header describes {offset} bytes, the entry has "
                         f"{data.numel()}")
    return state


def _check_length(data: torch.Tensor, end: int, what: str) -> None:
    # A cut-off entry would otherwise fail inside json or reshape with a message about neither.
    if end > data.numel():
        raise ValueError(f"lowprec TE extra state is truncated: {what} ends at byte {end}, the entry has "
                         f"{data.numel()}")


def _recipe_from_header(info: dict[str, Any]):
    recipe = require("transformer_engine", feature="backend='te'")  # noqa: F841 - TE must import
    from transformer_engine.common import recipe as te_recipe

    kwargs = {f: info[f] for f in _RECIPE_FIELDS if f in info}
    if info.get("fp8_format"):
        kwargs["fp8_format"] = te_recipe.Format[info["fp8_format"]]
    return getattr(te_recipe, info["class"])(**kwargs)


class _AcceptsPlainCheckpoints:
    """Load a state dict that has no `_extra_state` (a plain model's) with strict=True."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(prefix + "_extra_state", torch.empty(0, dtype=torch.uint8))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _PickleFreeExtraState(_AcceptsPlainCheckpoints):
    """Store TE's DelayedScaling state without pickle (see module docstring)."""

    # The size of this module's entry in a sharded (DCP) checkpoint being loaded, or None. DCP loads in place, into
    # the tensors the model's state dict holds, and refuses one whose size differs from the saved one: a module
    # before its first FP8 step holds none (TE's issue #1860). runtime/sharded_checkpoints.py sets it for the load.
    loading_extra_state_bytes: int | None = None

    def get_extra_state(self) -> torch.Tensor:
        state = self._pickle_free_extra_state()
        want = self.loading_extra_state_bytes
        if want is not None and state.numel() != want:
            return torch.zeros(want, dtype=torch.uint8)  # a place of the saved size; the load fills it
        return state

    def _pickle_free_extra_state(self) -> torch.Tensor:
        meta = self.fp8_meta
        # An eval forward with FP8 off resets fp8_checkpoint; scales learned so far must survive it.
        forced = "scaling_fwd" in meta and not meta.get("fp8_checkpoint", False)
        if forced:
            meta["fp8_checkpoint"] = True
        try:
            payload = super().get_extra_state()
        finally:
            if forced:
                meta["fp8_checkpoint"] = False
        if payload.numel() == 0:
            return payload
        # TE pickled this a moment ago in this process: trusted.
        return encode_state(pickle.loads(payload.numpy().tobytes()))

    def set_extra_state(self, state) -> None:
        decoded = decode_state(state) if isinstance(state, torch.Tensor) and state.numel() else None
        if decoded is None:
            return super().set_extra_state(state)  # empty, or TE's own format behind TE's own gate
        recipe = _recipe_from_header(decoded["recipe"]) if decoded["recipe"] else self.fp8_meta.get("recipe")
        self.fp8_meta.update(decoded["extra_fp8_variables"])
        self.fp8_meta["recipe"] = recipe
        self.fp8_meta.pop("global_fp8_buffer_pos_fwd_recompute", None)
        self.init_fp8_meta_tensors(recipe)
        for name, (entry, attr) in _TENSOR_SLOTS.items():
            if name in decoded:
                getattr(self.fp8_meta[entry], attr).copy_(decoded[name])


class _KeepsOverflowVisible:
    """inf -> NaN before TE's saturating FP8 casts, forward and backward (see guard.py)."""

    def forward(self, inp, *args, **kwargs):
        out = super().forward(guard_input(inp), *args, **kwargs)
        if isinstance(out, tuple):  # return_bias=True: (output, bias)
            return (guard_output_grad(out[0]), *out[1:])
        return guard_output_grad(out)


@cache
def module_classes() -> dict[str, type]:
    """lowprec's TE module classes (TE is imported on first use only)."""
    te = require("transformer_engine", feature="backend='te'")

    class Linear(SeedsFirstScales, _KeepsOverflowVisible, _PickleFreeExtraState, te.Linear):
        pass

    class LayerNorm(_AcceptsPlainCheckpoints, te.LayerNorm):
        pass

    class RMSNorm(_AcceptsPlainCheckpoints, te.RMSNorm):
        pass

    for cls in (Linear, LayerNorm, RMSNorm):
        cls.__module__ = __name__
        cls.__qualname__ = f"TE{cls.__name__}"
    return {"linear": Linear, "layernorm": LayerNorm, "rmsnorm": RMSNorm}


def rmsnorm_eps(module: nn.Module) -> float:
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(module, "variance_epsilon", None)
    # torch.nn.RMSNorm(eps=None) uses the input dtype's epsilon; TE computes in the autocast
    # dtype's precision, whose inputs reach the norm in FP32 here.
    return float(eps) if eps is not None else float(torch.finfo(torch.float32).eps)


@torch.no_grad()
def from_float(module: nn.Module, kind: str, *, zero_centered: bool = False,
               device: torch.device | None = None,
               quantized_init: Callable[[], contextlib.AbstractContextManager] | None = None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """Build lowprec's TE module for `module` and copy its parameters.

    Args:
        kind: "linear", "layernorm" or "rmsnorm" (the plan's decision).
        zero_centered: RMSNorm computes x * (1 + w) (Gemma); TE's zero_centered_gamma is the same.
        device: where to build (default: the module's own device).
        quantized_init: a factory of the context (TE's quantized_model_init) that builds FP8-only
            weights; a factory because that context can be entered only once.
        dtype: the dtype to build in (default: the module's weight's); the weights are copied into it.
    """
    classes = module_classes()
    weight = module.weight
    device = device or weight.device
    dtype = dtype or weight.dtype
    with quantized_init() if quantized_init is not None else contextlib.nullcontext():
        if kind == "linear":
            new = classes["linear"](module.in_features, module.out_features, bias=module.bias is not None,
                                    params_dtype=dtype, device=device)
        elif kind == "layernorm":
            new = classes["layernorm"](tuple(module.normalized_shape), eps=module.eps, dtype=dtype, device=device)
        else:
            new = classes["rmsnorm"](tuple(weight.shape), eps=rmsnorm_eps(module), dtype=dtype, device=device,
                                     zero_centered_gamma=zero_centered)
    new.weight.copy_(weight.to(device))  # quantises when the weight is an FP8 tensor
    if kind != "rmsnorm" and module.bias is not None:
        new.bias.copy_(module.bias.to(device))
        new.bias.requires_grad_(module.bias.requires_grad)
    new.weight.requires_grad_(weight.requires_grad)
    new.train(module.training)
    return new


def is_te_tensor(value: Any) -> bool:
    """Whether `value` is one of TE's tensor types (an FP8-only weight of quantized_model_init: a Float8Tensor...)."""
    return isinstance(value, torch.Tensor) and type(value).__module__.startswith("transformer_engine")


def portable_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A TE model's state dict as the original torch model's: no `_extra_state`, plain tensors."""
    out = {}
    for key, value in state_dict.items():
        if key.rsplit(".", 1)[-1] == "_extra_state":
            continue
        if is_te_tensor(value):
            value = value.dequantize()  # FP8-only weights (quantized_model_init) -> their nominal dtype
        out[key] = value
    return out


def dequantize_entries(state_dict: dict[str, Any], prefix: str) -> None:
    """FP8-only weights among `state_dict`'s entries under `prefix` dequantised in place to their nominal dtype (as
    `portable_state_dict` does: the size of a BF16 model's checkpoint), sharded ones (DTensors over TE's tensors,
    under FSDP2) as DTensors of the same placement. A checkpoint written whole (torch.save, safetensors) then holds
    plain tensors: FSDP2's full state dict load could not shard TE's Float8Tensor as `torch.load` brings it back,
    without its quantizer (one H200, 4135470: "'NoneType' object has no attribute 'get_usages'"), and a plain model
    loads the file. A resume is exact all the same: the weights are written from FusedAdam's FP32 masters after the
    load (`optimizer.requantize_from_masters`). `_extra_state` stays."""
    from torch.distributed.tensor import DTensor

    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        local = local_shard(value)
        if not is_te_tensor(local):
            continue
        plain = local.dequantize()
        state_dict[key] = DTensor.from_local(plain, value.device_mesh, value.placements, run_check=False,
                                             shape=value.shape, stride=value.stride()) if local is not value else plain
