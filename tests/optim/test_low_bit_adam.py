"""`LowBitAdamW` / `LowBitAdam`: Adam(W) with FP32/BF16/FP16/E4M3/E5M2 moments, on the CPU path.

References, none read back from the implementation:
- `torch.optim.AdamW` / `torch.optim.Adam` on FP32 (MS-AMP's tests/optim/test_adamw.py: after 4 steps on a
  4x4 Linear, lr 1e-3, weight decay 1e-3, parameters within atol 3e-4 for E4M3/FP16 state pairs);
- MS-AMP's LBAdamW math (reference/msamp.md §3) written out below: dequantise the moments with their
  old scale, update in FP32, pick a new power-of-two scale from the updated moment's amax, requantise.

The fused Triton kernel (lowprec/kernels/adam.py) is CUDA-only and not exercised here; the CPU path is
`_reference_step`, the definition that kernel must match.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from lowprec.backends.msamp.linear import FP8Linear
from lowprec.optim import LowBitAdam, LowBitAdamW
from lowprec.optim.low_bit_adam import state_dtype

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0, FP16: 65504.0}
PAIRS = {  # optimizer class -> torch reference
    LowBitAdamW: torch.optim.AdamW,
    LowBitAdam: torch.optim.Adam,
}

# Tolerance on the parameters after 4 steps (lr 1e-3) against torch's FP32 optimizer. Adam's update
# is about lr * m / sqrt(v); a relative error u in the stored m (u_v/2 from v through the sqrt)
# moves each step by <= lr * u. Half-ulps: E4M3 1/16, E5M2 1/8, BF16 1/256, FP16 1/2048, so 4 steps
# allow ~2.5e-4 for E4M3 (MS-AMP's 3e-4) and ~5e-4 for E5M2.
STATE_CASES = [
    # (exp_avg, exp_avg_sq, atol)
    (FP32, FP32, 1e-6),
    (E4M3, E4M3, 3e-4),
    (E4M3, FP16, 3e-4),  # MS-AMP O2
    (FP16, E4M3, 3e-4),
    (FP16, FP16, 3e-4),
    (BF16, BF16, 5e-5),
    (BF16, FP32, 5e-5),
    (E5M2, FP16, 6e-4),
    (FP16, E5M2, 6e-4),
    (E5M2, E5M2, 6e-4),
]
STATE_IDS = [f"{str(m)[6:]}-{str(v)[6:]}" for m, v, _ in STATE_CASES]


def pow2_scale(amax: float, fmt_max: float) -> float:
    return 2.0 ** math.floor(math.log2(fmt_max / amax))


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |x| (at least the smallest normal's spacing)."""
    finfo = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(x.abs().float().clamp_min(finfo.tiny)))
    return torch.exp2(exponent) * finfo.eps


def train_pair(opt_cls, ref_cls, steps=4, *, param_dtype=FP32, seed=0, opt_kwargs=None, ref_kwargs=None):
    """MS-AMP's test: a 4x4 Linear, trained by both optimizers on the same data, params compared."""
    torch.manual_seed(seed)
    reference = nn.Linear(4, 4)
    model = copy.deepcopy(reference).to(param_dtype)
    ref_opt = ref_cls(reference.parameters(), **{"lr": 1e-3, "weight_decay": 1e-3, **(ref_kwargs or {})})
    opt = opt_cls(model.parameters(), **{"lr": 1e-3, "weight_decay": 1e-3, **(opt_kwargs or {})})
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        for net, o, dtype in ((reference, ref_opt, FP32), (model, opt, param_dtype)):
            o.zero_grad()
            net(x.to(dtype)).float().pow(2).sum().backward()
            o.step()
    return model, reference, opt, ref_opt


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


# ---- numerics against torch ---------------------------------------------------------------------

@pytest.mark.parametrize("m_dtype,v_dtype,atol", STATE_CASES, ids=STATE_IDS)
@pytest.mark.parametrize("opt_cls", [LowBitAdamW, LowBitAdam])
def test_matches_torch_adam_after_four_steps(opt_cls, m_dtype, v_dtype, atol):
    model, reference, opt, _ = train_pair(opt_cls, PAIRS[opt_cls],
                                          opt_kwargs=dict(exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype))
    diff = max_param_diff(model, reference)
    assert diff < atol, diff
    # The parameters moved (4 steps of ~lr each): agreement is not because nothing happened.
    torch.manual_seed(0)
    assert max_param_diff(model, nn.Linear(4, 4)) > 2e-3
    for p in model.parameters():
        state = opt.state[p]
        assert state["exp_avg"].dtype == m_dtype and state["exp_avg_sq"].dtype == v_dtype
        assert state["step"].item() == 4


def test_low_bit_states_really_lose_precision():
    """E4M3 moments differ from FP32 ones measurably (so the state dtype is not just a label)."""
    fp32, *_ = train_pair(LowBitAdamW, torch.optim.AdamW)
    o2, *_ = train_pair(LowBitAdamW, torch.optim.AdamW, opt_kwargs=dict(exp_avg_dtype=E4M3, exp_avg_sq_dtype=FP16))
    assert max_param_diff(fp32, o2) > 1e-6


def test_adam_and_adamw_differ_with_weight_decay():
    """LowBitAdam adds the decay to the gradient (L2), LowBitAdamW decays the weight (decoupled)."""
    kwargs = dict(opt_kwargs=dict(weight_decay=0.5), ref_kwargs=dict(weight_decay=0.5))
    adam, adam_ref, *_ = train_pair(LowBitAdam, torch.optim.Adam, **kwargs)
    adamw, adamw_ref, *_ = train_pair(LowBitAdamW, torch.optim.AdamW, **kwargs)
    assert max_param_diff(adam, adam_ref) < 1e-6 and max_param_diff(adamw, adamw_ref) < 1e-6
    assert max_param_diff(adam, adamw) > 1e-5


def test_defaults_match_torch():
    p = [nn.Parameter(torch.zeros(2))]
    for cls, ref in PAIRS.items():
        ours, theirs = cls(p).defaults, ref(p).defaults
        for key in ("lr", "betas", "eps", "weight_decay", "maximize"):
            assert ours[key] == theirs[key], (cls.__name__, key)
        assert ours["exp_avg_dtype"] == FP32 and ours["exp_avg_sq_dtype"] == FP32


def test_ms_amp_reference_math_for_o2_states():
    """Step by step against MS-AMP's LBAdamW (reference/msamp.md §3), E4M3 exp_avg + FP16 exp_avg_sq."""
    gen = torch.Generator().manual_seed(3)
    p = nn.Parameter(torch.randn(64, generator=gen))
    opt = LowBitAdamW([p], lr=1e-2, weight_decay=0.1, exp_avg_dtype=E4M3, exp_avg_sq_dtype=FP16)
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.1
    param = p.detach().clone()
    m_q, m_s = torch.zeros(64, dtype=E4M3), 1.0  # zeros(fp32).cast(qtype): amax 0 -> scale 1
    v_q, v_s = torch.zeros(64, dtype=FP16), 1.0
    for t in range(1, 6):
        grad = torch.randn(64, generator=gen) * 10.0 ** (2 - t)  # gradients shrinking 100x per step
        p.grad = grad.clone()
        opt.step()
        # MS-AMP: dequantise with the old scale, update in FP32, new scale from the updated amax.
        param = param * (1 - lr * wd)
        m = b1 * (m_q.float() / m_s) + (1 - b1) * grad
        v = b2 * (v_q.float() / v_s) + (1 - b2) * grad * grad
        denom = v.sqrt() / math.sqrt(1 - b2**t) + eps
        param = param - lr / (1 - b1**t) * (m / denom)
        m_s = pow2_scale(m.abs().max().item(), 448.0)
        v_s = pow2_scale(v.abs().max().item(), 65504.0)
        m_q = (m * m_s).clamp(-448, 448).to(E4M3)
        v_q = (v * v_s).clamp(-65504, 65504).to(FP16)

        state = opt.state[p]
        assert state["exp_avg_scale"].item() == m_s and state["exp_avg_sq_scale"].item() == v_s
        # FP32 rounding order may differ by an ulp before the cast; allow one step of the format.
        torch.testing.assert_close(state["exp_avg"].float() / m_s, m_q.float() / m_s, rtol=0.07, atol=0)
        torch.testing.assert_close(state["exp_avg_sq"].float() / v_s, v_q.float() / v_s, rtol=1e-3, atol=0)
        torch.testing.assert_close(p.detach(), param, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, FP16])
def test_scaled_state_fills_the_top_octave_of_its_format(dtype):
    """Power-of-two scale from the updated amax: stored amax in (fp_max/2, fp_max], scale a power of 2."""
    gen = torch.Generator().manual_seed(0)
    for magnitude in (1e-6, 1.0, 1e5):
        p = nn.Parameter(torch.randn(256, generator=gen))
        opt = LowBitAdamW([p], exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
        p.grad = torch.randn(256, generator=gen) * magnitude
        opt.step()
        for key in ("exp_avg", "exp_avg_sq"):
            stored, scale = opt.state[p][key], opt.state[p][f"{key}_scale"].item()
            assert math.log2(scale) == round(math.log2(scale))
            top = stored.float().abs().max().item()
            # `>=`: rounding to the format may land exactly on fp_max/2
            assert FORMAT_MAX[dtype] / 2 <= top <= FORMAT_MAX[dtype], (key, magnitude, top)


@pytest.mark.parametrize("m_dtype,v_dtype", [(FP32, FP32), (E4M3, FP16)])
@pytest.mark.parametrize("param_dtype", [FP16, BF16])
def test_low_precision_params_are_updated_in_fp32_then_rounded(param_dtype, m_dtype, v_dtype):
    """No master weight: each step updates p.float() in FP32 and rounds once into p's dtype (to nearest
    here, as MS-AMP does; tests/optim/test_stochastic_rounding.py tests the default, stochastic rounding).

    Reference: torch AdamW on an FP32 shadow that is re-rounded to `param_dtype` after each step.
    With FP32 states the two agree to one ulp of the parameter format (FP32 rounding-order ties);
    with E4M3 moments each step may also differ by lr * 2**-4 (E4M3 half-ulp), which can push a
    rounding to the neighbouring value, so up to that plus one ulp per step.
    """
    steps, lr = 6, 1e-2
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=gen).to(param_dtype)
    p = nn.Parameter(w.clone())
    shadow = nn.Parameter(w.float())
    opt = LowBitAdamW([p], lr=lr, weight_decay=1e-3, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
                      stochastic_rounding=False)
    ref = torch.optim.AdamW([shadow], lr=lr, weight_decay=1e-3)
    for _ in range(steps):
        g = torch.randn(8, 8, generator=gen).to(param_dtype)
        p.grad, shadow.grad = g.clone(), g.float()
        opt.step()
        ref.step()
        with torch.no_grad():
            shadow.copy_(shadow.to(param_dtype).float())
        assert p.dtype == param_dtype
    one_ulp = ulp(shadow.detach(), param_dtype)
    bound = one_ulp if m_dtype == FP32 else steps * (lr * 2**-4 + one_ulp)
    diff = (p.detach().float() - shadow.detach()).abs()
    assert (diff <= bound).all()
    if m_dtype == FP32:
        assert (diff == 0).float().mean() > 0.9  # ties are rare: almost all bit-identical
    # the updates were not all rounded away (lr 1e-2 is above the half-ulp of these weights)
    assert not torch.equal(p.detach(), w)


@pytest.mark.parametrize("param_dtype,atol", [(FP16, 1.5e-3), (BF16, 8e-3)])
def test_low_precision_params_track_fp32_training(param_dtype, atol):
    """MS-AMP's 4-step test with FP16/BF16 parameters, against FP32 AdamW; the tolerance adds about one
    half-ulp of |w| < 1 per step (FP16 2**-11, BF16 2**-8) to the O2 state tolerance."""
    model, reference, *_ = train_pair(LowBitAdamW, torch.optim.AdamW, param_dtype=param_dtype,
                                      opt_kwargs=dict(exp_avg_dtype=E4M3, exp_avg_sq_dtype=FP16))
    assert all(p.dtype == param_dtype for p in model.parameters())
    assert max_param_diff(model, reference) < atol


@pytest.mark.parametrize("opt_cls", [LowBitAdamW, LowBitAdam])
def test_maximize_matches_torch(opt_cls):
    model, reference, *_ = train_pair(opt_cls, PAIRS[opt_cls], opt_kwargs=dict(maximize=True),
                                      ref_kwargs=dict(maximize=True))
    assert max_param_diff(model, reference) < 1e-6
    plain, *_ = train_pair(opt_cls, PAIRS[opt_cls])
    assert max_param_diff(model, plain) > 1e-3  # maximize really flipped the direction


def test_amsgrad_is_not_offered():
    # MS-AMP's LBAdamW raises for amsgrad=True; here the keyword does not exist at all.
    with pytest.raises(TypeError, match="amsgrad"):
        LowBitAdamW([nn.Parameter(torch.zeros(2))], amsgrad=True)


def test_param_groups_with_different_lr_match_torch():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = copy.deepcopy(reference)

    def groups(net):
        return [{"params": net[0].parameters(), "lr": 1e-2},
                {"params": net[1].parameters(), "lr": 1e-4, "weight_decay": 0.1, "betas": (0.8, 0.99)}]

    opt = LowBitAdamW(groups(model), lr=1e-3)
    ref = torch.optim.AdamW(groups(reference), lr=1e-3)
    assert opt.param_groups[1]["betas"] == (0.8, 0.99) and opt.param_groups[0]["weight_decay"] == 1e-2
    for _ in range(3):
        x = torch.randn(5, 4)
        for net, o in ((model, opt), (reference, ref)):
            o.zero_grad()
            net(x).sum().backward()
            o.step()
    assert max_param_diff(model, reference) < 1e-6


def test_lr_scheduler_drives_the_group_lr():
    """A torch LR scheduler changes group["lr"] between steps; the step must read it each time."""
    torch.manual_seed(0)
    reference = nn.Linear(4, 4)
    model = copy.deepcopy(reference)
    opt, ref = LowBitAdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5**step) for o in (opt, ref)]
    for _ in range(4):
        x = torch.randn(5, 4)
        for net, o in ((model, opt), (reference, ref)):
            o.zero_grad()
            net(x).sum().backward()
            o.step()
        for schedule in schedules:
            schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 16)
    assert max_param_diff(model, reference) < 1e-6


def test_closure_is_evaluated_with_grad_and_its_loss_returned():
    torch.manual_seed(0)
    reference = nn.Linear(4, 4)
    model = copy.deepcopy(reference)
    x = torch.randn(6, 4)
    opt, ref = LowBitAdamW(model.parameters()), torch.optim.AdamW(reference.parameters())

    def closure_for(net, o):
        def closure():
            o.zero_grad()
            loss = net(x).pow(2).mean()
            loss.backward()
            return loss
        return closure

    for _ in range(3):
        loss = opt.step(closure_for(model, opt))  # step() runs under no_grad; the closure needs grad
        ref_loss = ref.step(closure_for(reference, ref))
        assert isinstance(loss, torch.Tensor) and loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    assert max_param_diff(model, reference) < 1e-6
    assert opt.step() is None


def test_params_without_grad_are_skipped():
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = LowBitAdamW([a, b], exp_avg_dtype=E4M3, exp_avg_sq_dtype=FP16)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(3)) and b not in opt.state
    assert not torch.equal(a.detach(), torch.ones(3))


def test_step_leaves_the_gradient_untouched():
    for opt_cls, kwargs in ((LowBitAdam, dict(weight_decay=0.1)), (LowBitAdamW, dict(maximize=True))):
        p = nn.Parameter(torch.randn(5))
        grad = torch.randn(5)
        p.grad = grad.clone()
        opt_cls([p], **kwargs).step()
        assert torch.equal(p.grad, grad)


def test_zero_grad():
    p = nn.Parameter(torch.ones(3))
    opt = LowBitAdamW([p])
    p.grad = torch.ones(3)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(3))
    opt.zero_grad()
    assert p.grad is None


def test_empty_parameter_steps():
    p = nn.Parameter(torch.empty(0, 4))
    opt = LowBitAdamW([p], exp_avg_dtype=E4M3, exp_avg_sq_dtype=FP16)
    p.grad = torch.empty(0, 4)
    opt.step()
    assert opt.state[p]["exp_avg"].shape == (0, 4)


def test_sparse_gradients_are_refused():
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        LowBitAdamW([p]).step()


def test_tiny_gradients_never_produce_nan():
    p = nn.Parameter(torch.ones(4))
    opt = LowBitAdamW([p], exp_avg_dtype=E4M3, exp_avg_sq_dtype=FP16)
    for _ in range(2):
        p.grad = torch.tensor([1e-17, 0.0, 0.0, 0.0])
        opt.step()
    state = opt.state[p]
    assert torch.isfinite(state["exp_avg_sq_scale"]) and torch.isfinite(state["exp_avg_sq"].float()).all()
    assert torch.isfinite(p.detach()).all()


# ---- arguments ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arg", ["exp_avg_dtype", "exp_avg_sq_dtype"])
@pytest.mark.parametrize("bad", [torch.int32, torch.float64, "fp8", "int4", None, 8])
def test_bad_state_dtype_is_a_value_error_naming_argument_and_choices(arg, bad):
    with pytest.raises(ValueError) as info:
        LowBitAdamW([nn.Parameter(torch.zeros(2))], **{arg: bad})
    message = str(info.value)
    assert f"{arg}={bad!r}" in message
    for choice in ("torch.float32", "torch.bfloat16", "torch.float16", "torch.float8_e4m3fn", "torch.float8_e5m2"):
        assert choice in message


@pytest.mark.parametrize(
    "spelling,dtype",
    [("fp32", FP32), ("BF16", BF16), ("float16", FP16), ("e4m3", E4M3), ("E5M2", E5M2),
     # MS-AMP's spellings: uint8 = E4M3, int8 = E5M2 (reference/msamp.md §1.1, §3)
     (torch.uint8, E4M3), (torch.int8, E5M2), (E5M2, E5M2)],
)
def test_state_dtype_spellings(spelling, dtype):
    p = nn.Parameter(torch.ones(4))
    opt = LowBitAdamW([p], exp_avg_dtype=spelling, exp_avg_sq_dtype=spelling)
    p.grad = torch.ones(4)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == dtype and opt.state[p]["exp_avg_sq"].dtype == dtype


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(lr=-1.0), "lr"), (dict(lr=torch.tensor(1e-3)), "lr"), (dict(betas=(0.9, 1.0)), "betas"),
     (dict(betas=(0.9,)), "betas"), (dict(eps=-1e-8), "eps"), (dict(weight_decay=-0.1), "weight_decay")],
)
def test_bad_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LowBitAdamW([nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_unsupported_parameter_dtype(dtype):
    with pytest.raises(ValueError, match=str(dtype)):
        LowBitAdamW([torch.zeros(2, dtype=dtype)])


# ---- checkpoints --------------------------------------------------------------------------------

def _round_trip(obj):
    """torch.save / torch.load (weights_only, the default) as a checkpoint would do it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _training(param_dtype, m_dtype, v_dtype, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(param_dtype)
    opt = LowBitAdamW(model.parameters(), lr=1e-2, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype)
    return model, opt


def _steps(model, opt, start, count, dtype):
    for i in range(start, start + count):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i), dtype=torch.float32).to(dtype)
        opt.zero_grad()
        # a small loss keeps v tiny: its scale (up to ~2**40) would be inf if cast to FP16 params
        (model(x).float().pow(2).mean() * 1e-4).backward()
        opt.step()


@pytest.mark.parametrize("m_dtype,v_dtype", [(FP32, FP32), (E4M3, FP16), (E5M2, BF16)])
@pytest.mark.parametrize("param_dtype", [FP32, FP16])
def test_state_dict_resume_is_bit_identical(param_dtype, m_dtype, v_dtype):
    model, opt = _training(param_dtype, m_dtype, v_dtype)
    _steps(model, opt, 0, 3, param_dtype)
    saved_model, saved_opt = _round_trip(model.state_dict()), _round_trip(opt.state_dict())
    _steps(model, opt, 3, 4, param_dtype)  # the uninterrupted run

    resumed, resumed_opt = _training(param_dtype, m_dtype, v_dtype, seed=123)  # different init
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    _steps(resumed, resumed_opt, 3, 4, param_dtype)

    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        a, b = opt.state[p], resumed_opt.state[q]
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key].float(), b[key].float()), key


@pytest.mark.parametrize("param_dtype", [FP32, FP16, BF16])
def test_state_dict_keeps_declared_state_dtypes(param_dtype):
    """torch's load_state_dict casts floating states to the parameter's dtype; these must not change."""
    model, opt = _training(param_dtype, E4M3, FP16)
    _steps(model, opt, 0, 2, param_dtype)
    saved = _round_trip(opt.state_dict())
    # MS-AMP's layout check: per-parameter keys and hyper-parameters in the groups
    group = saved["param_groups"][0]
    assert group["lr"] == 1e-2 and group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
    # by name, which the constructor takes too: torch.distributed.checkpoint (FSDP2's save_state) refuses a torch.dtype
    assert (group["exp_avg_dtype"], group["exp_avg_sq_dtype"]) == ("float8_e4m3fn", "float16")
    assert state_dtype("exp_avg_dtype", group["exp_avg_dtype"]) == E4M3
    for state in saved["state"].values():
        assert {"step", "exp_avg", "exp_avg_sq"} <= state.keys()
        assert state["exp_avg"].dtype == E4M3 and state["exp_avg_sq"].dtype == FP16
    fresh_model, fresh = _training(param_dtype, E4M3, FP16)
    fresh.load_state_dict(saved)
    for p in fresh_model.parameters():
        state = fresh.state[p]
        assert state["exp_avg"].dtype == E4M3 and state["exp_avg_sq"].dtype == FP16
        assert state["exp_avg_scale"].dtype == FP32 and torch.isfinite(state["exp_avg_sq_scale"])
        assert state["step"].item() == 2


def test_loaded_state_is_a_copy():
    model, opt = _training(FP32, FP32, FP32)
    _steps(model, opt, 0, 1, FP32)
    saved = opt.state_dict()
    fresh_model, fresh = _training(FP32, FP32, FP32)
    fresh.load_state_dict(saved)
    _steps(fresh_model, fresh, 1, 1, FP32)  # FP32 moments update in place: must not reach `opt`
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert opt.state[p]["step"].item() == 1
        assert not torch.equal(opt.state[p]["exp_avg"], fresh.state[q]["exp_avg"])


# ---- FP8 weight gradients (backend="msamp" FP8Linear) -------------------------------------------

def _fp8_layer(seed=0):
    torch.manual_seed(seed)
    return FP8Linear.from_float(nn.Linear(16, 8), emulate=True)  # FP16 weight, FP32 bias


def test_fp8_weight_gradient_drives_the_update():
    """The weight's gradient lives in the layer's E4M3 buffer, never in .grad; the step must use
    it, dequantised (value / scale). Reference: torch AdamW on an FP32 shadow of the FP16 weight,
    fed `layer.weight_grad()` and re-rounded to FP16 after each step, as LowBitAdamW does."""
    layer = _fp8_layer()
    opt = LowBitAdamW(layer.parameters(), lr=1e-2, weight_decay=1e-2, stochastic_rounding=False)
    opt.attach_fp8_grads([layer])
    shadow = nn.Parameter(layer.weight.detach().float())
    bias = nn.Parameter(layer.bias.detach().clone())
    ref = torch.optim.AdamW([shadow, bias], lr=1e-2, weight_decay=1e-2)
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        opt.zero_grad()
        for _ in range(1 + i % 2):  # odd steps accumulate two micro-batches in FP8
            layer(torch.randn(32, 16, generator=gen)).pow(2).mean().backward()
        assert layer.weight.grad is None and bool(layer.fp8_grad_valid)
        shadow.grad = layer.weight_grad()
        assert shadow.grad is not None and shadow.grad.abs().max() > 0
        bias.grad = layer.bias.grad.clone()
        opt.step()
        ref.step()
        with torch.no_grad():
            shadow.copy_(shadow.half().float())
    w = layer.weight.detach().float()
    assert ((w - shadow.detach()).abs() <= ulp(shadow.detach(), FP16)).all()
    torch.testing.assert_close(layer.bias.detach(), bias.detach(), rtol=0, atol=1e-6)
    assert opt.state[layer.weight]["step"].item() == 4


def test_fp8_gradient_is_dequantised_with_its_scale():
    """Same E4M3 bytes, scale doubled: the optimizer must see half the gradient (fp8 / scale)."""
    results = []
    for factor in (1.0, 2.0):
        layer = _fp8_layer()
        opt = LowBitAdamW([layer.weight], lr=1e-1, weight_decay=0.0, betas=(0.0, 0.0), eps=1.0)
        opt.attach_fp8_grads([layer])
        layer(torch.randn(32, 16, generator=torch.Generator().manual_seed(0))).sum().backward()
        layer.fp8_grad_scale.mul_(factor)
        grad = layer.weight_grad()
        w0 = layer.weight.detach().float()
        opt.step()
        # betas 0, eps 1: update = lr * g / (|g| + 1), so the gradient's size is visible
        expected = w0 - 0.1 * grad / (grad.abs() + 1)
        torch.testing.assert_close(layer.weight.detach().float(), expected.half().float(), rtol=0, atol=1e-3)
        results.append(layer.weight.detach().float() - w0)
    assert not torch.equal(results[0], results[1])


def test_fp8_zero_grad_clears_the_buffer_and_the_next_step_skips_the_weight():
    layer = _fp8_layer()
    opt = LowBitAdamW(layer.parameters(), lr=1e-2)
    opt.attach_fp8_grads([layer])
    assert opt.fp8_layers() == [layer]
    layer(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert not bool(layer.fp8_grad_valid) and layer.weight_grad() is None and layer.bias.grad is None
    weight = layer.weight.detach().clone()
    opt.step()  # nothing to apply: the stale FP8 bytes must not be reused
    assert torch.equal(layer.weight.detach(), weight)
    assert opt.state[layer.weight]["step"].item() == 1


def test_fp8_pre_step_runs_before_gradients_are_read():
    """The backend's FP8 all-reduce runs in a pre-step hook; its result is what the step applies."""
    layer = _fp8_layer()
    opt = LowBitAdamW([layer.weight], lr=1e-2)
    opt.attach_fp8_grads([layer])
    calls = []

    def reduce():
        calls.append(bool(layer.fp8_grad_valid))
        layer.fp8_grad_valid.zero_()  # e.g. a reduction that found this rank's gradient invalid

    opt.add_fp8_pre_step(reduce)
    layer(torch.randn(4, 16)).sum().backward()
    weight = layer.weight.detach().clone()
    opt.step()
    assert calls == [True]
    assert torch.equal(layer.weight.detach(), weight) and layer.weight not in opt.state


def test_fp8_layer_with_o2_states_tracks_fp32_adamw():
    """End to end at MS-AMP O2 (E4M3 + FP16 states, FP8 weight gradient, FP16 weight)."""
    layer = _fp8_layer()
    opt = LowBitAdamW(layer.parameters(), lr=1e-3, weight_decay=1e-3, exp_avg_dtype=E4M3, exp_avg_sq_dtype=FP16)
    opt.attach_fp8_grads([layer])
    shadow = nn.Parameter(layer.weight.detach().float())
    ref = torch.optim.AdamW([shadow], lr=1e-3, weight_decay=1e-3)
    for i in range(4):
        opt.zero_grad()
        layer(torch.randn(32, 16, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        shadow.grad = layer.weight_grad()
        opt.step()
        ref.step()
    # MS-AMP's 3e-4 plus the FP16 rounding of |w| < 0.25 over 4 steps (4 * 2**-14)
    assert (layer.weight.detach().float() - shadow.detach()).abs().max().item() < 3e-4 + 4 * 2**-14


@pytest.mark.parametrize("other", ["SGD", "Adam states without moments"])
def test_a_checkpoint_of_another_optimizer_is_refused_before_anything_changes(other):
    from lowprec.optim.low_bit_adam import LowBitAdamW

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 8))]
    optimizer = LowBitAdamW(params, lr=1e-2, exp_avg_dtype=torch.float8_e4m3fn)
    params[0].grad = torch.randn(8, 8)
    optimizer.step()
    if other == "SGD":
        sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        sgd.step()
        state = sgd.state_dict()
    else:
        state = optimizer.state_dict()
        state["state"][0] = {"step": state["state"][0]["step"]}
    groups, moments = [dict(g) for g in optimizer.param_groups], optimizer.state[params[0]]["exp_avg"].clone()
    with pytest.raises(ValueError, match="not an Adam/AdamW checkpoint; nothing was loaded"):
        optimizer.load_state_dict(state)
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in groups]
    assert torch.equal(optimizer.state[params[0]]["exp_avg"], moments)
    optimizer.step()  # and it still steps


@pytest.mark.parametrize("m_dtype,v_dtype", [(torch.float8_e4m3fn, torch.float16), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float8_e5m2)])
def test_first_step_makes_each_state_in_its_storage_dtype_without_an_fp32_copy(m_dtype, v_dtype):
    # an FP32 zeros tensor (and its scaled copy) per state and parameter, made while every gradient is alive, set
    # the first step's peak: states are made in their storage dtype, zeros with scale 1, as encoding zeros gives
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.tensors = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.tensors += [(t.dtype, t.numel()) for t in (out if isinstance(out, (tuple, list)) else [out])
                             if isinstance(t, torch.Tensor)]
            return out

    p = nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)))
    opt = LowBitAdamW([p], exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype, fused=False)
    with Made() as made:
        state = opt._init_state(p, opt.param_groups[0])
    assert [dtype for dtype, n in made.tensors if n == p.numel()] == [m_dtype, v_dtype]
    for key, dtype in (("exp_avg", m_dtype), ("exp_avg_sq", v_dtype)):
        assert state[key].dtype == dtype and not state[key].float().any() and state[key].shape == p.shape
        assert state[f"{key}_scale"].item() == 1.0
    # and the first step from them is torch's AdamW's (its update reads the moments in FP32 before they are stored)
    ref = nn.Parameter(p.detach().clone())
    p.grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 1e-2
    ref.grad = p.grad.clone()
    opt.step()
    torch.optim.AdamW([ref]).step()
    assert (p.detach() - ref.detach()).abs().max() / (ref.detach()).abs().max() < 1e-6


@pytest.mark.parametrize("m_dtype,v_dtype", [(E4M3, FP16), (FP32, FP32)])
def test_states_of_another_shape_are_refused_naming_the_parameter_and_both_shapes(m_dtype, v_dtype):
    # loaded without a word (exp_avg (48, 32) for a (64, 32) parameter), then the first step failed on the sizes
    def stepped(rows):
        params = [nn.Parameter(torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))),
                  nn.Parameter(torch.randn(rows, generator=torch.Generator().manual_seed(1)))]
        optimizer = LowBitAdamW(params, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        return params, optimizer

    _, other = stepped(48)
    params, optimizer = stepped(64)
    states = {p: {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    with pytest.raises(ValueError, match=r"the exp_avg of parameter 0 has shape \(48, 32\) in the checkpoint, the "
                                         r"parameter \(64, 32\): another model's checkpoint; nothing was loaded"):
        optimizer.load_state_dict(other.state_dict())
    for p in params:
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in states[p].items())
    optimizer.step()  # and it still steps


@pytest.mark.parametrize("m_dtype,v_dtype", [(E4M3, FP16), (E5M2, E4M3), (FP16, E5M2), (BF16, FP32)],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_moment_is_never_stored_finite(m_dtype, v_dtype, bad):
    # E4M3 exp_avg 448 and FP16 exp_avg_sq 65504 where torch's AdamW kept inf: clamped, as a finite overflow is
    from lowprec.optim.low_bit_adam import _decode

    p, ref = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    opt = LowBitAdamW([p], lr=1e-3, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype)
    torch_opt = torch.optim.AdamW([ref], lr=1e-3)
    p.grad, ref.grad = torch.tensor([bad, 1.0, -2.0]), torch.tensor([bad, 1.0, -2.0])
    opt.step()
    torch_opt.step()
    for key, dtype in (("exp_avg", m_dtype), ("exp_avg_sq", v_dtype)):
        got, want = _decode(opt.state[p][key], opt.state[p][f"{key}_scale"]), torch_opt.state[ref][key]
        assert not torch.isfinite(want[0])
        if want[0].isnan() or dtype == E4M3:  # E4M3 has no inf
            assert got[0].isnan(), (key, got, want)
        else:
            assert got[0] == want[0], (key, got, want)  # the format's inf, its sign kept
        # the finite ones finite, at the scale kept from before (1: a non-finite amax chooses none), whose E4M3
        # steps near 0.001 are 2**-9
        assert torch.allclose(got[1:], want[1:], rtol=0.07, atol=2**-9), (key, got, want)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, FP16])
def test_a_finite_value_past_the_format_still_saturates_beside_an_inf(dtype):
    from lowprec.optim.low_bit_adam import _decode, _encode

    # the inf keeps the previous scale (1): the finite 1e6 is past every format's max and saturates to it
    stored, scale = _encode(torch.tensor([float("inf"), 1e6, -1e6, 1.0]), dtype, torch.tensor(1.0))
    got = _decode(stored, scale)
    assert not torch.isfinite(got[0]) and (got[0] > 0 or got[0].isnan())
    assert got[1:].tolist() == [FORMAT_MAX[dtype], -FORMAT_MAX[dtype], 1.0]
