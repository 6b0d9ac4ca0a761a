"""Adam / AdamW with optimizer states stored in low precision (MS-AMP levels O1/O2).

Each state is kept in its storage dtype with one per-tensor scale: FP32 (unscaled), BF16
(unscaled: its range is FP32's), FP16, E4M3 or E5M2 (scaled by a power of two from the state's
amax, as MS-AMP does). A step follows MS-AMP's LBAdamW:

1. dequantise each state with its current scale and update it in FP32 with the new gradient,
2. update the parameter in FP32 from the updated states (AdamW, or Adam with L2),
3. choose new power-of-two scales from the updated states' amax and requantise them.

MS-AMP O1 uses FP32/FP32, O2 uses E4M3 `exp_avg` and FP16 `exp_avg_sq`. An FP16 or BF16 parameter (the
levels' weights, which have no FP32 master) is written back with stochastic rounding by default
(`lowprec.kernels.rounding`); MS-AMP rounds to nearest, which loses every update below half a step of the
format, and with it most of the last steps of a decayed learning rate.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..kernels.adam import SCALED, AdamItem, bucket_key, count_present_steps, fused_low_bit_adam_step
from ..kernels.rounding import ROUNDED_DTYPES, rounding_generator, rounding_seed, stochastic_round
from ..kernels.scaling import compute_scale, format_max, inf_to_nan, tensor_amax
from ..utils.tensors import local_data
from .fused_adam_form import per_parameter_steps, write_masters

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "e4m3": torch.float8_e4m3fn,
          "float8_e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "float8_e5m2": torch.float8_e5m2}


def state_dtype(name: str, value: Any) -> torch.dtype:
    """Accept a torch dtype or a name ('fp32', 'bf16', 'fp16', 'e4m3', 'e5m2'); MS-AMP's uint8 = E4M3."""
    if value is torch.uint8:  # MS-AMP's spelling of an E4M3 state
        return torch.float8_e4m3fn
    if value is torch.int8:  # ... and of an E5M2 state
        return torch.float8_e5m2
    if isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]
    if value in STATE_DTYPES:
        return value
    raise ValueError(
        f"{name}={value!r} is not a supported state dtype; use one of torch.float32, torch.bfloat16, "
        "torch.float16, torch.float8_e4m3fn, torch.float8_e5m2 (or 'fp32', 'bf16', 'fp16', 'e4m3', 'e5m2')"
    )


def _encode(value: torch.Tensor, dtype: torch.dtype, previous_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 `value` -> (stored tensor, scale)."""
    if dtype not in SCALED:
        return value.to(dtype), previous_scale
    amax = tensor_amax(value)
    scale = compute_scale(amax, dtype, previous=previous_scale)
    limit = format_max(dtype)
    scaled = value * scale
    # A finite value past the format's max (scaled by the previous scale where the amax was not finite) saturates.
    # An inf must not: stored as the max it came back as a finite moment where torch's Adam keeps an inf. It
    # stays one where the format has one (FP16, E5M2) and becomes NaN in E4M3, whose cast would saturate it.
    if dtype == torch.float8_e4m3fn:
        return inf_to_nan(scaled).clamp_(-limit, limit).to(dtype), scale
    return torch.where(scaled.isinf(), scaled, scaled.clamp(-limit, limit)).to(dtype), scale


def _decode(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return stored.float() / scale if stored.dtype in SCALED else stored.float()


def in_place_update(weight_dtype: torch.dtype | None) -> str:
    """How the plan's weight row says a level's weight (no master copy) is updated by a LowBitAdam(W) that
    `prepare()` made from Adam/AdamW (stochastic rounding on, its default)."""
    rounding = (", rounded stochastically (unbiased; LowBitAdamW(stochastic_rounding=False): to nearest)"
                if weight_dtype in ROUNDED_DTYPES else "")
    return f"updated in place by LowBitAdam(W) in FP32 math{rounding}, no master copy"


# Group keys that are the run's choice, not the checkpoint's: kept by load_state_dict, dropped for torch's Adam.
_OWN_KEYS = ("exp_avg_dtype", "exp_avg_sq_dtype", "stochastic_rounding")


def plain_adam_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A LowBitAdamW checkpoint as torch's Adam/AdamW stores one: FP32 moments (each dequantised with its
    scale) and no scales or lowprec-only group keys. Anything else is returned as it is. Loaded as it was,
    torch would cast the scaled E4M3 moments to numbers as large as their scale (5e5x to 1e14x too large)."""
    states = state_dict.get("state", {})
    if not any(isinstance(s, dict) and "exp_avg_scale" in s for s in states.values()):
        return state_dict
    new_states = {}
    for pid, state in states.items():
        state = dict(state)
        for key in ("exp_avg", "exp_avg_sq"):
            scale = state.pop(f"{key}_scale", None)
            if key in state and scale is not None:
                state[key] = _decode(state[key], scale.to(state[key].device))
        new_states[pid] = state
    # "fused" too: LowBitAdamW's (None: when available) is not torch's switch of the same name
    groups = [{k: v for k, v in group.items() if k not in _OWN_KEYS + ("fused",)}
              for group in state_dict["param_groups"]]
    return {**state_dict, "state": new_states, "param_groups": groups}


def adam_checkpoint_problem(param_groups: list[dict], state_dict: dict[str, Any]) -> str | None:
    """Why `state_dict` (in Adam's form: `per_parameter_steps`) cannot load into an Adam/AdamW over `param_groups`,
    or None. Checked before anything changes: torch's load replaces the groups and states first, so an SGD
    checkpoint refused after it left SGD's groups behind (the next step failed on 'step'), and a moment of another
    parameter's shape loaded without a word and failed at the first step."""
    states = state_dict.get("state", {})
    for pid, entry in states.items():
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in entry]
        if missing:
            return f"the state of parameter {pid} has no {', '.join(missing)}: not an Adam/AdamW checkpoint"
    saved_groups = state_dict.get("param_groups", [])
    if any("betas" not in group for group in saved_groups):
        return "the checkpoint's parameter groups have no betas: not an Adam/AdamW checkpoint"
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in param_groups]:
        return None  # torch's load refuses other group sizes itself, before it changes anything
    # matched as torch's load matches them: the groups' parameters in order
    params = {pid: p for saved, group in zip(saved_groups, param_groups) for pid, p in zip(saved["params"],
                                                                                         group["params"])}
    for pid, entry in states.items():
        p = params.get(pid)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            value = entry.get(key)
            # a DTensor parameter (FSDP2) takes its global shape or its shard's
            if (p is not None and isinstance(value, torch.Tensor)
                    and tuple(value.shape) not in (tuple(p.shape), tuple(local_data(p).shape))):
                return (f"the {key} of parameter {pid} has shape {tuple(value.shape)} in the checkpoint, the "
                        f"parameter {tuple(p.shape)}: another model's checkpoint")
    return None


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW whose `exp_avg` / `exp_avg_sq` live in `exp_avg_dtype` / `exp_avg_sq_dtype`.

    Args:
        params: parameters (FP32, FP16 or BF16) or parameter groups.
        lr, betas, eps, weight_decay: as `torch.optim.AdamW` (decoupled weight decay).
        exp_avg_dtype, exp_avg_sq_dtype: storage of the moments (see module docstring).
        maximize: maximise the objective instead.
        fused: use the fused GPU kernel for CUDA parameters (default: when available).
        stochastic_rounding: write FP16/BF16 parameters back rounded stochastically (unbiased: updates
            below the format's resolution add up in expectation); False rounds to nearest, as MS-AMP does.
            FP32 parameters are written exactly either way.
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        exp_avg_dtype: Any = torch.float32,
        exp_avg_sq_dtype: Any = torch.float32,
        *,
        maximize: bool = False,
        fused: bool | None = None,
        stochastic_rounding: bool = True,
    ):
        if not isinstance(stochastic_rounding, bool):
            raise ValueError(f"{type(self).__name__}.stochastic_rounding={stochastic_rounding!r}: use True or False")
        if isinstance(lr, torch.Tensor) or not 0.0 <= lr:
            raise ValueError(f"{type(self).__name__}.lr={lr!r} must be a float >= 0")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"{type(self).__name__}.betas={betas!r} must be two floats in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"{type(self).__name__}.eps={eps!r} must be >= 0")
        if not 0.0 <= weight_decay:
            raise ValueError(f"{type(self).__name__}.weight_decay={weight_decay!r} must be >= 0")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            exp_avg_dtype=state_dtype("exp_avg_dtype", exp_avg_dtype),
            exp_avg_sq_dtype=state_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype),
            maximize=maximize, fused=fused, stochastic_rounding=stochastic_rounding,
        )
        super().__init__(params, defaults)
        self._fp8_layers: dict[int, Any] = {}  # id(weight) -> layer holding its FP8 gradient
        self._pre_step_fns: list = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point() or p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise ValueError(
                        f"{type(self).__name__} updates float32, float16 or bfloat16 parameters, got {p.dtype}"
                    )

    def _init_state(self, p: torch.Tensor, group: dict, step_on_device: bool = False) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if step_on_device else None)
            for key in ("exp_avg", "exp_avg_sq"):
                # zeros in the storage dtype with scale 1, what encoding FP32 zeros gives (a tensor of zeros keeps
                # the previous scale), without the FP32 tensors of the parameter's size that encoding made in the
                # first step beside every gradient (two for an E4M3 state: 1 GiB for a 32k x 4096 embedding)
                state[key] = torch.zeros_like(p, dtype=group[f"{key}_dtype"], memory_format=torch.preserve_format)
                state[f"{key}_scale"] = torch.ones((), dtype=torch.float32, device=p.device)
        return state

    # ---- FP8 weight gradients (backend="msamp") -------------------------------------------------
    def attach_fp8_grads(self, layers) -> None:
        """Read the gradients of these layers' weights from their FP8 gradient buffers.

        `layers` are `FP8Linear` modules (anything with `weight`, `fp8_grad_data`,
        `fp8_grad_scale`, `fp8_grad_valid`). `zero_grad()` clears those buffers too.
        """
        self._fp8_layers = {id(layer.weight): layer for layer in layers}

    def add_fp8_pre_step(self, fn) -> None:
        """Run `fn()` before every step (the backend's FP8 gradient reduction across ranks)."""
        self._pre_step_fns.append(fn)

    def fp8_layers(self) -> list:
        return list(self._fp8_layers.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        layers = self.fp8_layers()
        if layers:
            torch._foreach_zero_([layer.fp8_grad_valid for layer in layers])

    def _fp8_grads_present(self) -> dict[int, bool]:
        layers = self._fp8_layers
        if not layers:
            return {}
        # One device sync for all layers, instead of one per layer; only the unfused path asks.
        flags = torch.stack([layer.fp8_grad_valid for layer in layers.values()]).cpu().tolist()
        return {key: bool(flag) for key, flag in zip(layers, flags)}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for fn in self._pre_step_fns:
            fn()
        fp8_layers = self._fp8_layers
        fp8_present = None  # read from the device once, and only where an FP8 gradient's update runs unfused
        # each parameter's position seeds its rounding: the same on every rank that holds it
        ordinal = -1
        for group in self.param_groups:
            buckets: dict[tuple, list[AdamItem]] = {}  # one fused launch per bucket
            for p in group["params"]:
                ordinal += 1
                layer = fp8_layers.get(id(p))
                if layer is not None:
                    grad, grad_scale, valid = layer.fp8_grad_data, layer.fp8_grad_scale, layer.fp8_grad_valid
                elif p.grad is None:
                    continue
                else:
                    grad, grad_scale, valid = p.grad, None, None
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                fused = self._use_fused(p, grad, group)
                if valid is not None and not fused:
                    fp8_present = self._fp8_grads_present() if fp8_present is None else fp8_present
                    if not fp8_present[id(p)]:
                        continue
                    valid = None  # known to be present
                state = self._init_state(p, group, step_on_device=valid is not None)
                if valid is None:
                    state["step"] += 1
                else:  # whether the gradient arrived is known on the device only: count_present_steps counts it
                    state["step"] = state["step"].to(p.device)  # a no-op but after loading a checkpoint
                if fused:
                    # the kernels take pointers: FSDP2's DTensor shards (and wrapped weights) by their bytes
                    local_state = {k: local_data(v) if k != "step" else v for k, v in state.items()}
                    item = AdamItem(local_data(p), local_data(grad), grad_scale, local_state, valid, ordinal)
                    buckets.setdefault(bucket_key(item), []).append(item)
                else:
                    dense = grad.float() if grad_scale is None else grad.float() / grad_scale
                    self._reference_step(p, dense, state, group, ordinal)
            for items in buckets.values():
                if items[0].valid is not None:
                    count_present_steps(items)
                fused_low_bit_adam_step(items, group, decoupled=self._decoupled,
                                        stochastic_rounding=self._rounds(items[0].param, group))
        return loss

    def _use_fused(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> bool:
        if group["fused"] is False or p.device.type != "cuda":
            return False
        from ..kernels import triton_available

        if group["fused"] and not triton_available():
            raise RuntimeError(f"{type(self).__name__}(fused=True) needs Triton on a CUDA device")
        return triton_available() and p.is_contiguous() and grad.is_contiguous()

    @staticmethod
    def _rounds(p: torch.Tensor, group: dict) -> bool:
        # .get: a group a subclass or a caller built without the key rounds as the default does
        return p.dtype in ROUNDED_DTYPES and group.get("stochastic_rounding", True)

    def _reference_step(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, ordinal: int = 0) -> None:
        """The FP32 update in plain torch: the definition the fused kernel must match."""
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        step = state["step"].item()
        if group["maximize"]:
            grad = -grad
        param = p.float()
        if wd != 0:
            if self._decoupled:
                param.mul_(1 - lr * wd)
            else:
                grad = grad.add(param, alpha=wd)
        m = _decode(state["exp_avg"], state["exp_avg_scale"]).mul_(beta1).add_(grad, alpha=1 - beta1)
        v = _decode(state["exp_avg_sq"], state["exp_avg_sq_scale"]).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = (v.sqrt() / bias2**0.5).add_(eps)
        param.addcdiv_(m, denom, value=-lr / bias1)
        if self._rounds(p, group):
            generator = rounding_generator(rounding_seed(step, ordinal), p.device)
            # a DTensor (FSDP2) on its local shard: the random numbers are this rank's, for the values it holds
            target, value = (p.to_local(), param.to_local()) if isinstance(p, DTensor) else (p, param)
            target.copy_(stochastic_round(value, p.dtype, generator))
        else:
            p.copy_(param)
        state["exp_avg"], state["exp_avg_scale"] = _encode(m, group["exp_avg_dtype"], state["exp_avg_scale"])
        state["exp_avg_sq"], state["exp_avg_sq_scale"] = _encode(v, group["exp_avg_sq_dtype"],
                                                                 state["exp_avg_sq_scale"])

    def state_dict(self) -> dict[str, Any]:
        """torch's, with each group's state dtypes by name ("float8_e4m3fn"): torch.distributed.checkpoint (FSDP2's
        `save_state` through Accelerate) takes tensors, numbers and strings, and failed on a torch.dtype. Loading
        puts this optimizer's own dtypes back in either case."""
        saved = super().state_dict()
        for group in saved["param_groups"]:
            for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
                if isinstance(group.get(key), torch.dtype):
                    group[key] = str(group[key]).removeprefix("torch.")
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this optimizer, of a LowBitAdamW with other state dtypes (lowprec's O1 and O2,
        optimizer_states='fp8'), of torch's Adam/AdamW, or of TE's FusedAdam (te's fp8_weights: its FP32 masters are
        written into the parameters, `fused_adam_form`). The states keep this optimizer's dtypes: a saved
        moment is dequantised with its own scale and requantised into them (E4M3 <-> FP32 moves no value by
        more than E4M3's rounding), rather than keeping the checkpoint's precision behind the plan's back."""
        # torch casts floating-point states to the parameter's dtype on load: an FP32 moment or a
        # scale of 2**35 would become FP16 (inf). Take the saved tensors as they are instead.
        state_dict, masters = per_parameter_steps(state_dict)  # TE FusedAdam's (te's fp8_weights)
        own = [{key: group[key] for key in _OWN_KEYS if key in group} for group in self.param_groups]
        problem = adam_checkpoint_problem(self.param_groups, state_dict)
        if problem is not None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: {problem}; nothing was loaded")
        super().load_state_dict(state_dict)
        for group, dtypes in zip(self.param_groups, own):
            group.update(dtypes)  # the run's storage, not the checkpoint's
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        groups = [group for group in self.param_groups for _ in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p, group in zip(ids, params, groups):
            if pid not in saved:
                continue
            entry = saved[pid]
            state = self.state[p] = {}
            state["step"] = torch.as_tensor(entry["step"]).detach().to("cpu", torch.float32, copy=True).reshape(())
            for key in ("exp_avg", "exp_avg_sq"):
                stored = entry[key].detach().to(p.device, copy=True)  # a copy: the step updates states in place
                scale = entry.get(f"{key}_scale")  # torch's Adam: none, an unscaled FP32 moment
                scale = (torch.ones((), device=p.device) if scale is None
                         else scale.detach().to(p.device, torch.float32, copy=True))
                target = group[f"{key}_dtype"]
                if stored.dtype == target:  # the same storage: bit-exact, scale and all
                    state[key], state[f"{key}_scale"] = stored, scale
                else:
                    state[key], state[f"{key}_scale"] = _encode(_decode(stored, scale), target, scale)
        write_masters(self.param_groups, state_dict["param_groups"], masters)

    def state_bytes(self) -> int:
        """Bytes held by optimizer states (moments and their scales)."""
        return sum(
            t.numel() * t.element_size()
            for state in self.state.values()
            for key, t in state.items()
            if key != "step" and isinstance(t, torch.Tensor)
        )


class LowBitAdam(LowBitAdamW):
    """Adam with L2 regularisation (weight decay added to the gradient) and low-precision states."""

    _decoupled = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, exp_avg_dtype: Any = torch.float32,
                 exp_avg_sq_dtype: Any = torch.float32, *, maximize: bool = False, fused: bool | None = None,
                 stochastic_rounding: bool = True):
        super().__init__(params, lr, betas, eps, weight_decay, exp_avg_dtype, exp_avg_sq_dtype,
                         maximize=maximize, fused=fused, stochastic_rounding=stochastic_rounding)
