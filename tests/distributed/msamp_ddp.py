"""Two-process CPU (gloo) checks of backend="msamp"'s FP8 gradient communication.

Run by tests/backends/test_msamp_comm.py:

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/msamp_ddp.py reducer OUT.json
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/msamp_ddp.py train OUT.json

`reducer`: `FP8GradReducer` on hand-made FP8 gradients, method "all_to_all" (gloo) and "nccl_fp8" (on
gloo with NCCL's FP8 all_reduce emulated, since the real one needs NCCL), plus what the constructor
says about "nccl_fp8" on gloo; and FP8Linear's delayed-scaling amaxes all-reduced across ranks
(`all_reduce_amaxes`, then `update_delayed_scales`) on hand-made amax windows.
`train`: `lowprec.Accelerator` with FP8RecipeKwargs(backend="msamp") under DDP, each rank on its own
half of every global batch. Nothing is asserted here: every rank records raw values (bytes, scales,
hashes, losses) and rank 0 writes them all to OUT.json for the pytest side to check. A scenario that
raises on both ranks is recorded as an error and the run goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

E4M3 = torch.float8_e4m3fn
TIMEOUT = datetime.timedelta(seconds=60)  # a scenario that fails on one rank only must not hang the run


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def _bytes(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).view(torch.uint8).tolist()


def _floats(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.detach().float().reshape(-1).tolist()]


def _scalar(t) -> float:
    return float(t) if not isinstance(t, torch.Tensor) else float(t.detach().float().item())


# ============================================================================================
# reducer: FP8GradReducer directly
# ============================================================================================
def _layers(shapes):
    from lowprec.backends.msamp.linear import FP8Linear

    return [FP8Linear(i, o, bias=False) for o, i in shapes]


def _set_grad(layer, values: torch.Tensor, scale: float | None = None, amax: float | None = None,
              valid: bool = True) -> None:
    """Put `values` in the layer's FP8 gradient buffer as its backward would (current scale unless given)."""
    from lowprec.kernels.scaling import compute_scale, quantize

    values = values.float().reshape(layer.fp8_grad_data.shape)
    true_amax = values.abs().amax()
    if scale is None:
        scale = compute_scale(true_amax, E4M3)
    scale = torch.as_tensor(scale, dtype=torch.float32)
    layer.fp8_grad_data.copy_(quantize(values, scale, E4M3))
    layer.fp8_grad_scale.copy_(scale)
    layer.fp8_grad_amax.copy_(true_amax if amax is None else torch.tensor(amax))
    layer.fp8_grad_valid.fill_(1.0 if valid else 0.0)


def _set_bytes(layer, data: list[int], scale: float, amax: float) -> None:
    layer.fp8_grad_data.copy_(torch.tensor(data, dtype=torch.uint8).view(E4M3).reshape(layer.fp8_grad_data.shape))
    layer.fp8_grad_scale.fill_(scale)
    layer.fp8_grad_amax.fill_(amax)
    layer.fp8_grad_valid.fill_(1.0)


def _snapshot(layers) -> list[dict]:
    out = []
    for layer in layers:
        out.append({
            "bytes": _bytes(layer.fp8_grad_data),
            "values": _floats(layer.fp8_grad_data.float() / layer.fp8_grad_scale),
            "scale": _scalar(layer.fp8_grad_scale),
            "amax": _scalar(layer.fp8_grad_amax),
            "valid": _scalar(layer.fp8_grad_valid),
        })
    return out


@contextlib.contextmanager
def emulated_nccl_fp8():
    """Let method="nccl_fp8" run on gloo: the group reports "nccl" and an all_reduce(SUM) of an FP8
    tensor is done as a ring would (adds in FP32, one rounding to FP8 after every addition, in rank
    order). Only FP8 all_reduces are emulated; every other collective is gloo's."""
    real_backend, real_all_reduce = dist.get_backend, dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        assert op == dist.ReduceOp.SUM and not async_op
        n = dist.get_world_size(group)
        gathered = torch.empty(n * tensor.numel(), dtype=torch.uint8)
        dist.all_gather_into_tensor(gathered, tensor.reshape(-1).view(torch.uint8).contiguous(), group=group)
        parts = gathered.view(tensor.dtype).view(n, -1).float()
        acc = parts[0].to(tensor.dtype)
        for i in range(1, n):
            acc = (acc.float() + parts[i]).to(tensor.dtype)
        tensor.view(-1).copy_(acc)
        return None

    dist.get_backend = lambda group=None: "nccl"
    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.get_backend, dist.all_reduce = real_backend, real_all_reduce


def _reducer(layers, method: str):
    from lowprec.optim.grad_reduce import FP8GradReducer

    if method == "nccl_fp8":
        with emulated_nccl_fp8():
            reducer = FP8GradReducer(layers, method="nccl_fp8")
    else:
        reducer = FP8GradReducer(layers, method=method)
    return reducer


def _reduce(reducer) -> None:
    if reducer.method == "nccl_fp8":
        with emulated_nccl_fp8():
            reducer.reduce()
    else:
        reducer.reduce()


# Layers of scenario "random": their shapes (out, in); 15 elements in the last one makes the packed
# buffer's length odd, so the all_to_all pads it.
RANDOM_SHAPES = [(32, 16), (48, 32), (16, 64), (3, 5)]


def scenario_random(rank: int, method: str) -> dict:
    """Gradients of different magnitudes per layer and per rank (so local scales differ across ranks)."""
    from lowprec.optim.grad_store import clip_grad_norm_, fp8_grad_norms

    layers = _layers(RANDOM_SHAPES)
    for i, layer in enumerate(layers):
        g_common = torch.Generator().manual_seed(100 + i)
        g_rank = torch.Generator().manual_seed(1000 * (rank + 1) + i)
        shape = layer.fp8_grad_data.shape
        magnitude = 10.0 ** (-2 - i) * (8.0 if (rank == 1 and i % 2 == 0) else 1.0)
        values = (torch.randn(shape, generator=g_common) + torch.randn(shape, generator=g_rank)) * magnitude
        if i == 1:
            values[0, :4] = 0.0  # exact zeros on both ranks
        if i == 0:
            # rank 0's scale is 8x the shared one here: these survive its own cast (as E4M3 subnormals)
            # but fall below half the smallest subnormal once shifted to the shared scale
            values[0, :2] = torch.tensor([4e-7, -4e-7]) if rank == 0 else 0.0
        _set_grad(layer, values)
    before = _snapshot(layers)
    reducer = _reducer(layers, method)
    _reduce(reducer)
    after = _snapshot(layers)
    # a second reduce() is a no-op only through reduce_if_pending(): pending was cleared
    pending_after = reducer.pending
    reducer.reduce_if_pending()
    unchanged_by_second = _snapshot(layers) == after
    # clipping after the reduction: same total on every rank, only scales change
    norms = fp8_grad_norms(layers, 2.0)
    total = clip_grad_norm_([layer.weight for layer in layers], layers, max_norm=0.5 * float(norms.norm()))
    clipped = _snapshot(layers)
    return {"before": before, "after": after, "pending_after_reduce": pending_after,
            "second_reduce_if_pending_noop": unchanged_by_second,
            "clip_total": _scalar(total), "clipped": clipped,
            "norm_after_clip": _scalar(fp8_grad_norms(layers, 2.0).norm())}


def scenario_bitpattern(rank: int, method: str) -> dict:
    """MS-AMP tests/operators/test_dist.py: E4M3 [0x4A, 0x58] (5, 16) on rank 0 and [0x50, 0x5C] (8, 24)
    on rank 1; MS-AMP's FP8 all_reduce(SUM) gives [0x55, 0x62] (13, 40). Both ranks hold scale 1."""
    layers = _layers([(2, 1)])
    data, amax = ([0x4A, 0x58], 16.0) if rank == 0 else ([0x50, 0x5C], 24.0)
    _set_bytes(layers[0], data, 1.0, amax)
    reducer = _reducer(layers, method)
    _reduce(reducer)
    return {"after": _snapshot(layers)}


def scenario_zero_invalid(rank: int, method: str) -> dict:
    """Layer 0: all-zero gradients on both ranks (amax 0; both ranks hold the previous shared scale 8).
    Layer 1: a gradient on rank 0 only; rank 1's buffer is stale (valid=0, big amax, odd scale, junk).
    Layer 2: no gradient on either rank.  Layer 3: a gradient on rank 1 only, rank 0 stale."""
    layers = _layers([(16, 16), (16, 16), (16, 16), (16, 16)])
    g = torch.Generator().manual_seed(7 + rank)
    junk = torch.randn(16, 16, generator=g) * 300
    _set_grad(layers[0], torch.zeros(16, 16), scale=8.0)
    if rank == 0:
        _set_grad(layers[1], torch.randn(16, 16, generator=torch.Generator().manual_seed(11)) * 0.01)
        _set_grad(layers[3], junk, scale=2.0 ** -10, amax=1e6, valid=False)
    else:
        _set_grad(layers[1], junk, scale=2.0 ** -10, amax=1e6, valid=False)
        _set_grad(layers[3], torch.randn(16, 16, generator=torch.Generator().manual_seed(12)) * 3.0)
    _set_grad(layers[2], junk, scale=0.5, amax=5.0, valid=False)
    before = _snapshot(layers)
    _reduce(_reducer(layers, method))
    return {"before": before, "after": _snapshot(layers)}


# scenario "nonfinite": layer -> the rank whose gradient holds a NaN. Both ranks, at both ends of the
# reducer's amax vector: whether all_reduce(MAX) keeps or drops a NaN depends on the operand order of the
# chunk it lands in (gloo: std::max), so every case is represented.
NAN_LAYERS = {0: 0, 1: 1, 3: 0, 4: 1}
FINITE_LAYER = 2
STALE_LAYERS = {5: 1, 6: 0}  # layer -> the rank with no gradient whose stale amax is NaN


def scenario_nonfinite(rank: int, method: str) -> dict:
    """NAN_LAYERS: one rank's gradient holds a NaN (amax NaN; as in its backward, compute_scale kept the
    previous scale, 1), the other rank's is finite (scale from its amax).  FINITE_LAYER: finite on both.
    STALE_LAYERS: one rank has a gradient; the other has none (valid=0) and its stale amax is NaN, as an
    earlier NaN step leaves it (zero_grad() clears only fp8_grad_valid)."""
    layers = _layers([(16, 16)] * 7)
    gen = torch.Generator().manual_seed(21 + rank)
    for i, layer in enumerate(layers):
        g = torch.randn(16, 16, generator=gen) * 0.1 * (i + 1)
        if NAN_LAYERS.get(i) == rank:
            g[i, 3] = float("nan")
            _set_grad(layer, g, scale=1.0)
        elif STALE_LAYERS.get(i) == rank:
            _set_grad(layer, g * 100, scale=2.0 ** -4, amax=float("nan"), valid=False)
        else:
            _set_grad(layer, g)
    before = _snapshot(layers)
    _reduce(_reducer(layers, method))
    return {"before": before, "after": _snapshot(layers), "nan_layers": sorted(NAN_LAYERS.items()),
            "finite_layer": FINITE_LAYER, "stale_layers": sorted(STALE_LAYERS.items())}


# scenario "amax_reduce": (input, output-gradient) amax of the step on (rank 0, rank 1), per layer. NaN and inf
# at both ends of the reduced vector and on either rank, since MAX over NaN depends on operand order.
NAN, INF = float("nan"), float("inf")
AMAX_CASES = [
    ((NAN, 3.0), (1.0, 2.0)),  # input: NaN on rank 0 beside a larger finite amax; grad: finite on both
    ((3.0, NAN), (INF, 5.0)),  # input: NaN on rank 1; grad: inf on rank 0 beside a finite amax
    ((INF, NAN), (NAN, INF)),  # NaN beats inf from either rank
    ((0.0, 0.0), (INF, INF)),  # a layer unused this step; inf on both
    ((0.25, 6.0), (40.0, 0.5)),  # finite on both, the larger on either rank
]
AMAX_WINDOW = (1.5, 0.5)  # the window's earlier columns, the same on both ranks (reduced in earlier steps)


def scenario_amax_reduce(rank: int, reduce_amax: bool) -> dict:
    """FP8Linear windows whose current column differs across ranks (AMAX_CASES), then the step's update as
    the backend runs it (`all_reduce_amaxes` if `reduce_amax`, then `update_delayed_scales`): the column
    after the reduction, and the new scales and windows. Earlier columns are the same on both ranks, as
    after earlier reduced steps."""
    from lowprec.backends.msamp.communication import all_reduce_amaxes
    from lowprec.backends.msamp.linear import FP8Linear, update_delayed_scales

    layers = [FP8Linear(16, 16, bias=False, amax_history_len=1 + len(AMAX_WINDOW)) for _ in AMAX_CASES]
    for layer, case in zip(layers, AMAX_CASES):
        for row, values in enumerate(case):
            layer.amax_history[row] = torch.tensor([values[rank], *AMAX_WINDOW])
        for buffer in layer.scale_buffers()[:2]:
            buffer.fill_(2.0 ** -3)  # the scales in use before the step: kept where no amax is usable
        layer._count_step(layer.amax_history_len)  # past the warm-up: the stored scales are the ones used
    before = [_floats(layer.amax_history) for layer in layers]
    reduced = None
    if reduce_amax:
        all_reduce_amaxes(layers)
        reduced = [_floats(layer.amax_history) for layer in layers]
    update_delayed_scales(layers)
    return {"before": before, "reduced": reduced, "after": [_floats(layer.amax_history) for layer in layers],
            "scales": [_floats(layer.scales[:2]) for layer in layers]}


def scenario_method_errors(rank: int) -> dict:
    """What the constructor says about a method gloo cannot run, and an unknown method."""
    from lowprec.optim.grad_reduce import FP8GradReducer

    out = {"backend": dist.get_backend()}
    for method in ("nccl_fp8", "ring"):
        try:
            FP8GradReducer(_layers([(16, 16)]), method=method)
            out[method] = None
        except Exception as exc:  # noqa: BLE001
            out[method] = f"{type(exc).__name__}: {exc}"
    for name, owners in (("owners_short", [0]), ("owners_rank", [0, 2])):
        try:
            FP8GradReducer(_layers([(16, 16)] * 2), owners=owners)
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


# scenario "owners": each layer's owner (msamp O3 under ZeRO); in the second pattern rank 1 owns nothing
OWNER_PATTERNS = {"mixed": [1, 0, 1, 0, 0, 1, 0], "rank0_only": [0] * 7}


def scenario_owners(rank: int, pattern: str) -> dict:
    """The same gradients reduced for every rank and for their owners only: scenario "random"'s layers, then a
    layer with a gradient on rank 0 only (rank 1's buffer stale) and one whose rank-1 gradient holds a NaN."""
    from lowprec.optim.grad_reduce import FP8GradReducer

    out = {"owner_of": OWNER_PATTERNS[pattern]}
    for tag, kwargs in (("all", {}), ("owners", {"owners": OWNER_PATTERNS[pattern]})):
        layers = _layers(RANDOM_SHAPES + [(16, 16)] * 3)
        for i, layer in enumerate(layers):
            shape = layer.fp8_grad_data.shape
            values = (torch.randn(shape, generator=torch.Generator().manual_seed(100 + i))
                      + torch.randn(shape, generator=torch.Generator().manual_seed(1000 * (rank + 1) + i)))
            values = values * 10.0 ** -(1 + i % 3) * (8.0 if rank == 1 and i % 2 else 1.0)
            if i == 5 and rank == 1:
                values[2, 2] = float("nan")
            _set_grad(layer, values, valid=not (i == 4 and rank == 1))
        FP8GradReducer(layers, **kwargs).reduce()
        out[tag] = _snapshot(layers)
    return out


class _OwnedWeight:
    """What ZeroFP8Weights' sharing reads of an O3 weight: E4M3 bytes, a scale, and `requantize_` from a master (here
    a master of bytes: requantising copies them and takes a scale that names the layer)."""

    def __init__(self, shape):
        self._data = torch.zeros(shape, dtype=torch.float8_e4m3fn)
        self._scale = torch.ones(())

    def requantize_(self, master: torch.Tensor, margin: int) -> None:
        self._data.view(torch.uint8).copy_(master)
        self._scale.fill_(float(master.flatten()[0]) + 0.5)


SHARE_SHAPES = [(3, 5), (16, 16), (7, 1), (2, 9), (16, 16), (1, 1), (4, 4)]


def share_master(i: int) -> torch.Tensor:
    """Layer i's master bytes in scenario "share" (its first byte is i: the scale names the layer)."""
    rows, cols = SHARE_SHAPES[i]
    return ((torch.arange(rows * cols) * 7 + i) % 256).to(torch.uint8).view(rows, cols)


def scenario_share(rank: int, pattern: str) -> dict:
    """msamp O3 under ZeRO after its step: each owner requantises its layers and broadcasts their bytes and scales
    to every rank (shares of different lengths; in "rank0_only" rank 1 shares nothing)."""
    from types import SimpleNamespace

    from lowprec.backends.msamp.zero import ZeroFP8Weights

    owners = OWNER_PATTERNS[pattern]
    zero = ZeroFP8Weights.__new__(ZeroFP8Weights)
    zero.layers = [SimpleNamespace(weight=_OwnedWeight(shape), margin=0) for shape in SHARE_SHAPES]
    zero.owners, zero.rank, zero.world_size, zero.group = owners, rank, dist.get_world_size(), None
    zero.masters = {i: share_master(i) for i, owner in enumerate(owners) if owner == rank}
    zero._requantize_and_broadcast()
    return {"bytes": [layer.weight._data.view(torch.uint8).flatten().tolist() for layer in zero.layers],
            "scales": [float(layer.weight._scale) for layer in zero.layers]}


def run_reducer_scenarios() -> dict:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    scenarios = {"method_errors": lambda: scenario_method_errors(rank)}
    for method in ("all_to_all", "nccl_fp8"):
        scenarios[f"random/{method}"] = lambda m=method: scenario_random(rank, m)
        scenarios[f"bitpattern/{method}"] = lambda m=method: scenario_bitpattern(rank, m)
        scenarios[f"zero_invalid/{method}"] = lambda m=method: scenario_zero_invalid(rank, m)
        scenarios[f"nonfinite/{method}"] = lambda m=method: scenario_nonfinite(rank, m)
    for pattern in OWNER_PATTERNS:
        scenarios[f"owners/{pattern}"] = lambda p=pattern: scenario_owners(rank, p)
        scenarios[f"share/{pattern}"] = lambda p=pattern: scenario_share(rank, p)
    for reduce_amax in (True, False):
        scenarios[f"amax_reduce/{reduce_amax}"] = lambda r=reduce_amax: scenario_amax_reduce(rank, r)
    results = {}
    for name, fn in scenarios.items():
        try:
            results[name] = {"ranks": _gather(fn())}
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc()[-3000:]}
    return {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "scenarios": results}


def _gather(record):
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [record]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


# ============================================================================================
# train: lowprec.Accelerator end to end
# ============================================================================================
D_IN, D_HIDDEN, D_OUT = 32, 64, 16
GLOBAL_BATCH = 32
STEPS = 10
LR = 1e-2
MAX_NORM = 0.15  # between the smallest and largest gradient norms of the run: some steps clip, some don't


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.GELU(), nn.Linear(D_HIDDEN, D_HIDDEN), nn.GELU(),
                         nn.Linear(D_HIDDEN, D_OUT))


def make_data(n_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_batches * GLOBAL_BATCH, D_IN, generator=g)
    y = torch.tanh(x @ (torch.randn(D_IN, D_OUT, generator=g) / 4))
    return x, y


def fp8_layers(model: nn.Module) -> list:
    from lowprec.backends.msamp.linear import FP8Linear

    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def grad_state(model: nn.Module) -> tuple[str, str]:
    """(hash of the FP8 gradient bytes only, hash of every gradient: FP8 bytes + scales + valid + .grad)."""
    layers = fp8_layers(model)
    data = [layer.fp8_grad_data for layer in layers]
    meta = [t for layer in layers for t in (layer.fp8_grad_scale, layer.fp8_grad_valid)]
    dense = [p.grad for p in model.parameters() if p.grad is not None]
    return digest(*data), digest(*data, *meta, *dense)


def total_grad_norm(model: nn.Module) -> float:
    from lowprec.optim.grad_store import fp8_grad_norms

    parts = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
    fp8 = fp8_grad_norms(fp8_layers(model), 2.0)
    if fp8 is not None:
        parts += list(fp8)
    return float(torch.stack(parts).norm())


def optimizer_state_digest(optimizer) -> str:
    inner = getattr(optimizer, "optimizer", optimizer)
    tensors = []
    for group in inner.param_groups:
        for p in group["params"]:
            for key in sorted(inner.state.get(p, {})):
                value = inner.state[p][key]
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
    return digest(*tensors)


def train(level: str, *, steps: int = STEPS, accumulation: int = 1, seed_by_rank: bool = False,
          max_norm: float | None = MAX_NORM, backwards: int = 1, skip_step: int | None = None,
          reduce_amax: bool | None = None, amax_history_len: int | None = None,
          nan_amax_step: int | None = None, compile_layers: bool | None = None,
          activation_dtype: str | None = None) -> dict:
    """Train the toy model with backend="msamp" at `level`; returns this rank's record.

    Every optimizer step uses the same global batch of GLOBAL_BATCH rows whatever the number of
    processes; rank r takes rows [r*b, (r+1)*b) of it (b = GLOBAL_BATCH / processes), so one process
    trains on the concatenation of what two processes see. With `accumulation` > 1 each rank splits
    its share further into that many micro-batches (under `accelerator.accumulate`). With
    `backwards` > 1 each micro-batch is split into that many forward + `accelerator.backward` calls
    with sync on (a multi-loss step; DDP all-reduces at each one). At step `skip_step` the gradients
    are computed and clipped, then dropped with `zero_grad()` without an optimizer step (the usual
    "skip a bad step" pattern). `reduce_amax`, `amax_history_len`: the recipe's. At step `nan_amax_step`
    rank 0 alone records a NaN amax before the optimizer step (NAN_AMAX_AT: layer, row), as an overflow in
    its own forward or backward would. `compile_layers`: the recipe's compile_fp8_layers (inductor on CPU);
    `activation_dtype`: the recipe's.
    """
    from accelerate.utils import InitProcessGroupKwargs

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.kernels.scaling import current_scale, quantize

    recipe = FP8RecipeKwargs(backend="msamp", opt_level=level, skip_first_last=False, skip_slow_shapes=False,
                             reduce_amax=reduce_amax, amax_history_len=amax_history_len,
                             compile_fp8_layers=compile_layers, activation_dtype=activation_dtype)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                              kwargs_handlers=[recipe, InitProcessGroupKwargs(timeout=TIMEOUT)])
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(rank if seed_by_rank else 0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    layers = fp8_layers(inner)
    plan = accelerator.precision_plan
    storage = None
    if activation_dtype == "fp8":
        from lowprec.runtime.activations import activation_storage

        storage = activation_storage(model)
        storage.min_elements = 0  # the toy model's activations are far below the default threshold
    reducer = accelerator._lowprec[-1][1].store_reducer
    params = list(inner.parameters())

    x, y = make_data(steps)
    share = GLOBAL_BATCH // world
    micro = share // accumulation
    record = {
        "rank": rank, "world_size": world, "level": level, "engine": plan.engine,
        "fp8_modules": [n for n, m in inner.named_modules() if type(m).__name__ == "FP8Linear"],
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "reducer": None if reducer is None else {"method": reducer.method, "world_size": reducer.world_size,
                                                  "layers": len(reducer.layers)},
        "reduce_amax": accelerator._lowprec[-1][1].reduce_amax,
        "amax_reduction": accelerator._lowprec[-1][1].amax_reduction, "options": {
            k: plan.options[k] for k in ("reduce_amax", "amax_history_len")},
        "compiled_layers": sum(getattr(m, "_compiled_call_impl", None) is not None for m in layers),
        "init_params": digest(*params),
        "initial": {n: _floats(p) for n, p in inner.named_parameters()},
        "steps": [],
    }
    for step in range(steps):
        rows = slice(step * GLOBAL_BATCH + rank * share, step * GLOBAL_BATCH + (rank + 1) * share)
        xb, yb = x[rows], y[rows]
        entry = {"losses": [], "micro_fp8_grad": []}
        for k in range(accumulation):
            with accelerator.accumulate(model):
                part = micro // backwards
                for j in range(backwards):
                    rows_j = slice(k * micro + j * part, k * micro + (j + 1) * part)
                    loss = nn.functional.mse_loss(model(xb[rows_j]).float(), yb[rows_j]) / backwards
                    accelerator.backward(loss)
                    entry["losses"].append(loss.item() * backwards)
                entry["micro_fp8_grad"].append({"sync": accelerator.sync_gradients, "fp8": grad_state(inner)[0]})
                if accelerator.sync_gradients:
                    fp8_before_clip, _ = grad_state(inner)
                    if max_norm is not None:
                        norm_before = total_grad_norm(inner)
                        entry["clip_norm"] = _scalar(accelerator.clip_grad_norm_(model.parameters(), max_norm))
                        entry["norm_before_clip"] = norm_before
                        entry["norm_after_clip"] = total_grad_norm(inner)
                    fp8_after_clip, entry["grads"] = grad_state(inner)
                    entry["clip_kept_fp8_bytes"] = fp8_before_clip == fp8_after_clip
                if step == nan_amax_step and rank == 0 and accelerator.sync_gradients:
                    for layer_index, row in NAN_AMAX_AT:
                        layers[layer_index].amax_history[row, 0] = float("nan")
                if step != skip_step:
                    optimizer.step()
                optimizer.zero_grad()
        entry["params"] = digest(*params)
        # the FP8 weight the next forward multiplies with: cast of the FP16 weight at its current scale
        casts = []
        for layer in layers:
            scale, _ = current_scale(layer.weight, E4M3)
            casts += [quantize(layer.weight, scale, E4M3), scale]
        entry["fp8_weights"] = digest(*casts)
        entry["weight_scales"] = digest(*[layer.scales[2] for layer in layers])
        # input and output-gradient scales come from the amax windows, all-reduced across ranks every step unless
        # reduce_amax=False (MS-AMP does not sync them: each rank's own, differing across ranks)
        entry["delayed_scales"] = [_floats(layer.scales[:2]) for layer in layers]
        entry["amax_windows"] = [_floats(layer.amax_history) for layer in layers]
        entry["in_time"] = [layer.in_time() for layer in layers]
        entry["optimizer_state"] = optimizer_state_digest(optimizer)
        entry["loss_mean"] = _scalar(accelerator.reduce(torch.tensor(sum(entry["losses"]) / len(entry["losses"])),
                                                        reduction="mean"))
        record["steps"].append(entry)
    record["final"] = {n: _floats(p) for n, p in inner.named_parameters()}
    record["packed_elements"] = storage.counts.packed_elements if storage is not None else 0
    accelerator.wait_for_everyone()
    return record


NAN_AMAX_AT = ((0, 0), (1, 1))  # (layer, row): layer 0's input amax and layer 1's output-gradient amax

TRAIN_SCENARIOS = {
    "O1": dict(level="O1"),
    "O2": dict(level="O2"),
    # a micro-batch without sync must not communicate; the one with sync must
    "O2_accum2": dict(level="O2", accumulation=2, steps=4),
    # DDP broadcasts rank 0's parameters at wrap time, so ranks may start from different initialisations
    "O2_seed_by_rank": dict(level="O2", seed_by_rank=True, steps=2),
    # two forward + backward passes per optimizer step, no accumulate(): every backward is a sync backward
    "O2_two_backwards": dict(level="O2", backwards=2, steps=3),
    # step 0's gradients are dropped without an optimizer step
    "O2_skip_step": dict(level="O2", skip_step=0, steps=3),
    # each rank's delayed scales from its own amaxes: what issue 30 reported (64 on one rank, 32 on the other)
    "O2_no_reduce_amax": dict(level="O2", reduce_amax=False, steps=4),
    # a window of 2: the delayed scales feed the GEMMs from step 2 on; rank 0 alone sees a NaN amax at step 3
    "O2_window2_nan": dict(level="O2", amax_history_len=2, steps=5, nan_amax_step=3),
    "O2_window2_nan_no_reduce": dict(level="O2", amax_history_len=2, steps=5, nan_amax_step=3, reduce_amax=False),
    # the FP8 layers compiled one by one (inductor): the default on FP8 GPUs under DDP
    "O2_compiled": dict(level="O2", compile_layers=True),
    # activation_dtype='fp8' (issue 32): what autograd saves in the forward kept in E4M3 under DDP
    "O2_fp8_activations": dict(level="O2", activation_dtype="fp8"),
}


def run_train_scenarios(names: list[str] | None = None) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    results = {}
    for name, kwargs in TRAIN_SCENARIOS.items():
        if names and name not in names:
            continue
        AcceleratorState._reset_state()
        GradientState._reset_state()
        try:
            results[name] = {"ranks": _gather(train(**kwargs))}
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc()[-3000:]}
    return {"world_size": dist.get_world_size(), "scenarios": results}


def main(argv: list[str]) -> None:
    mode, out_path = argv[1], argv[2]
    torch.set_num_threads(1)
    result = run_reducer_scenarios() if mode == "reducer" else run_train_scenarios(argv[3:] or None)
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh, allow_nan=True)
    from teardown import end_ranks  # beside this script (torchrun puts its folder on sys.path); tests import this file

    end_ranks()


if __name__ == "__main__":
    main(sys.argv)
