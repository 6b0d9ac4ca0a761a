"""Model-state bytes per parameter, measured: weights, gradients wherever a backend keeps them, optimizer states."""

from __future__ import annotations

import torch
from torch import nn

from ..utils.tensors import local_data


def _nbytes(t: torch.Tensor | None) -> int:
    """Bytes this process holds for `t`: a DTensor's local shard, a wrapper subclass's inner data."""
    if t is None:
        return 0
    t = local_data(t)
    return t.numel() * t.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, backend=None) -> dict:
    """Bytes per parameter of weights, gradients, optimizer states (and master weights), measured on
    this process (a sharded parameter counts its local shard, per parameter of the whole).
    `backend`: the lowprec backend that converted `model`; its converted Linear layers are the
    "linear weights" (without one, every nn.Linear)."""
    from ..backends.msamp.linear import FP8Linear

    inner_opt = getattr(optimizer, "optimizer", optimizer)
    # gradients kept outside .grad: msamp's FP8Linear, and the GradStore buffers of te/torchao layers
    fp8_layers = {id(m.weight): m for m in model.modules() if isinstance(m, FP8Linear) and not m.sharded_master}
    fp8_layers.update({id(s.weight): s for s in inner_opt.fp8_layers()} if hasattr(inner_opt, "fp8_layers") else {})
    # the backend says which modules are its converted Linears (TE's are lowprec subclasses of te.Linear)
    if backend is not None:
        linear_weights = {id(m.weight) for m in model.modules() if backend.converted_kind(m) == "linear"}
    else:
        linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    total = {"params": 0, "weight": 0, "grad": 0, "optimizer_states": 0}
    linear = dict(total)
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        layer = fp8_layers.get(id(p))
        grad = _nbytes(layer.fp8_grad_data) if layer is not None else _nbytes(p.grad)
        state = inner_opt.state.get(p, {})
        states = sum(_nbytes(v) for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step")
        row = {"params": p.numel(), "weight": _nbytes(p), "grad": grad, "optimizer_states": states}
        for key, value in row.items():
            total[key] += value
            if id(p) in linear_weights:
                linear[key] += value

    def per_param(d: dict) -> dict:
        n = d["params"] or 1
        out = {k: d[k] / n for k in ("weight", "grad", "optimizer_states")}
        out["total"] = sum(out.values())
        out["params"] = d["params"]
        return out

    return {"all_params": per_param(total), "linear_weights": per_param(linear)}
