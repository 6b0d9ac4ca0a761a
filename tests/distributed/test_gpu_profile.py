"""The GPU harness's per-rank profile summary (gpu_profile.py), on hand-made timelines and a CPU profile."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # gpu_engines.py imports it as a script's neighbour
from gpu_profile import STEADY_FROM, device_kernels, kernel_summary, rank_path, step_medians, write_profile  # noqa: E402


def test_busy_time_is_the_union_of_overlapping_streams_and_nccl_is_counted_apart():
    kernels = [("gemm", 0.0, 1000.0), ("ncclDevKernel_AllReduce", 500.0, 3000.0),  # overlaps the gemm
               ("triton_poi", 5000.0, 5500.0), ("triton_red", 5100.0, 5200.0)]  # inside the previous one
    summary = kernel_summary(kernels)
    assert summary == {"kernels": 4, "kernel_ms": 4.1, "nccl_ms": 2.5, "busy_ms": 3.5, "span_ms": 5.5}


def test_an_empty_profile_sums_to_zero():
    assert kernel_summary([]) == {"kernels": 0, "kernel_ms": 0.0, "nccl_ms": 0.0, "busy_ms": 0.0, "span_ms": 0.0}


def test_each_rank_writes_its_table_summary_and_trace(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    path = str(tmp_path / "cell.prof.txt")
    assert rank_path(path, 0) == path and rank_path(path, 1) == str(tmp_path / "cell.prof.rank1.txt")
    for rank in (0, 1):  # each rank profiles its own step
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.randn(64, 64) @ torch.randn(64, 64)
        write_profile(prof, path, rank, kernel_summary([]), "self_cpu_time_total")
    table = (tmp_path / "cell.prof.rank1.txt").read_text()
    assert table.startswith("rank 1: {") and "aten::mm" in table
    with gzip.open(tmp_path / "cell.prof.trace.json.gz") as fh:
        assert "traceEvents" in json.load(fh)
    assert (tmp_path / "cell.prof.rank1.trace.json.gz").exists()


def test_device_kernels_are_the_cuda_events_but_user_annotations():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(name, start, end, device, annotation=False):
        return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=device,
                             is_user_annotation=annotation)

    class Profile:
        def events(self):
            return [event("aten::mm", 0, 50, DeviceType.CPU), event("nvjet_gemm", 10, 40, DeviceType.CUDA),
                    event("DistributedDataParallel.forward", 5, 45, DeviceType.CUDA, annotation=True),
                    event("ncclDevKernel_AllGather", 40, 60, DeviceType.CUDA)]

    assert device_kernels(Profile()) == [("nvjet_gemm", 10, 40), ("ncclDevKernel_AllGather", 40, 60)]


def test_step_medians_leave_out_measured_steps_and_give_the_steady_state_only_where_a_run_has_one():
    # a 20-step msamp run as on 2026-11-27: warm-up steps (slow), the recompile at its end, then the three steps
    # the harness measures in (profile, sync watch, model-state count): no steady step left to time
    warm, steady = [0.150] * 16, [0.117] * 4
    times = [12.0] + warm[1:] + [14.6] + steady[1:]
    instrumented = {17, 18, 19}
    assert step_medians(times, instrumented) == (0.150, None)
    # a 40-step run: 19 clean steps from STEADY_FROM on, the instrumented ones (slow) left out
    times = [12.0] + [0.150] * 15 + [14.6, 0.200] + [0.117] * 19 + [0.5, 0.6, 0.7]
    assert len(times) == 40 and STEADY_FROM == 18
    first, steady_median = step_medians(times, {37, 38, 39})
    assert steady_median == 0.117 and first == 0.117  # from step 5 too, now that steady steps are the majority
    # 22 steps: 4 clean steady steps, too few to call a median
    assert step_medians(times[:22], {19, 20, 21}) == (0.150, None)
