"""Gradient communication in a chosen precision: `grad_comm_dtype` under DDP and FSDP2.

- DDP: communication hooks (`register_comm_hook`) that average each gradient bucket in FP32, BF16
  or FP8.
- FSDP2: `FP8ReduceScatter`, a custom reduce-scatter (`FSDPModule.set_custom_reduce_scatter`, a
  public method since torch 2.8). FP32/BF16 under FSDP2 are its own `reduce_dtype`.

FP8 works on blocks of `BLOCK` elements of the flat buffer:

1. each rank takes every block's absolute maximum, and one all-reduce (MAX) of those amaxes gives
   every rank the same power-of-two scale per block, so the E4M3 bytes mean the same on every rank;
2. each rank casts with those scales and all_to_all moves the bytes (rank r receives every rank's
   r-th shard); each rank sums what it received in FP32 and undoes the scale: its reduced shard,
   one rounding (the cast) from the exact one;
3. FSDP2 keeps that shard. DDP casts the mean back to E4M3 with the same scales (a mean of values
   within the format stays within it) and all_gathers the bytes: a second rounding.

Blocks, not one scale per buffer: a buffer holds the gradients of many tensors (norm weights next to
projections), whose magnitudes differ by orders, and E4M3 spans only 2**17 from its largest value
to its smallest subnormal. Blocks start at each shard's start, so a tensor gets scales of its own
where it fills whole blocks (the large weights do) and shares one with its neighbour at its ends.
The scales cost 4 bytes per `BLOCK` elements on top of 1 byte per element (0.4%); BF16 sends 2.

Overflow, under both engines and with no host sync (a sync per bucket would stall the backward that the
communication overlaps): a block holding inf/NaN on any rank keeps scale 1 and its inf/NaN values arrive
as NaN (E4M3 has no inf), so the step sees a non-finite gradient, never a saturated finite one;
`nonfinite_blocks` counts such blocks on the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..kernels.fused import cuda_fused, sum_over_ranks
from ..kernels.scaling import compute_scale, nan_to_inf, quantize
from ..utils.modules import group_members

E4M3 = torch.float8_e4m3fn
BLOCK = 1024


# torch 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single; older torch has only the first
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _blocks(flat: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """`flat` (n equal shards) as FP32 [n, blocks per shard, block]: a view where the shards are whole blocks, else
    a copy zero-padded at each shard's end."""
    chunk = flat.numel() // n
    if chunk % block == 0:
        # Whole blocks (a block of d4096 Linears always): a view. Padded, the fused cast of a block's 200 M gradients
        # indexed its source by a division by the symbolic shard length: 1.6 ms on an H200, several times the
        # memory's speed (results/gpu/2026-11-27-h200x2-o3fsdp2-765a23c).
        return flat.reshape(n, chunk // block, block).float()
    blocks = -(-chunk // block)
    out = torch.zeros(n, blocks * block, dtype=torch.float32, device=flat.device)
    out[:, :chunk].copy_(flat.reshape(n, chunk))
    return out.view(n, blocks, block)


# The three passes over a buffer, each one fused kernel on CUDA (kernels/fused.py): the block amaxes,
# the cast of the blocks with their shared scales, and the sum over ranks of what was received.
@cuda_fused
def _block_amax(flat: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Every block's amax ([n, blocks]); NaN counts as inf."""
    return nan_to_inf(_blocks(flat, n, block).abs().amax(dim=-1))


@cuda_fused
def _encode_blocks(flat: torch.Tensor, scale: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """`flat`'s blocks in E4M3 with one scale per block ([n, blocks]), as bytes; inf becomes NaN."""
    return _cast(_blocks(flat, n, block), scale).view(torch.uint8)


@cuda_fused
def _decode_sum(received: torch.Tensor, scale: torch.Tensor, divisor: float) -> torch.Tensor:
    """The FP32 sum over ranks of E4M3 `received` bytes ([n, blocks, block]) sent with `scale` ([blocks]),
    divided by `divisor`."""
    return sum_over_ranks(received.view(E4M3)) / scale.unsqueeze(-1) / divisor


def _global_amax(flat: torch.Tensor, n: int, block: int, group) -> torch.Tensor:
    """Every block's amax, the MAX over ranks ([n, blocks]); NaN counts as inf."""
    amax = _block_amax(flat, n, block)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _checked_block(owner: str, block: int) -> int:
    if block < 1:
        raise ValueError(f"{owner} block={block} must be a positive number of elements")
    return block


@cuda_fused
def _block_scales(amax: torch.Tensor) -> torch.Tensor:
    """Every block's power-of-two scale from its global `amax`, 1 where that is inf, NaN or 0. One elementwise
    kernel on CUDA, where eager ran ~25 per reduce-scatter (two H200s, msamp O3 under FSDP2: the step was bound
    by launching kernels). The count of non-finite blocks stays outside: a whole-vector reduction compiled for a
    first short length would keep that length's one-program plan for every later one (kernels/fused.py)."""
    return compute_scale(amax, E4M3)


def _scales_counting_nonfinite(amax: torch.Tensor, total: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks' scales, `total` plus how many of them held inf or NaN), on the device."""
    bad = (~torch.isfinite(amax)).sum()
    return _block_scales(amax), (bad if total is None else total + bad)


def _cast(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`values` [..., blocks, block] to E4M3 with one scale per block; inf becomes NaN."""
    return quantize(values, scale.unsqueeze(-1), E4M3)


def _reduce_scatter_blocks(flat: torch.Tensor, scale: torch.Tensor, n: int, block: int, group,
                           divisor: float = 1.0) -> torch.Tensor:
    """This rank's sum over ranks of `flat`'s blocks (n equal shards), sent as E4M3 with `scale`, divided
    by `divisor`: [blocks, block], FP32."""
    sent = _encode_blocks(flat, scale, n, block)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return _decode_sum(received, scale[dist.get_rank(group)], divisor)


class FP8ReduceScatter:
    """A custom FSDP2 reduce-scatter (the duck type of torch's `ReduceScatter`, which torch does not
    export) in FP8 E4M3, one power-of-two scale per block of `block` elements shared by all ranks.

    Attributes:
        calls: how many reduce-scatters ran through it.
        nonfinite_blocks: device tensor, how many blocks held inf or NaN over all calls (None before).
    """

    def __init__(self, block: int = BLOCK):
        self.block = _checked_block("FP8ReduceScatter", block)
        self.calls = 0
        self.nonfinite_blocks: torch.Tensor | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        if async_op:
            raise NotImplementedError("FP8ReduceScatter runs on the caller's stream, synchronously (FSDP2 asks "
                                      "for async_op=False)")
        average = _is_average(op)
        n = dist.get_world_size(group)
        chunk = output_tensor.numel()
        if input_tensor.numel() != n * chunk:
            raise ValueError(f"FP8ReduceScatter: input of {input_tensor.numel()} elements does not split into "
                             f"{n} shards of {chunk}")
        self.calls += 1
        amax = _global_amax(input_tensor, n, self.block, group)
        scale, self.nonfinite_blocks = _scales_counting_nonfinite(amax, self.nonfinite_blocks)
        total = _reduce_scatter_blocks(input_tensor, scale, n, self.block, group, divisor=n if average else 1.0)
        output_tensor.copy_(total.reshape(-1)[:chunk].view_as(output_tensor))
        return None


def _is_average(op) -> bool:
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise NotImplementedError(
        f"FP8ReduceScatter handles ReduceOp.SUM and ReduceOp.AVG, not {op}: FSDP2 asks for another when a custom "
        "gradient divide factor is set (set_gradient_divide_factor); leave it unset with grad_comm_dtype='fp8'"
    )


def install_fp8_reduce_scatter(model: nn.Module, comm: FP8ReduceScatter | None = None,
                               holds_fp8: Callable[[nn.Module], bool] | None = None) -> FP8ReduceScatter:
    """Make the `fully_shard`-ed modules of `model` reduce-scatter their gradients through `comm`: every one, or
    with `holds_fp8`, those whose FSDP2 group holds a module it accepts (an FP8 Linear). The others keep FSDP2's
    own reduce-scatter in the policy's reduce_dtype: as MS-AMP sends FP8 only for FP8 weights' gradients. A group
    of norms alone paid an amax all-reduce, an all_to_all and two fused passes for a few thousand elements, the
    root group (embeddings, head) FP8 rounding on gradients no FP8 GEMM made."""
    from torch.distributed.fsdp import FSDPModule

    comm = comm or FP8ReduceScatter()
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise RuntimeError("lowprec: grad_comm_dtype='fp8' under FSDP2 found no fully_shard-ed module to hook")
    hooked = [m for m in sharded if holds_fp8 is None or any(holds_fp8(c) for c in group_members(m))]
    if not hooked:
        warnings.warn("lowprec: grad_comm_dtype='fp8' under FSDP2: no fully_shard-ed group holds an FP8 Linear, so "
                      "every gradient is reduce-scattered in the MixedPrecisionPolicy's reduce_dtype", stacklevel=2)
    for module in hooked:
        module.set_custom_reduce_scatter(comm)
    return comm


# ----- DDP -------------------------------------------------------------------------------------------
class FP8CommState:
    """State of `fp8_allreduce_hook`: the process group, the block size, and `nonfinite_blocks`, a device
    tensor counting the blocks that held inf or NaN over all calls (None before the first)."""

    def __init__(self, group=None, block: int = BLOCK):
        self.group = group
        self.block = _checked_block("FP8CommState", block)
        self.nonfinite_blocks: torch.Tensor | None = None


# The hooks carry no return annotation: under `from __future__ import annotations` it would be a
# string, and DDP's check compares it with the type itself.
def fp8_allreduce_hook(state: FP8CommState, bucket):
    """DDP communication hook: average a gradient bucket in FP8 E4M3, block scales shared by all ranks
    (module docstring: reduce-scatter of E4M3 bytes, FP32 sums, all_gather of the E4M3 mean). A block
    holding inf or NaN on any rank arrives as NaN (module docstring, "Overflow"); no host sync.
    """
    buffer = bucket.buffer()
    group = state.group
    n = dist.get_world_size(group)
    numel = buffer.numel()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    flat = torch.zeros(-(-numel // n) * n, dtype=buffer.dtype, device=buffer.device)
    flat[:numel].copy_(buffer.reshape(-1))
    amax = _global_amax(flat, n, state.block, group)
    scale, state.nonfinite_blocks = _scales_counting_nonfinite(amax, state.nonfinite_blocks)
    mean = _reduce_scatter_blocks(flat, scale, n, state.block, group, divisor=n)
    # the mean of values within E4M3's range is within it: the same scales serve the way back
    mine = _cast(mean.unsqueeze(0), scale[dist.get_rank(group)].unsqueeze(0))[0]
    gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=buffer.device)
    all_gather_flat(gathered, mine.view(torch.uint8).reshape(-1), group=group)
    out = gathered.view(E4M3).view((n,) + tuple(mine.shape)).float() / scale.unsqueeze(-1)
    chunk = flat.numel() // n
    future.set_result(out.reshape(n, -1)[:, :chunk].reshape(-1)[:numel].to(buffer.dtype).view_as(buffer))
    return future


def _allreduce_in(dtype: torch.dtype, group, bucket) -> torch.futures.Future:
    buffer = bucket.buffer()
    sent = buffer.to(dtype).div_(dist.get_world_size(group))
    return dist.all_reduce(sent, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0].to(buffer.dtype))


def fp32_allreduce_hook(group, bucket):
    """DDP communication hook: average a bucket in FP32 whatever the gradients' dtype."""
    return _allreduce_in(torch.float32, group, bucket)


def bf16_allreduce_hook(group, bucket):
    """DDP communication hook: average a bucket in BF16 (torch's bf16_compress_hook, which needs
    NCCL, does the same on GPUs; this one runs on any process-group backend)."""
    return _allreduce_in(torch.bfloat16, group, bucket)
