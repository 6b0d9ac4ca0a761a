"""The benchmark scripts run (on CPU, shrunk): a GPU session must not be the first to find them broken."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.slow
def test_fp8_comm_benchmark_on_two_cpu_processes(tmp_path):
    from conftest import free_port, run_processes

    out = tmp_path / "comm.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "benchmarks", "fp8_comm.py"), "--shrink", "32", "--layers", "1", "--iters", "3",
           "--out", str(out)]
    proc = run_processes(cmd, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["methods"]["all_to_all"]["identical_on_all_ranks"]
    assert "NCCL" in result["methods"]["nccl_fp8"]["error"]  # gloo here: refused with its reason
    for engine in ("ddp", "fsdp2"):
        comm = result["grad_comm"][engine]
        assert comm["fp32"]["rel_l2"] < 1e-6 < comm["bf16"]["rel_l2"] < 0.005 < comm["fp8"]["rel_l2"] < 0.08
        assert comm["fp8"]["bytes_per_element"] < 0.26 * comm["fp32"]["bytes_per_element"]
        assert all(entry["ms"] > 0 for entry in comm.values())


def _widths_on_cpu(out, *args: str) -> dict:
    """benchmarks/widths.py at the CPU-sized width: its runs."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "widths.py"), "--widths", "tiny", "--vocab", "512",
           *args, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["widths"]["tiny"]["runs"]


@pytest.mark.slow
def test_widths_benchmark_on_cpu(tmp_path):
    # aot_eager: dynamo and the regional compilation as on the GPU, without inductor's CPU code generation
    runs = _widths_on_cpu(tmp_path / "widths.json", "--steps", "3", "--warmup", "1", "--profile", "tiny",
                          "--profile-steps", "1", "--dynamo-backend", "aot_eager")
    assert list(runs) == ["bf16", "torchao default", "torchao all", "raw torchao", "msamp O2"]
    for label, r in runs.items():
        assert "error" not in r, (label, r.get("traceback"))
        assert r["step_ms_median"] > 0 and abs(r["first_loss"] - 6.24) < 0.3, label  # ln(512): random ids
        assert label == "bf16" or r["speedup_vs_bf16"] > 0
    # The rule as it stands on a CPU (no measured slow shapes): every Linear in FP8, the head included.
    assert {r["plan"]["converted"] for label, r in runs.items() if "default" in label or "msamp" in label} == {15}
    assert runs["torchao default"]["plan"]["kept"] == []
    assert (runs["torchao all"]["plan"]["converted"], runs["raw torchao"]["plan"]["converted"]) == (15, 14)
    # Regional compilation: both decoder layers share one graph (embedding, rotary, layer, norm, lm_head, loss).
    assert runs["bf16"]["dynamo"]["stats"]["unique_graphs"] == 6
    for label in ("bf16", "torchao default", "msamp O2"):
        prof = runs[label]["profile"]
        assert prof["kernel_ms_per_step"] > 0 and prof["top"]
        text = (tmp_path / f"profile_tiny_{label.replace(' ', '_')}.txt").read_text()
        assert "Self CPU" in text and "ms/step" in text
    assert "profile" not in runs["torchao all"]
    summary = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "widths.py"), "--summarize",
                              str(tmp_path / "widths.json")], env=dict(os.environ, PYTHONPATH=ROOT),
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr[-3000:]
    assert "| tiny | torchao default |" in summary.stdout and "- tiny msamp O2: kernels" in summary.stdout


@pytest.mark.slow
def test_widths_benchmark_eager_on_cpu(tmp_path):
    runs = _widths_on_cpu(tmp_path / "eager.json", "--compile", "none", "--configs", "bf16", "torchao default",
                          "torchao eager layers", "--steps", "2", "--warmup", "1", "--rounds", "2")
    assert list(runs) == ["bf16", "torchao default", "torchao eager layers"]
    for label, r in runs.items():
        assert "error" not in r, (label, r.get("traceback"))
        assert r["step_ms_median"] > 0 and not r["dynamo"].get("stats", {}).get("unique_graphs")  # nothing compiled
    # Two rounds in ABBA order; the medians over the rounds make the ratio.
    assert [[x["position"] for x in r["rounds"]] for r in runs.values()] == [[0, 2], [1, 1], [2, 0]]
    medians = {label: statistics.median(x["step_ms_median"] for x in r["rounds"]) for label, r in runs.items()}
    assert {label: r["step_ms_median"] for label, r in runs.items()} == medians
    assert runs["torchao default"]["speedup_vs_bf16"] == pytest.approx(medians["bf16"] / medians["torchao default"])


def test_performance_plot_is_drawn_from_the_committed_results(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "performance.png"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_performance.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_eager_layers_benchmark_on_cpu(tmp_path):
    out = tmp_path / "eager_layers.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "eager_layers.py", "--size", "tiny", "--steps", "2", "--warmup", "1",
           "--runs", "bf16 eager", "torchao eager", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=os.path.join(ROOT, "benchmarks"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert runs["bf16 eager"]["converted"] == 0 and runs["torchao eager"]["converted"] > 0
    assert all(r["step_ms_median"] > 0 and len(r["losses"]) == 2 for r in runs.values())


def test_headline_benchmark_on_cpu(tmp_path):
    """benchmarks/headline.py, what scripts/gpu/verify.sh runs after the GPU suite: each configuration against BF16
    of its mode, auto's choice and what it passed over, two rounds' medians; a configuration that cannot run here
    (TE on a CPU host) is recorded as an error without losing the others."""
    out = tmp_path / "headline.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "headline.py"), "--widths", "tiny",
                           "--configs", "bf16 eager", "auto", "te", "--steps", "2", "--warmup", "1", "--rounds", "2",
                           "--profile-dir", str(tmp_path / "prof"), "--profile-configs", "auto", "--profile-steps", "1",
                           "--peak-configs", "auto",
                           "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["widths"]["tiny"]
    assert "transformer_engine is not installed" in runs["te"]["error"]
    auto = runs["auto"]
    assert auto["backend"] == "torchao" and auto["model_mode"] == "eager"
    assert auto["auto"][0].startswith("te: transformer_engine is not installed")
    assert auto["auto"][-1] == "torchao: chosen"
    for r in (runs["bf16 eager"], auto):
        assert len(r["rounds_ms"]) == 2 and r["step_ms_median"] == pytest.approx(statistics.median(r["rounds_ms"]))
        assert r["rounds_peak_gib"] == [None, None] and r["timed_peak_gib"] is None  # no CUDA memory on a CPU
    assert auto["speedup_vs_bf16"] == pytest.approx(runs["bf16 eager"]["step_ms_median"] / auto["step_ms_median"])
    assert auto["fp8_linears"] == auto["linears"] == 9
    assert "| tiny | auto | torchao (tensorwise) |" in proc.stdout
    # the profile of the one configuration asked for, in round 0 only; no CUDA memory to split by phase on a CPU
    assert "profile" not in runs["bf16 eager"] and auto["profile"]["steps"] == 1
    assert auto["profile"]["kernel_ms_per_step"] > 0 and auto["profile"]["top"]
    assert sorted(os.listdir(tmp_path / "prof")) == ["tiny_auto.prof.txt", "tiny_auto.sites.txt"]
    # one step more: the operators by input shapes and by call site, this proxy's forward among the sites
    sites = (tmp_path / "prof" / "tiny_auto.sites.txt").read_text()
    assert "operators by input shapes" in sites and "operators by call site" in sites
    assert auto["call_sites"] and any("headline.py" in s for row in auto["call_sites"] for s in row["sites"])
    assert auto["peak_by_phase_gib"] is None and auto["peak_gib"] is None and auto["step_peaks_gib"] is None
    assert auto["peak_report"] is None and "peak_report" not in runs["bf16 eager"]  # no allocator trace on a CPU


def test_headline_traces_a_step_of_the_run_where_peak_step_says(tmp_path):
    # --peak-step N traces the run's own step N (msamp's second graph's step reached its peak), not one step more:
    # the run keeps its step count and losses; on a CPU there is no allocator trace, so the report is None
    out = tmp_path / "headline.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    args = [sys.executable, os.path.join(ROOT, "benchmarks", "headline.py"), "--widths", "tiny", "--configs",
            "bf16 eager", "--steps", "3", "--warmup", "1", "--profile-dir", str(tmp_path / "prof"), "--profile-configs",
            "--peak-configs", "bf16 eager", "--out", str(out)]
    proc = subprocess.run(args + ["--peak-step", "1"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["widths"]["tiny"]["bf16 eager"]
    assert len(r["step_ms"]) == 3 and r["peak_report"] is None
    for bad in ("3", "-1"):
        proc = subprocess.run(args + ["--peak-step", bad], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=600)
        assert proc.returncode == 2 and "--peak-step" in proc.stderr and "from 0 to --steps - 1 (2)" in proc.stderr


def test_headline_profiles_no_configuration_when_profile_configs_names_none(tmp_path):
    out = tmp_path / "headline.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "headline.py"), "--widths", "tiny",
                           "--configs", "bf16 eager", "--steps", "2", "--warmup", "1",
                           "--profile-dir", str(tmp_path / "prof"), "--profile-configs", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(tmp_path / "prof") == []
    assert "profile" not in json.loads(out.read_text())["widths"]["tiny"]["bf16 eager"]


def test_headline_proxy_computes_hugging_faces_loss_which_fp8_activations_replace():
    """The proxy's loss is Hugging Face's ForCausalLMLoss, through the attribute a Hugging Face causal LM has, so
    that activation_dtype='fp8' replaces it as it does in a user's model (runtime/loss.py)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lowprec.kernels.cross_entropy import causal_lm_loss
    from lowprec.runtime.loss import swap_causal_lm_loss

    torch.manual_seed(0)
    model = headline.Proxy(64, 128, 1, vocab=300)
    ids = torch.randint(0, 300, (2, 17))
    assert model.loss_function is ForCausalLMLoss
    reference = model(ids)
    logits = model.head(model.norm(model.blocks[0](model.embed(ids))))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    assert torch.allclose(reference, expected, rtol=1e-6)
    assert swap_causal_lm_loss(model) and model.loss_function is causal_lm_loss
    assert torch.allclose(model(ids), reference, rtol=1e-6)


def test_headline_has_a_whole_model_mode_with_its_own_bf16():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline

    whole = {label for label, (mode, _) in headline.CONFIGS.items() if mode == "whole"}
    assert "bf16 whole" in whole and len(whole) >= 3
    runs = {"bf16 whole": {"mode": "whole", "step_ms_median": 100.0, "peak_gib": 20.0},
            "msamp O2 whole": {"mode": "whole", "step_ms_median": 80.0, "peak_gib": 10.0},
            "bf16 compiled": {"mode": "compiled", "step_ms_median": 50.0, "peak_gib": 5.0}}
    headline._ratios(runs)
    assert runs["msamp O2 whole"]["speedup_vs_bf16"] == 1.25 and runs["msamp O2 whole"]["peak_vs_bf16"] == 0.5


def test_a_headline_labels_words_say_what_it_sets():
    # "own rows", "recompute", "realize64", "hooks", "torch loss": each a setting, a label with several sets each
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline

    label = "msamp O2 act8 own rows recompute realize64"
    assert headline.ENVIRONMENT[label] == {"LOWPREC_RECOMPUTE_FP8_COPIES": "1"}
    assert headline.INDUCTOR[label] == {"realize_opcount_threshold": 64}
    assert headline.PATCHES[label] == {"lowprec.kernels.scaling:AMAX_OVER_OWN_ROWS": True}
    assert headline.ENVIRONMENT["torchao act8 torch loss"] == {"LOWPREC_FUSED_CROSS_ENTROPY": "0"}
    assert headline.ENVIRONMENT["msamp O2 act8 hooks"] == {"LOWPREC_FP8_ACTIVATIONS_IN_GRAPH": "0"}
    assert headline.ENVIRONMENT["msamp O2 act8 keep copies"] == {"LOWPREC_RECOMPUTE_FP8_COPIES": "0"}
    for plain in ("msamp O2", "msamp O2 act8", "bf16 compiled", "torchao act8 whole"):
        assert all(plain not in settings for settings in (headline.ENVIRONMENT, headline.INDUCTOR, headline.PATCHES))


def test_headline_sets_a_configurations_environment_only_while_it_runs(monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline

    assert set(headline.ENVIRONMENT) <= set(headline.CONFIGS)
    name = "LOWPREC_FP8_ACTIVATIONS_IN_GRAPH"
    monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(headline, "_run_one", lambda *a: seen.append(os.environ.get(name)))
    headline.run_one("msamp O2 act8 hooks", "tiny", [], 0)
    headline.run_one("msamp O2 act8", "tiny", [], 0)
    assert seen == ["0", None] and name not in os.environ
    # inductor's settings likewise, around the compiles of that configuration only
    import torch._inductor.config as inductor_config

    assert set(headline.INDUCTOR) <= set(headline.CONFIGS)
    default = inductor_config.realize_opcount_threshold
    monkeypatch.setattr(headline, "_run_one", lambda *a: seen.append(inductor_config.realize_opcount_threshold))
    headline.run_one("msamp O2 act8 realize64", "tiny", [], 0)
    headline.run_one("msamp O2 act8", "tiny", [], 0)
    assert seen[2:] == [64, default] and inductor_config.realize_opcount_threshold == default
    # and lowprec's own switches
    from lowprec.kernels import scaling

    assert set(headline.PATCHES) <= set(headline.CONFIGS)
    monkeypatch.setattr(headline, "_run_one", lambda *a: seen.append(
        (scaling.AMAX_OVER_OWN_ROWS, inductor_config.realize_opcount_threshold)))
    headline.run_one("msamp O2 act8 own rows realize64", "tiny", [], 0)
    headline.run_one("msamp O2 act8", "tiny", [], 0)
    assert seen[4:] == [(True, 64), (False, default)] and scaling.AMAX_OVER_OWN_ROWS is False


def test_peak_memory_replays_the_allocator_trace_to_its_highest_point():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from peak_memory import format_report, live_at_peak, site

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    model = [frame("/x/site-packages/torch/nn/functional.py", 10, "linear"), frame("/w/model.py", 5, "forward")]
    hooks = [frame("/w/lowprec/kernels/activations.py", 90, "unpack_fp8"), frame("/w/model.py", 9, "step")]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": model},
        {"action": "alloc", "addr": 2, "size": 50, "frames": hooks},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},  # counted until free_completed
        {"action": "alloc", "addr": 3, "size": 30, "frames": model},        # the peak: 1000 + 180
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 4, "size": 120, "frames": hooks},       # 1000 + 200: a higher peak
        {"action": "free_completed", "addr": 4, "size": 120, "frames": []},
        {"action": "free_completed", "addr": 2, "size": 50, "frames": []},
    ]
    report = live_at_peak(events, baseline=1000)
    assert report["peak_bytes"] == 1200 and report["peak_event"] == 5
    # the innermost frame outside torch names the model's line; lowprec's own lines name themselves
    assert report["live_by_site"] == {"kernels/activations.py:90 unpack_fp8": [170, 2], "w/model.py:5 forward": [30, 1]}
    assert site(model) == "w/model.py:5 forward" and site([]) == "(no Python frame)"
    # C++ frames the allocator could not symbolise never name a site
    assert site([frame("??", 0, "torch::unwind::unwind()")] + model) == "w/model.py:5 forward"
    assert site([frame("??", 0, "torch::unwind::unwind()")]) == "(no Python frame)"
    assert report["largest_blocks"] == [[120, "kernels/activations.py:90 unpack_fp8"],
                                        [50, "kernels/activations.py:90 unpack_fp8"], [30, "w/model.py:5 forward"]]
    text = format_report(report)
    assert "peak 0.000 GiB" in text and "unpack_fp8" in text and "largest blocks live at the peak" in text
    # block 3 is still allocated when the recording ends: what a step leaves for the next, by the line that made it
    assert report["left_by_site"] == {"w/model.py:5 forward": [30, 1]}
    assert "allocated in the step and still allocated after it:" in text
    assert "left_by_site" in live_at_peak(events[:2]) and live_at_peak(events[:2])["left_by_site"] == {
        "w/model.py:5 forward": [100, 1], "kernels/activations.py:90 unpack_fp8": [50, 1]}


def test_peak_memory_shows_a_compiled_graphs_allocation_with_its_shape_and_kernel(tmp_path):
    # the device's generated code goes with the machine: the report keeps the line while it can be read
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from peak_memory import allocating_code, copy_generated, format_report, live_at_peak

    (tmp_path / "q7").mkdir()
    code = tmp_path / "q7" / "cinq.py"
    code.write_text("from torch._inductor.runtime import triton_helpers\n"
                    "def call(args):\n"
                    "    buf7 = empty_strided_cuda((8192, 14336), (14336, 1), torch.float32)\n"
                    "    buf8 = reinterpret_tensor(buf7, (4, 2048, 14336), (29360128, 14336, 1), 0)  # alias\n"
                    "    triton_red_fused_add_amax_1.run(buf0, buf7, 117440512)\n"
                    "    buf9 = torch.ops.aten._scaled_mm.default(buf0, buf1, scale_a=buf2, scale_b=buf3)\n"
                    "    return (buf7, )\n")
    graph = [{"filename": str(code), "line": 3, "name": "call"}]
    events = [{"action": "alloc", "addr": 1, "size": 2**29, "frames": graph}]
    report = live_at_peak(events)
    assert allocating_code(graph) == ("buf7 = empty_strided_cuda((8192, 14336), (14336, 1), torch.float32)  ->  "
                                      "triton_red_fused_add_amax_1.run(buf0, buf7, 117440512)")
    assert "| buf7 = empty_strided_cuda((8192, 14336)" in format_report(report)
    # the generated file goes beside the report, named as its site names it
    assert report["generated_files"] == [str(code)]
    assert copy_generated(report, str(tmp_path / "out.peak_code")) == ["q7_cinq.py"]
    assert (tmp_path / "out.peak_code" / "q7_cinq.py").read_text() == code.read_text()
    # an op of the generated code that allocates its own output: its line
    assert allocating_code([{"filename": str(code), "line": 6, "name": "call"}]).startswith("buf9 = torch.ops.aten.")
    # a line of ordinary Python that is no allocation adds nothing
    plain = tmp_path / "model.py"
    plain.write_text("def forward(x):\n    return x.float()\n")
    assert allocating_code([{"filename": str(plain), "line": 2, "name": "forward"}]) is None
    assert allocating_code([]) is None
    # a model's own line names no file to copy; a file gone from the machine is skipped
    plain_report = live_at_peak([{"action": "alloc", "addr": 2, "size": 8,
                                  "frames": [{"filename": str(plain), "line": 2, "name": "forward"}]}])
    assert plain_report["generated_files"] == []
    code.unlink()
    assert copy_generated(report, str(tmp_path / "gone")) == [] and not (tmp_path / "gone").exists()


def _largest_model():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import largest_model

    return largest_model


@pytest.mark.parametrize("oom_from, expected, tries", [(100, 38, 1), (37, 36, 3), (30, None, 3)])
def test_largest_model_predicts_from_two_depths_and_confirms(oom_from, expected, tries):
    # a fake GPU: 2 GiB + 1 GiB per block, out of memory from `oom_from` blocks; 40 GiB allowed
    largest_model = _largest_model()
    ran = []

    def fits(blocks):
        ran.append(blocks)
        if blocks >= oom_from:
            return {"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
        return {"peak_gib": 2.0 + blocks}

    record = largest_model.largest(fits, (2, 4), 40.0, tries)
    assert record["per_block_gib"] == pytest.approx(1.0) and record["rest_gib"] == pytest.approx(2.0)
    assert record.get("blocks") == expected
    assert ran[:3] == [2, 4, 38]  # the prediction first, then one block fewer per out-of-memory run
    if expected is None:
        assert "still out of memory" in record["error"]


def test_largest_model_reports_other_errors_and_flat_peaks():
    largest_model = _largest_model()
    assert largest_model.largest(lambda n: {"error": "te missing"}, (2, 4), 40.0, 3)["error"] == "te missing"
    flat = largest_model.largest(lambda n: {"peak_gib": 5.0}, (2, 4), 40.0, 3)
    assert "did not grow" in flat["error"]


def test_largest_model_caps_each_run_at_the_capacity_it_is_given(monkeypatch, tmp_path, capsys):
    # an 80 GB card's answer on a larger one: every run's allocator capped (headline.py --memory-gib)
    largest_model = _largest_model()
    assert largest_model.command("msamp O2", "d4096", 12, "o.json")[-2:] == ["--out", "o.json"]
    assert largest_model.command("msamp O2", "d4096", 12, "o.json", 78.5)[-2:] == ["--memory-gib", "78.5"]
    # msamp's delayed scales are a graph of their own, compiled when its warm-up ends: its runs go past it
    steps = largest_model.command("msamp O2", "d4096", 12, "o.json")
    assert steps[steps.index("--warmup") + 1] == "17" and steps[steps.index("--steps") + 1] == "18"
    steps = largest_model.command("torchao act8", "d4096", 12, "o.json")
    assert steps[steps.index("--warmup") + 1] == "1" and steps[steps.index("--steps") + 1] == "2"
    seen = []
    monkeypatch.setattr(largest_model, "measure",
                        lambda config, width, blocks, cap=None: seen.append(cap) or {"peak_gib": 2.0 + blocks})
    out = tmp_path / "largest.json"
    results = largest_model.main(["--capacity-gib", "40", "--configs", "bf16 compiled", "--out", str(out)])
    assert set(seen) == {40.0} and results["memory_capped"] and results["fraction"] == 1.0
    assert results["configs"]["bf16 compiled"]["blocks"] == 38  # up to the cap itself: the cap confirms
    for bad, says in ((["--capacity-gib", "0"], "--capacity-gib must be positive"),
                      (["--capacity-gib", "40", "--fraction", "1.5"], "--fraction must be in (0, 1]")):
        with pytest.raises(SystemExit):
            largest_model.main(bad + ["--out", str(out)])
        assert says in capsys.readouterr().err


def test_headline_memory_cap_needs_a_cuda_device(capsys, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline

    if headline.torch.cuda.is_available():
        pytest.skip("the refusal is of a machine without CUDA")
    with pytest.raises(SystemExit):
        headline.main(["--configs", "bf16 compiled", "--memory-gib", "78.5", "--out", str(tmp_path / "h.json")])
    assert "--memory-gib caps a CUDA device's memory" in capsys.readouterr().err


def test_headline_widths_take_a_depth_and_count_the_proxys_parameters():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline

    assert headline.dims("d2048x7") == (2048, 7168, 7)
    with pytest.raises(argparse.ArgumentTypeError, match="xN blocks"):
        headline.dims("d2048x")
    d, ff, layers = headline.dims("tinyx3")
    model = headline.Proxy(d, ff, layers)
    assert headline.params("tinyx3") == sum(p.numel() for p in model.parameters())


def test_layer_host_benchmark_on_cpu(tmp_path):
    # every variant builds, trains and reports (emulated GEMMs on a CPU: a smoke test, the numbers are the GPU's)
    out = tmp_path / "layer_host.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "layer_host.py"), "--dim", "64", "--tokens", "16",
           "--calls", "3", "--variants", "bf16,o2 eager,o3 compiled", "--profile", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = json.loads(out.read_text())["variants"]
    assert list(variants) == ["bf16", "o2 eager", "o3 compiled"]
    # times only: train > forward from 3 calls failed once on a loaded 2-core CI host; the GPU's numbers are the claim
    assert all(row["forward_us"] > 0 and row["train_us"] > 0 for row in variants.values())
    assert "cProfile" in (tmp_path / "layer_host.json.o3_compiled.txt").read_text()


@pytest.mark.parametrize(("args", "message"), [(["--variants", "bf16,o4 eager"], "--variants: 'o4 eager' not among"),
                                               (["--calls", "0"], "--calls must be at least 1")])
def test_layer_host_benchmark_names_the_option_a_bad_value_was_given_to(tmp_path, args, message):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "layer_host.py"), *args, "--out", str(tmp_path / "x.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr


def test_fp8_transpose_benchmark_on_cpu(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "fp8_transpose.py"), "--shapes", "48x16,3x5", "--out",
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["shapes"]
    assert list(rows) == ["48x16", "3x5"] and all(r["bytes_equal"] and r["lowprec_us"] > 0 for r in rows.values())


@pytest.mark.parametrize("shapes", ["4096", "0x4", "ax4", "4x4x4"])
def test_fp8_transpose_benchmark_names_the_option_a_bad_shape_was_given_to(tmp_path, shapes):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "fp8_transpose.py"), "--shapes", shapes, "--out",
           str(tmp_path / "x.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "--shapes takes ROWSxCOLS" in proc.stderr


def test_activation_codec_benchmark_on_cpu(tmp_path):
    out = tmp_path / "a.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "activation_codec.py"), "--shapes", "48x256,3x5",
           "--dtypes", "bf16,fp16", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["shapes"]
    assert list(rows) == ["48x256-bf16", "48x256-fp16", "3x5-bf16", "3x5-fp16"]
    assert all(r["bytes_equal"] and r["encode_us"] > 0 and r["decode_us"] > 0 for r in rows.values())


@pytest.mark.parametrize("option, value, message", [("--dtypes", "bf16,fp8", "--dtypes takes a comma-separated list"),
                                                    ("--shapes", "0x4", "--shapes takes ROWSxCOLS")])
def test_activation_codec_benchmark_names_the_option_a_bad_value_was_given_to(tmp_path, option, value, message):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "activation_codec.py"), option, value, "--out",
           str(tmp_path / "x.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr


def _matrix_table():
    """scripts/gpu/matrix_table.py's `table` (a script beside the GPU scripts, not a package module)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))
    try:
        from matrix_table import table
    finally:
        sys.path.pop(0)
    return table


def _cell(backend, engine, steady, peak=10.0):
    return {"backend": backend, "engine": engine, "all_forwards_in_fp8": backend != "bf16", "first_loss": 6.0,
            "last_loss": 3.0, "median_step_s": steady, "steady_median_step_s": steady,
            "peak_memory_gib_per_rank": [peak, peak]}


def test_matrix_table_compares_each_round_with_its_own_bf16(tmp_path):
    # scripts/gpu/multi.sh with ROUNDS=2 writes r1/ and r2/: a round's FP8 cell against that round's BF16 only
    table = _matrix_table()
    for folder, bf16_s, fp8_s in (("r1", 0.126, 0.105), ("r2", 0.120, 0.110)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "bf16_fsdp2.json").write_text(json.dumps(_cell("bf16", "fsdp2", bf16_s)))
        (tmp_path / folder / "msamp_O3_fsdp2.json").write_text(json.dumps(_cell("msamp", "fsdp2", fp8_s, 7.3)))
    text = table(str(tmp_path))
    assert "| r1/msamp_O3_fsdp2 | True | 6.00 → 3.00 | 105 | 1.20 | 105 | 1.20 | 7.3 | 0.73 |" in text
    assert "| r2/msamp_O3_fsdp2 | True | 6.00 → 3.00 | 110 | 1.09 | 110 | 1.09 | 7.3 | 0.73 |" in text
    assert "| msamp_O3_fsdp2 | 1.200 | 1.091 | 1.145 |" in text
    (tmp_path / "r1" / "bf16_fsdp2.json").unlink()  # no baseline in that round: no ratio, not another round's
    assert "| r1/msamp_O3_fsdp2 | True | 6.00 → 3.00 | 105 | n/a |" in table(str(tmp_path))


def test_matrix_table_says_where_each_cells_wall_time_went(tmp_path):
    # 74-98 s a cell for 31-43 s of steps at 300 steps (2026-11-29): the timeline names the rest
    table = _matrix_table()
    timed = {**_cell("te", "fsdp2", 0.1), "step_times_s": [2.0] + [0.1] * 10, "launch_wall_s": 45.0,
             "timeline_s": {"before_main": 12.5, "accelerator": 1.5, "built": 4.0, "prepared": 9.5, "trained": 22.0,
                            "evaluated": 25.0}}
    (tmp_path / "te_current_fsdp2.json").write_text(json.dumps(timed))
    (tmp_path / "bf16_fsdp2.json").write_text(json.dumps(_cell("bf16", "fsdp2", 0.12)))  # an older cell: no timeline
    text = table(str(tmp_path))
    assert "| te_current_fsdp2 | 12.5 | 1.5 | 2.5 | 5.5 | 3.0 (2.0) | 12.5 | 7.5 |" in text
    assert "| bf16_fsdp2 | 12.5" not in text and text.count("| launch + imports s |") == 1
    timed["timeline_s"]["before_main"] = None  # no /proc: the launch's share unknown, the rest still given
    (tmp_path / "te_current_fsdp2.json").write_text(json.dumps(timed))
    assert "| te_current_fsdp2 |  | 1.5 | 2.5 | 5.5 | 3.0 (2.0) | 12.5 |  |" in table(str(tmp_path))
    # a cell from before the Accelerator mark and multi.sh's wall time (2026-11-29): its build holds the Accelerator
    del timed["timeline_s"]["accelerator"], timed["launch_wall_s"]
    timed["timeline_s"]["before_main"] = 12.5
    (tmp_path / "te_current_fsdp2.json").write_text(json.dumps(timed))
    assert "| te_current_fsdp2 | 12.5 |  | 4.0 | 5.5 | 3.0 (2.0) | 12.5 |  |" in table(str(tmp_path))
    # with the end of main() and the wall clocks of the launch and of main()'s start (since 2026-11-30): the time
    # outside main() split into the launcher's before the ranks started and the exit after end_training
    timed.update(launch_wall_s=45, launch_started_s=1000.0, main_started_s=1014.0, launch_ended_s=1045.0)
    timed["timeline_s"].update(accelerator=1.5, ended=26.0)
    (tmp_path / "te_current_fsdp2.json").write_text(json.dumps(timed))
    assert ("| te_current_fsdp2 | 12.5 | 1.5 | 2.5 | 5.5 | 3.0 (2.0) | 13.5 | 6.5 (launcher 1.5, exit 5.0) |"
            in table(str(tmp_path)))


def test_matrix_table_gives_each_phases_device_and_host_time(tmp_path):
    # a forward whose host time reaches its device time is bound by the host: both clocks side by side
    table = _matrix_table()
    phases = {"host": {"forward": 36.5, "backward": 40.9}, "device": {"forward": 37.1, "backward": 57.3}}
    (tmp_path / "msamp_O3_fsdp2.json").write_text(json.dumps({**_cell("msamp", "fsdp2", 0.1), "phase_ms": phases}))
    (tmp_path / "bf16_fsdp2.json").write_text(json.dumps({**_cell("bf16", "fsdp2", 0.12),
                                                          "phase_ms": {"host": {"forward": 17.3, "backward": 22.3}}}))
    text = table(str(tmp_path))
    assert "| msamp_O3_fsdp2 | device | 37.1 | 57.3 |\n| msamp_O3_fsdp2 | host | 36.5 | 40.9 |" in text
    assert "| bf16_fsdp2 | host | 17.3 | 22.3 |" in text and "| bf16_fsdp2 | device |" not in text  # a CPU run


def test_matrix_table_gives_each_seeds_held_out_loss_against_its_bf16_and_the_mean(tmp_path):
    # multi.sh's SEEDS writes s0/ and s1/: each seed's FP8 cell against BF16 of the same seed, then the mean
    table = _matrix_table()
    for folder, bf16_loss, fp8_loss in (("s0", 2.00, 2.04), ("s1", 2.10, 2.079)):
        (tmp_path / folder).mkdir()
        for backend, loss, step in (("bf16", bf16_loss, 0.140), ("msamp", fp8_loss, 0.105)):
            cell = {**_cell(backend, "ddp", step), "heldout_loss": loss, "eval_batches": 8, "seed": int(folder[1])}
            (tmp_path / folder / f"{backend}_ddp.json").write_text(json.dumps(cell))
    text = table(str(tmp_path))
    assert "| s0/msamp_ddp | True | 6.00 → 3.00 | 105 | 1.33 | 105 | 1.33 | 10.0 | 1.00 |  |  | 2.0400 (+2.00%) |" \
        in text
    assert "| cell (held-out loss vs BF16, %) | s0 | s1 | mean |" in text
    assert "| msamp_ddp | +2.00 | -1.00 | +0.50 |" in text
    # a seed evaluated on other batches than its BF16 is no comparison: left out of that seed's column and the mean
    other = {**json.loads((tmp_path / "s1" / "msamp_ddp.json").read_text()), "eval_batches": 4}
    (tmp_path / "s1" / "msamp_ddp.json").write_text(json.dumps(other))
    assert "| msamp_ddp | +2.00 |  | +2.00 |" in table(str(tmp_path))


def test_matrix_table_averages_rounds_and_seeds_but_not_an_engine_matrixs_parts(tmp_path):
    # engine_matrix.sh's parts (ddp/, fsdp2/) are different cells side by side, not repeats of one cell
    table = _matrix_table()
    for part, engine in (("ddp", "ddp"), ("fsdp2", "fsdp2")):
        (tmp_path / part).mkdir()
        (tmp_path / part / f"bf16_{engine}.json").write_text(json.dumps(_cell("bf16", engine, 0.140)))
        (tmp_path / part / f"msamp_{engine}.json").write_text(json.dumps(_cell("msamp", engine, 0.105)))
    text = table(str(tmp_path))
    assert "| ddp/msamp_ddp | True |" in text and "| fsdp2/msamp_fsdp2 | True |" in text
    assert "mean |" not in text


def test_matrix_table_compares_a_compiled_model_with_compiled_bf16(tmp_path):
    # multi.sh's 'model' flag: the whole model compiled, against BF16 compiled the same way, never eager BF16
    table = _matrix_table()
    cells = {"bf16_fsdp2": _cell("bf16", "fsdp2", 0.125), "torchao_fsdp2": _cell("torchao", "fsdp2", 0.100, 7.3),
             "bf16_fsdp2_model": {**_cell("bf16", "fsdp2", 0.110), "compiled_model": True},
             "torchao_fsdp2_model": {**_cell("torchao", "fsdp2", 0.088, 7.3), "compiled_model": True}}
    for name, cell in cells.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(cell))
    text = table(str(tmp_path))
    assert "| torchao_fsdp2 | True | 6.00 → 3.00 | 100 | 1.25 |" in text
    assert "| torchao_fsdp2_model | True | 6.00 → 3.00 | 88 | 1.25 |" in text  # 110 / 88, not 125 / 88


@pytest.mark.parametrize("rounds", ["0", "two", "-1"])
def test_multi_sh_names_rounds_it_cannot_take(tmp_path, rounds):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "multi.sh"), str(tmp_path / "m"), "bf16::ddp"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "ROUNDS": rounds})
    assert proc.returncode == 2 and f"ROUNDS must be a whole number >= 1, got '{rounds}'" in proc.stderr


@pytest.mark.parametrize("seeds, rounds, says", [
    ("0 x", "1", "SEEDS must be whole numbers >= 0 separated by spaces, got '0 x'"),
    ("-1", "1", "SEEDS must be whole numbers >= 0"),
    ("1 2 1", "1", "SEEDS names seed 1 twice"),
    ("0 1", "2", "SEEDS and ROUNDS > 1 cannot be combined"),
])
def test_multi_sh_names_seeds_it_cannot_take(tmp_path, seeds, rounds, says):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "multi.sh"), str(tmp_path / "m"), "bf16::ddp"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SEEDS": seeds, "ROUNDS": rounds})
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_matrix_table_leaves_out_what_a_short_cpu_run_cannot_give(tmp_path):
    # fewer than 6 steps: no median; on a CPU: no CUDA peak (0). The table says n/a instead of failing.
    table = _matrix_table()
    for backend in ("bf16", "msamp"):
        cell = {**_cell(backend, "ddp", None, 0.0), "median_step_s": None}
        (tmp_path / f"{backend}_ddp.json").write_text(json.dumps(cell))
    assert "| msamp_ddp | True | 6.00 → 3.00 |  | n/a |  |  | 0.0 | n/a |  |" in table(str(tmp_path))


@pytest.mark.parametrize("cell, flag", [("bf16::ddp:::act9", "act9"), ("msamp::ddp:::eager+bogus", "bogus")])
def test_multi_sh_names_a_sixth_field_flag_it_does_not_know(tmp_path, cell, flag):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "multi.sh"), str(tmp_path / "m"), cell],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"unknown sixth field '{flag}'" in proc.stderr
    flags = "compiled|eager|fp8w|overlap|act8|bf16m|fp8m|model|fused|noag|aocast|ingraph|prefetch|prefetch2"
    assert f"({flags}, joined with +)" in proc.stderr


@pytest.mark.slow
def test_act8_bisect_runs_every_variant_and_tabulates_them_against_bf16(tmp_path):
    # scripts/gpu/act8_bisect.sh at the CPU's size: nine processes, each with its JSON, and the summary table
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(SIZE="tiny", STEPS="2", COMMIT="test", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "act8_bisect.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (tmp_path / "act8-bisect" / "summary.md").read_text()
    for name in ("bf16", "act8", "act8_torchloss", "act8_hooks", "act8_keep_fp32", "eager_act8", "eager_attention",
                 "eager_mlp", "eager_norm"):
        assert f"| {name} |" in summary, (name, summary, (tmp_path / "act8-bisect" / f"{name}.log").read_text()[-2000:])
    assert "| bf16 | " in summary and "+0.00%" in summary and "no result" not in summary
    kept = (tmp_path / "act8-bisect" / "eager_attention.log").read_text()
    assert "act8_bisect keep=attention heldout_loss=" in kept
    assert "act8_bisect keep=traced-fp32 heldout_loss=" in (tmp_path / "act8-bisect" / "act8_keep_fp32.log").read_text()
    # the later rounds' runs, named: one of each kind (a patched run, the library's own, a trace of every decision)
    later = tmp_path / "later"
    env.update(RUNS="bf16 act8_hooks_keep_fp32 torchao_act8 trace_graph", TRACE_SIZE="tiny")
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "act8_bisect.sh"), str(later)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (later / "act8-bisect" / "summary.md").read_text()
    assert "| act8_hooks_keep_fp32 |" in summary and "| torchao_act8 |" in summary and "no result" not in summary
    assert "| act8 |" not in summary and "trace" not in summary
    trace = (later / "act8-bisect" / "trace_graph.log").read_text()
    assert "act8_trace pack packed" in trace or "act8_trace pack_traced packed" in trace


def test_call_sites_rank_the_operators_by_their_own_time_and_name_the_asking_line(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from call_sites import asking_frames, record_call_sites

    frames = ["/x/site-packages/torch/nn/modules/linear.py(125): forward", "/work/model.py(12): forward",
              "/work/train.py(40): step", "<frozen runpy>(88): _run_code"]
    assert asking_frames(frames, 2) == ["/work/model.py(12): forward", "/work/train.py(40): step"]
    assert asking_frames(frames[:1]) == frames[:1]  # nothing of the user's: the innermost as it is
    assert asking_frames(["/b/call_sites.py(80): record_call_sites", "/w/t.py(3): f"]) == ["/w/t.py(3): f"]
    # as the profiler names them: below their sys.path entry, a library by its first part
    assert asking_frames(["torchao/float8/float8_ops.py(364): float8_mm", "torch/autograd/function.py(609): apply",
                          "lowprec/optim/grad_store.py(98): accumulate_into", "headline.py(280): step"]) == [
        "lowprec/optim/grad_store.py(98): accumulate_into", "headline.py(280): step"]

    weight = torch.randn(1024, 1024)

    def step(ids):  # a matmul that dwarfs the rest, from this file
        return (ids @ weight).relu().sum()

    ids = torch.randn(512, 1024)
    step(ids)  # first-call costs out of the way
    result = record_call_sites(step, ids, False, str(tmp_path / "s.txt"), top=5)
    mm = next(row for row in result["by_shape"] if row["name"] == "aten::mm")
    assert "[512, 1024]" in mm["input_shapes"] and mm["ms"] > 0 and mm["calls"] == 1
    mm = next(row for row in result["by_site"] if row["name"] == "aten::mm")
    assert "test_benchmarks.py" in mm["sites"][0] and "step" in mm["sites"][0]
    text = (tmp_path / "s.txt").read_text()
    assert "aten::mm" in text and "test_benchmarks.py" in text
    assert "<built-in" not in text and "call_sites.py(" not in text  # Python's calls and the recorder's own frames


def test_call_sites_take_an_events_own_stack_where_no_python_call_is_its_parent():
    # the GPU host's profiler (torch 2.11) recorded no Python call around te O2 act8's operators at 2a04d10
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from call_sites import by_site
    from torch.autograd import DeviceType

    def op(name, parent=None, stack=()):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, self_cpu_time_total=1000.0, cpu_parent=parent,
                               stack=list(stack))

    caller = op("/work/train.py(40): step")
    events = [op("aten::mm", stack=["torch/nn/functional.py(10): linear", "/work/model.py(12): forward"]),
              op("aten::add", parent=caller, stack=["/work/other.py(1): f"]), op("aten::relu")]
    sites = {row["name"]: row["sites"] for row in by_site(events, "self_cpu_time_total")}
    assert sites["aten::mm"] == ["/work/model.py(12): forward"]
    assert sites["aten::add"] == ["/work/train.py(40): step"]  # the parents first, where there are any
    assert sites["aten::relu"] == []


def test_every_configuration_scripts_gpu_memory_sh_names_exists():
    # a label the headline does not know fails on the GPU host, a device call spent: caught here
    import shlex

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline

    labels, command = set(), []
    for line in open(os.path.join(ROOT, "scripts", "gpu", "memory.sh")):
        if "benchmarks/headline.py" in line or command:
            command.append(line.rstrip().removesuffix("\\"))
            if not line.rstrip().endswith("\\"):
                taking = False
                for token in shlex.split(" ".join(command).split(">")[0]):
                    if token.startswith("--"):
                        taking = token in ("--configs", "--profile-configs", "--peak-configs")
                    elif taking and "$" not in token:
                        labels.add(token)
                command = []
    assert {"msamp O2 act8 recompute", "msamp O2 act8 own rows realize64", "bf16 compiled"} <= labels
    assert labels <= set(headline.CONFIGS), labels - set(headline.CONFIGS)


def test_multi_sh_says_what_it_cannot_import_before_the_first_launch(tmp_path):
    # a python3 without the packages (here: an empty PATH but for a stub that fails every import)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "multi.sh"), str(tmp_path / "m"),
                           "bf16::zero2", "te:current:fsdp2"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "cannot import all of accelerate torchao deepspeed transformer_engine.pytorch" in proc.stderr
    assert "== bf16::zero2" not in proc.stdout  # nothing launched


def test_multi_sh_adds_each_launchs_wall_time_to_its_cell(tmp_path):
    # 74-98 s a cell against ~60 s of the ranks' own timeline (2026-11-30): the launcher's start and the ranks' exit
    # are outside it, so multi.sh writes the launch's wall time into the cell for matrix_table.py
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "accelerate").write_text('#!/bin/sh\nwhile [ "$1" != --out ]; do shift; done\n'
                                        'echo "{\\"backend\\": \\"bf16\\", \\"engine\\": \\"ddp\\", '
                                        '\\"fast_exit\\": \\"$LOWPREC_HARNESS_FAST_EXIT\\"}" > "$2"\n')
    (bin_dir / "accelerate").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_"))}
    env["PATH"] = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), env.get("PATH", "")])
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "multi.sh"), str(tmp_path / "m"), "bf16::ddp"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cell = json.loads((tmp_path / "m" / "bf16_ddp.json").read_text())
    assert cell["backend"] == "bf16" and isinstance(cell["launch_wall_s"], int) and cell["launch_wall_s"] >= 0
    assert 0 <= cell["launch_ended_s"] - cell["launch_started_s"] < cell["launch_wall_s"] + 1.5
    assert cell["fast_exit"] == "1"  # the ranks end with os._exit by default (FAST_EXIT)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "multi.sh"), str(tmp_path / "m"), "bf16::ddp"],
                          capture_output=True, text=True, timeout=60, env={**env, "FAST_EXIT": "no"}, cwd=ROOT)
    assert proc.returncode == 2 and "FAST_EXIT must be 0 or 1, got 'no'" in proc.stderr


def test_matrix_table_sets_each_cells_model_state_beside_its_plan_and_names_an_empty_result(tmp_path):
    table = _matrix_table()

    def state(total, planned):
        return {"model_state_bytes_per_param": {"all_params": {"total": total}}, "planned_bytes_per_param": planned}

    (tmp_path / "bf16_fsdp2.json").write_text(json.dumps({**_cell("bf16", "fsdp2", 0.12), **state(8.0, None)}))
    (tmp_path / "msamp_O3_fsdp2.json").write_text(json.dumps({**_cell("msamp", "fsdp2", 0.1), **state(3.5, 3.504)}))
    (tmp_path / "torchao_fsdp2.json").write_text(json.dumps({**_cell("torchao", "fsdp2", 0.1), **state(8.0, 16.0)}))
    (tmp_path / "bf16_zero2.json").write_text("")  # the harness failed after opening its result file
    text = table(str(tmp_path))
    assert "| 3.50 (3.50) |" in text and "| 8.00 (16.00) **differs** |" in text and "| 8.00 |" in text
    assert "| bf16_zero2 | refused: no result: an empty JSON (see the cell's log)" in text


def test_engine_matrix_lists_each_parts_cells_and_refuses_an_unknown_part(tmp_path):
    script = os.path.join(ROOT, "scripts", "gpu", "engine_matrix.sh")
    proc = subprocess.run(["bash", script, str(tmp_path), "fsdp2", "compiled"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DRY": "1"})
    assert proc.returncode == 0, proc.stderr
    fsdp2, compiled = proc.stdout.splitlines()
    # each part holds the BF16 cell of every engine and mode it measures: matrix_table compares within a part
    assert fsdp2.split()[:3] == ["CASE_TIMEOUT=150", "multi.sh", f"{tmp_path}/fsdp2"]
    assert fsdp2.split()[3:] == ["bf16::fsdp2", "te:current:fsdp2", "te:current:fsdp2:::fp8w",
                                 "torchao:tensorwise:fsdp2", "msamp@O3::fsdp2"]
    assert {"bf16::fsdp2:::model+fused", "bf16::ddp:::model"} <= set(compiled.split())
    proc = subprocess.run(["bash", script, str(tmp_path), "zero4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown part 'zero4'" in proc.stderr
    # zero's seven cells pass one call at 300 steps: its ZeRO-1 and ZeRO-2 halves are parts of their own
    proc = subprocess.run(["bash", script, str(tmp_path), "zero", "zero1", "zero2"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DRY": "1"})
    zero, zero1, zero2 = (line.split()[3:] for line in proc.stdout.splitlines())
    assert zero1 + zero2 == zero and {c.split(":")[0] for c in zero1} == {"bf16", "torchao", "msamp@O3"}
    # 300 steps: a cell's launch needs more than 30 steps' 150 s; a CASE_TIMEOUT given is kept
    for env, limit in (({"STEPS": "300"}, "220"), ({"STEPS": "300", "CASE_TIMEOUT": "90"}, "90")):
        proc = subprocess.run(["bash", script, str(tmp_path), "ddp"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "DRY": "1", **env})
        assert proc.stdout.split()[0] == f"CASE_TIMEOUT={limit}", proc.stdout


def test_engine_matrix_runs_parts_at_once_on_disjoint_gpu_groups(tmp_path):
    # on four GPUs two parts fit the time of one: each pair its parts in turn, its own rendezvous port
    script = os.path.join(ROOT, "scripts", "gpu", "engine_matrix.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "MAIN_PORT")}
    proc = subprocess.run(["bash", script, str(tmp_path), "ddp", "fsdp2", "zero"], capture_output=True, text=True,
                          timeout=60, env={**env, "DRY": "1", "GPU_GROUPS": "0,1 2,3"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "== GPUs 0,1" and lines[3] == "== GPUs 2,3" and len(lines) == 5
    pair = ["CUDA_VISIBLE_DEVICES=0,1", "MAIN_PORT=29510", "CASE_TIMEOUT=150", "multi.sh"]
    assert [line.split()[:4] for line in lines[1:3]] == [pair, pair]
    assert [line.split()[4] for line in lines[1:3]] == [f"{tmp_path}/ddp", f"{tmp_path}/zero"]
    assert lines[4].split()[:5] == ["CUDA_VISIBLE_DEVICES=2,3", "MAIN_PORT=29520", "CASE_TIMEOUT=150", "multi.sh",
                                    f"{tmp_path}/fsdp2"]
    for groups in ("0,1 x", "0;1"):
        proc = subprocess.run(["bash", script, str(tmp_path), "ddp"], capture_output=True, text=True, timeout=60,
                              env={**env, "DRY": "1", "GPU_GROUPS": groups})
        assert proc.returncode == 2 and "GPU_GROUPS must be GPU lists separated by spaces" in proc.stderr


def test_engine_matrix_within_its_budget_names_the_cells_it_did_not_start_and_still_packs_the_part(tmp_path):
    # an outer `timeout` killed the ddp part at 300 steps before its table and packing (2026-11-29); with BUDGET_S
    # a cell starts only where the time left holds one, and the part ends with its table, packed
    import tarfile

    pytest.importorskip("torchao")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_"))}
    env.update(BUDGET_S="1", COMMIT="test", PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "engine_matrix.sh"), str(tmp_path), "compiled"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "== bf16::fsdp2:::model+fused: not started (" in proc.stdout and "BUDGET_S=1 left" in proc.stdout
    # before a first cell the estimate is CASE_TIMEOUT, and says so (2026-11-29: "a cell took up to 300 s", none had)
    assert "no cell has run yet: CASE_TIMEOUT=150 s stands for one" in proc.stdout
    with tarfile.open(tmp_path / "compiled.tgz") as tgz:
        names = set(tgz.getnames())
        listed = tgz.extractfile("compiled/not_started.txt").read().decode().split("\n")
    assert {"compiled/table.md", "compiled/commit.txt"} <= names and not any(n.endswith(".json") for n in names)
    assert listed[:4] == ["bf16::fsdp2:::model+fused", "torchao:tensorwise:fsdp2:::model+fused", "bf16::ddp:::model",
                          "msamp@O2::ddp:::model"]


@pytest.mark.parametrize("port", ["0", "http", "70000", "-1"])
def test_multi_sh_names_a_port_it_cannot_take(tmp_path, port):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "multi.sh"), str(tmp_path / "m"), "bf16::ddp"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "MAIN_PORT": port})
    assert proc.returncode == 2 and f"MAIN_PORT must be a port number from 1 to 65535, got '{port}'" in proc.stderr


@pytest.mark.parametrize("script", ["multi.sh", "engine_matrix.sh"])
@pytest.mark.parametrize("budget", ["0", "ten", "-5"])
def test_gpu_scripts_name_a_budget_they_cannot_take(tmp_path, script, budget):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", script), str(tmp_path / "m"),
                           "bf16::ddp" if script == "multi.sh" else "ddp"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BUDGET_S": budget})
    assert proc.returncode == 2 and f"BUDGET_S must be a whole number of seconds > 0, got '{budget}'" in proc.stderr


def test_every_engine_matrix_cell_has_its_bf16_baseline_in_its_part(tmp_path):
    parts = ["ddp", "ddp_levels", "fsdp2", "zero", "zero1", "zero2", "zero3", "compiled"]
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "engine_matrix.sh"), str(tmp_path), *parts],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "DRY": "1"})
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == len(parts), proc.stderr
    for line in proc.stdout.splitlines():
        cells = [c.split(":") + [""] * (6 - len(c.split(":"))) for c in line.split()[3:]]
        baselines = {(engine, "model" in flags) for backend, _, engine, *_, flags in cells if backend == "bf16"}
        for backend, _, engine, *_, flags in cells:
            assert (engine, "model" in flags) in baselines, (line, backend, engine, flags)


def test_matrix_table_sets_each_held_out_loss_beside_bf16s_of_the_same_engine(tmp_path):
    table = _matrix_table()
    cells = {"bf16_fsdp2": (2.00, 8), "msamp_O3_fsdp2": (2.02, 8), "torchao_fsdp2": (1.99, 4)}
    for name, (loss, batches) in cells.items():
        cell = {**_cell(name.split("_")[0], "fsdp2", 0.1), "heldout_loss": loss, "eval_batches": batches}
        (tmp_path / f"{name}.json").write_text(json.dumps(cell))
    text = table(str(tmp_path))
    assert "| 2.0200 (+1.00%) |" in text
    assert "| 1.9900 |" in text  # evaluated on other batches than BF16's: no difference to give


@pytest.mark.parametrize("value, flag", [(None, "--compile"), ("false", "--no-compile"), ("eager", None)])
def test_memory_sh_convergence_runs_eager_when_told(value, flag, tmp_path):
    # te's DelayedScaling refuses compiled code: its convergence runs need every run eager, BF16 too
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/argv\n")
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COMMIT": "abc"}
    env.pop("CONVERGENCE_COMPILE", None)
    if value is not None:
        env["CONVERGENCE_COMPILE"] = value
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu", "memory.sh"), str(tmp_path / "m"),
                           "convergence"], capture_output=True, text=True, timeout=60, env=env)
    if flag is None:
        assert proc.returncode == 2 and "CONVERGENCE_COMPILE must be true or false, got 'eager'" in proc.stderr
        assert not (tmp_path / "argv").exists()
    else:
        assert proc.returncode == 0, proc.stderr
        argv = (tmp_path / "argv").read_text().split()
        assert argv[:4] == ["-m", "lowprec.cli", "bench", "--convergence"] and argv[4] == flag


def _cudnn_frontend_wheel(path, header=True):
    import zipfile

    names = {"cudnn/_compiled_module.so": b"\0" * 4096, "cudnn/__init__.py": b"from ._compiled_module import *\n",
             "nvidia_cudnn_frontend-1.32.0.dist-info/METADATA": b"Name: nvidia-cudnn-frontend\nVersion: 1.32.0\n"}
    if header:
        names["include/cudnn_frontend.h"] = b"#pragma once\n"
    record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in names.items())
    names["nvidia_cudnn_frontend-1.32.0.dist-info/RECORD"] = (record + "nvidia_cudnn_frontend-1.32.0.dist-info/"
                                                                       "RECORD,,\n").encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, d in names.items():
            z.writestr(n, d)


def test_slim_bundle_keeps_the_headers_te_compiles_against_and_nothing_else(tmp_path):
    import zipfile

    wheel = tmp_path / "nvidia_cudnn_frontend-1.32.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    _cudnn_frontend_wheel(wheel)
    script = [sys.executable, os.path.join(ROOT, "scripts", "gpu", "slim_bundle.py"), str(tmp_path)]
    proc = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("nvidia_cudnn_frontend-1.32.0.dist-info/RECORD").decode()
    assert names == {"include/cudnn_frontend.h", "nvidia_cudnn_frontend-1.32.0.dist-info/METADATA",
                     "nvidia_cudnn_frontend-1.32.0.dist-info/RECORD"}
    assert "cudnn/" not in record and "include/cudnn_frontend.h" in record  # pip's RECORD names what is there
    slim = wheel.read_bytes()
    assert subprocess.run(script, capture_output=True, text=True, timeout=60).returncode == 0
    assert wheel.read_bytes() == slim  # a second run leaves a slim wheel as it is


def test_slim_bundle_leaves_a_wheel_without_the_header_as_it_is(tmp_path):
    wheel = tmp_path / "nvidia_cudnn_frontend-9.0.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    _cudnn_frontend_wheel(wheel, header=False)
    before = wheel.read_bytes()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu", "slim_bundle.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "has no include/cudnn_frontend.h" in proc.stderr
    assert wheel.read_bytes() == before
