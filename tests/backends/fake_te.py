"""A stand-in for the few parts of `transformer_engine` that lowprec's TE adapter touches, for CPU tests.

A test double, not an emulator (but for the opt-in delayed-scaling casts below):
- `Linear`, `LayerNorm`, `RMSNorm` take TE 2.x's constructor arguments (names, keyword-only where TE's
  are, `device` defaulting to CUDA as TE's does) and compute in high precision.
- `autocast` only records how it was entered, and sets `module.fp8` for the forwards inside it, which
  is what TE's modules report. Inside it `Linear` saturates as TE's FP8 casts do: an inf input comes
  out as ±448, an inf output gradient as ±57344; NaN stays NaN.
- Extra state is TE's format (a pickled dict in a byte tensor). A TE-format payload given back to
  `set_extra_state` is recorded, never unpickled: TE itself gates that behind
  NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE.
- `common.recipe` has TE's recipe classes with only the fields lowprec sets, so a misnamed argument
  is a TypeError here as it is in TE.
- `quantized_model_init` records how it was entered (`quantized_init_calls`); the weights built inside it
  stay plain tensors (TE's are `Float8Tensor`s).
- `init_fp8_metadata` sets up `fp8_meta` under autocast as TE's does (recipe, FP8 maxima, DelayedScaling's scales
  of 1 and empty amax histories), once per recipe.
- With `emulation.delayed_casts` on (off by default), `Linear` under DelayedScaling casts its input and weight to
  E4M3 and its output gradient to E5M2 with the scales in `fp8_meta`, recording each amax in the history's first
  row as TE's casts do; `update_delayed_scales` is TE's update at the end of a step. Only for the tests of how
  those scales start (test_te_first_scales.py).
- `is_fp8_block_scaling_available` answers what `block_scaling` says; `optimizers.FusedAdam` takes TE's
  arguments, records the master weights it is given and gives them back (`get_unscaled_state`), and cannot step.

`install(monkeypatch)` puts the modules in `sys.modules` for one test; monkeypatch takes them out. The
`fake_te` and `te_missing` fixtures are defined here and imported by the test modules that use them
(a conftest.py here would shadow tests/conftest.py for `from conftest import ...`).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import pickle
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

_state = types.SimpleNamespace(enabled=False, recipe=None)
emulation = types.SimpleNamespace(delayed_casts=False)
autocast_calls: list[dict] = []
quantized_init_calls: list[dict] = []


# ---- transformer_engine.common.recipe ---------------------------------------------------------
class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def delayed(self) -> bool:
        return True


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID

    def delayed(self) -> bool:
        return False


@dataclass
class Float8BlockScaling:
    fp8_format: Format = Format.E4M3

    def delayed(self) -> bool:
        return False


@dataclass
class MXFP8BlockScaling:
    margin: int = 0
    fp8_format: Format = Format.E4M3

    def delayed(self) -> bool:
        return False


# ---- transformer_engine.pytorch --------------------------------------------------------------
@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None):
    autocast_calls.append({"enabled": enabled, "recipe": recipe})
    saved = (_state.enabled, _state.recipe)
    _state.enabled, _state.recipe = enabled, recipe
    try:
        yield
    finally:
        _state.enabled, _state.recipe = saved


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe=None, preserve_high_precision_init_val: bool = False):
    quantized_init_calls.append({"enabled": enabled, "recipe": recipe})
    yield


def _device(device) -> torch.device:
    device = torch.device("cuda" if device is None else device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("fake TE: a module was built on the default CUDA device, as TE does without device=")
    return device


class _BaseModule(nn.Module):
    """The parts of TE's base module that lowprec's subclasses call."""

    def __init__(self):
        super().__init__()
        self.fp8 = False
        self.fp8_meta: dict = {"fp8_checkpoint": False, "fp8_group": None}
        self.te_format_payloads: list[torch.Tensor] = []  # given to set_extra_state, not unpickled

    def init_fp8_meta_tensors(self, recipe) -> None:
        """Delayed scaling: scales and amax histories of 1 GEMM, 3 forward tensors (input, weight, output) and
        2 backward. Other recipes keep no such tensors."""
        if not recipe.delayed():
            return
        for key, n in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            self.fp8_meta[key] = types.SimpleNamespace(
                scale=torch.ones(n), amax_history=torch.zeros(recipe.amax_history_len, n)
            )

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        self.fp8 = _state.enabled
        self.fp8_meta["fp8_checkpoint"] = self.fp8  # as TE's: an eval forward outside FP8 clears it
        if not self.fp8:
            return
        recipe = _state.recipe if _state.recipe is not None else DelayedScaling()
        if self.fp8_meta.get("recipe") == recipe and ("scaling_fwd" in self.fp8_meta or not recipe.delayed()):
            return
        hybrid = recipe.fp8_format == Format.HYBRID
        self.fp8_meta.update(recipe=recipe, num_gemms=num_gemms, fp8_max_fwd=448.0,
                             fp8_max_bwd=57344.0 if hybrid else 448.0)
        if "scaling_fwd" not in self.fp8_meta:
            self.init_fp8_meta_tensors(recipe)

    def get_extra_state(self) -> torch.Tensor:
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8):
            return torch.empty(0, dtype=torch.uint8)
        state = {"recipe": self.fp8_meta["recipe"]}
        if "scaling_fwd" in self.fp8_meta:
            state["scale_fwd"] = self.fp8_meta["scaling_fwd"].scale.clone()
            state["amax_history_fwd"] = self.fp8_meta["scaling_fwd"].amax_history.clone()
            state["scale_bwd"] = self.fp8_meta["scaling_bwd"].scale.clone()
            state["amax_history_bwd"] = self.fp8_meta["scaling_bwd"].amax_history.clone()
        state["extra_fp8_variables"] = {
            k: v for k, v in self.fp8_meta.items() if isinstance(v, (bool, int, float, str, tuple, list))
        }
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None or state.numel() == 0:
            return
        self.te_format_payloads.append(state)


class Linear(_BaseModule):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False, *, bias: bool = True,
                 params_dtype: torch.dtype | None = None, device="cuda"):
        super().__init__()
        device = _device(device)
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        # TE initialises weights itself; a constant makes a missing copy visible.
        self.weight = nn.Parameter(torch.full((out_features, in_features), 0.125, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.init_fp8_metadata()
        if self.fp8 and emulation.delayed_casts and self.fp8_meta["recipe"].delayed():
            return self._delayed_forward(x)
        # TE computes in the activation dtype whatever its parameters are stored in (FP16 weights
        # of level O1/O2 included): it quantises or casts them first.
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.fp8:
            return _SaturatingCast.apply(F.linear(_SaturatingCast.apply(x, 448.0, None), self.weight.to(x.dtype), bias),
                                         None, 57344.0)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def _delayed_forward(self, x: torch.Tensor) -> torch.Tensor:
        meta, fwd = self.fp8_meta, self.fp8_meta["scaling_fwd"]
        xq = _DelayedCast.apply(x, fwd, 0, meta["fp8_max_fwd"], torch.float8_e4m3fn)
        wq = _DelayedCast.apply(self.weight.to(x.dtype), fwd, 1, meta["fp8_max_fwd"], torch.float8_e4m3fn)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        bwd_dtype = torch.float8_e5m2 if meta["fp8_max_bwd"] > 448 else torch.float8_e4m3fn
        return _DelayedGradCast.apply(F.linear(xq, wq, bias), meta["scaling_bwd"], meta["fp8_max_bwd"], bwd_dtype)


def _cast(t: torch.Tensor, state, index: int, fp8_max: float, dtype: torch.dtype) -> torch.Tensor:
    """TE's delayed-scaling cast: the amax into the history's first row, then saturate(t * scale) in FP8 / scale."""
    with torch.no_grad():
        row = state.amax_history[0]
        row[index] = torch.maximum(row[index], t.detach().abs().amax().float())
        scale = state.scale[index]
        return ((t * scale).clamp(-fp8_max, fp8_max).to(dtype).to(t.dtype) / scale).to(t.dtype)


class _DelayedCast(torch.autograd.Function):
    """Forward: `_cast`. Backward: the gradient as it is (TE's GEMMs take the FP8 copies as their operands)."""

    @staticmethod
    def forward(ctx, t, state, index, fp8_max, dtype):
        return _cast(t, state, index, fp8_max, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class _DelayedGradCast(torch.autograd.Function):
    """Forward: the tensor as it is. Backward: `_cast` of the gradient with the output-gradient slot."""

    @staticmethod
    def forward(ctx, y, state, fp8_max, dtype):
        ctx.state, ctx.fp8_max, ctx.dtype = state, fp8_max, dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return _cast(grad, ctx.state, 0, ctx.fp8_max, ctx.dtype), None, None, None


@torch.no_grad()
def update_delayed_scales(module: nn.Module) -> None:
    """TE's update at the end of a step (amax_compute_algo "max"): each scale from its history's amax, then the
    history rolled and its first row cleared."""
    meta = module.fp8_meta
    for key, fp8_max in (("scaling_fwd", meta["fp8_max_fwd"]), ("scaling_bwd", meta["fp8_max_bwd"])):
        state = meta[key]
        amax = state.amax_history.amax(dim=0)
        new = fp8_max / amax / 2.0 ** meta["recipe"].margin
        state.scale.copy_(torch.where((amax > 0) & torch.isfinite(amax), new, state.scale))
        state.amax_history.copy_(torch.roll(state.amax_history, -1, 0))
        state.amax_history[0].zero_()


class _SaturatingCast(torch.autograd.Function):
    """TE's FP8 casts saturate: inf comes out as the format's max, NaN as NaN (measured on an H100,
    results/gpu/2026-11-24-h100-te-nonfinite). Forward: the input clamped at `fwd_max` (E4M3); backward:
    the gradient clamped at `bwd_max` (E5M2); None leaves that side as it is."""

    @staticmethod
    def forward(ctx, x, fwd_max, bwd_max):
        ctx.bwd_max = bwd_max
        return x.clamp(-fwd_max, fwd_max) if fwd_max is not None else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad.clamp(-ctx.bwd_max, ctx.bwd_max) if ctx.bwd_max is not None else grad), None, None


class _Norm(_BaseModule):
    def __init__(self, normalized_shape, eps: float = 1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma: bool = False, *, device=None, dtype=None, has_bias: bool):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        device, dtype = _device(device), dtype or params_dtype or torch.get_default_dtype()
        self.normalized_shape, self.eps, self.zero_centered_gamma = shape, eps, zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(shape, dtype=dtype, device=device))
        if has_bias:
            self.bias = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))

    def gamma(self) -> torch.Tensor:
        return 1 + self.weight if self.zero_centered_gamma else self.weight


class LayerNorm(_Norm):
    def __init__(self, normalized_shape, eps: float = 1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma: bool = False, *, device=None, dtype=None):
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype, zero_centered_gamma,
                         device=device, dtype=dtype, has_bias=True)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.gamma(), self.bias, self.eps)


class RMSNorm(_Norm):
    def __init__(self, normalized_shape, eps: float = 1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma: bool = False, *, device=None, dtype=None):
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype, zero_centered_gamma,
                         device=device, dtype=dtype, has_bias=False)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gamma()


block_scaling = types.SimpleNamespace(available=True, reason="")


def is_fp8_block_scaling_available(return_reason: bool = False):
    """TE's answer for this process's GPU; tests set `block_scaling` to choose it."""
    return (block_scaling.available, block_scaling.reason) if return_reason else block_scaling.available


class FusedAdam(torch.optim.Optimizer):
    """TE's FusedAdam constructor and master-weight API (TE 2.x names); `step` is TE's CUDA kernel, not here."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = 1 if adam_w_mode else 0
        for dtype in (exp_avg_dtype, exp_avg_sq_dtype):  # TE's own check
            if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.uint8):
                raise RuntimeError("FusedAdam only supports fp32/fp16/bf16/fp8 optimizer states.")
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.master_weights, self.master_weight_dtype = master_weights, master_weight_dtype
        self.scaled_state: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), state name) -> value

    def initialize_state(self, param, store_param_remainders):
        # TE's: zero moments in their dtypes and, with master weights, an FP32 master from the parameter's value;
        # a DTensor parameter's (FSDP2's shard) states are DTensors of its placements, for DCP
        from torch.distributed.tensor import DTensor

        local = param._local_tensor if isinstance(param, DTensor) else param
        values = {"exp_avg": torch.zeros(local.shape, dtype=self.exp_avg_dtype),
                  "exp_avg_sq": torch.zeros(local.shape, dtype=self.exp_avg_sq_dtype)}
        if self.master_weights:
            values["master_param"] = local.detach().float().clone()
        for name, value in values.items():
            self.state[param][name] = value if not isinstance(param, DTensor) else DTensor.from_local(
                value, device_mesh=param.device_mesh, placements=param.placements, shape=param.size(),
                stride=param.stride())

    def get_unscaled_state(self, param, state_name):
        held = self.state[param][state_name]
        return getattr(held, "_local_tensor", held).float()

    _STATE_DTYPES = ("exp_avg", "exp_avg_sq", "master_param")  # TE's name_to_dtype_map: no other state names

    def set_scaled_state(self, param, state_name, unscaled_state):
        from torch.distributed.tensor import DTensor

        if state_name not in self._STATE_DTYPES:
            raise KeyError(state_name)  # TE's lookup of the state's dtype
        assert unscaled_state.dtype == torch.float32  # TE's assertion
        held = self.state[param].get(state_name)
        if held is None:  # TE's _initialize_state: a new state of the parameter's (local) shape
            local = param._local_tensor if isinstance(param, DTensor) else param
            held = torch.empty(local.shape, dtype=torch.float32)
            self.state[param][state_name] = held if not isinstance(param, DTensor) else DTensor.from_local(
                held, device_mesh=param.device_mesh, placements=param.placements, shape=param.size(),
                stride=param.stride())
        getattr(held, "_local_tensor", held).copy_(unscaled_state)
        self.scaled_state[(id(param), state_name)] = unscaled_state.clone()

    def load_state_dict(self, state_dict):
        # TE's: torch's load, then each saved state made again by name (set_scaled_state of its FP32 value), so a
        # state TE has no dtype for (Adam's per-parameter "step") is a KeyError, as in TE
        from torch.distributed.tensor import DTensor

        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(ids, params):
            if pid in state_dict["state"]:
                self.state[p] = {}
                for name, value in state_dict["state"][pid].items():
                    value = value._local_tensor if isinstance(value, DTensor) else value
                    self.set_scaled_state(p, name, value.float())


# TE's classes live in TE's modules: lowprec recognises TE modules by that, and pickle finds classes by it.
for _cls in (Linear, LayerNorm, RMSNorm):
    _cls.__module__ = "transformer_engine.pytorch"
for _cls in (Format, DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling):
    _cls.__module__ = "transformer_engine.common.recipe"


# ---- installation ------------------------------------------------------------------------------
def _module(name: str, package: bool = False, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    module.__dict__.update(attrs)
    return module


def fill_delayed_state(module: nn.Module, recipe: DelayedScaling, seed: int = 0) -> None:
    """Put DelayedScaling state into `module.fp8_meta` as TE leaves it after some FP8 steps."""
    g = torch.Generator().manual_seed(seed)
    module.fp8_meta["recipe"] = recipe
    module.fp8_meta["num_gemms"] = 1
    module.fp8_meta["fp8_max_fwd"] = 448.0
    module.fp8_meta["fp8_max_bwd"] = 57344.0
    module.init_fp8_meta_tensors(recipe)
    for key in ("scaling_fwd", "scaling_bwd"):
        meta = module.fp8_meta[key]
        meta.scale.copy_(torch.rand(meta.scale.shape, generator=g) * 100)
        meta.amax_history.copy_(torch.rand(meta.amax_history.shape, generator=g))
    module.fp8_meta["fp8_checkpoint"] = True


def install(monkeypatch) -> types.ModuleType:
    """Make `import transformer_engine[.pytorch|.common.recipe]` return this double for one test."""
    autocast_calls.clear()
    quantized_init_calls.clear()
    emulation.delayed_casts = False
    _state.enabled, _state.recipe = False, None
    block_scaling.available, block_scaling.reason = True, ""
    recipe = _module("transformer_engine.common.recipe", Format=Format, DelayedScaling=DelayedScaling,
                     Float8CurrentScaling=Float8CurrentScaling, Float8BlockScaling=Float8BlockScaling,
                     MXFP8BlockScaling=MXFP8BlockScaling)
    common = _module("transformer_engine.common", package=True, recipe=recipe)
    optimizers = _module("transformer_engine.pytorch.optimizers", FusedAdam=FusedAdam)
    pytorch = _module("transformer_engine.pytorch", package=True, Linear=Linear, LayerNorm=LayerNorm, RMSNorm=RMSNorm,
                      autocast=autocast, is_fp8_block_scaling_available=is_fp8_block_scaling_available,
                      quantized_model_init=quantized_model_init,
                      optimizers=optimizers)
    root = _module("transformer_engine", package=True, common=common, pytorch=pytorch)
    for module in (root, common, recipe, pytorch, optimizers):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return pytorch


@contextlib.contextmanager
def installed(monkeypatch):
    """This double as `transformer_engine` while the block runs (`monkeypatch` takes it out afterwards);
    lowprec's cached look-ups are cleared around it."""
    from lowprec.backends.te import modules as te_modules
    from lowprec.utils import imports

    imports.availability.cache_clear()
    te_modules.module_classes.cache_clear()
    try:
        yield install(monkeypatch)
    finally:
        imports.availability.cache_clear()
        te_modules.module_classes.cache_clear()


# ---- fixtures (imported by the test modules that use them) -------------------------------------
@pytest.fixture
def fake_te(monkeypatch):
    """This double as `transformer_engine` for one test."""
    with installed(monkeypatch) as module:
        yield module


@pytest.fixture
def te_missing(monkeypatch):
    """TransformerEngine absent, even on a machine that has it: looked up under a module name that does not exist."""
    from lowprec.utils import imports

    real = imports.OPTIONAL_PACKAGES["transformer_engine"]
    monkeypatch.setitem(
        imports.OPTIONAL_PACKAGES, "transformer_engine",
        imports.OptionalPackage("lowprec_no_such_te.pytorch", real.distribution, real.min_version, real.install_hint),
    )
    imports.availability.cache_clear()
    yield real
    imports.availability.cache_clear()
