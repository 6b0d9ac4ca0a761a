"""The main job (`lowprec demo`): BF16 then FP8 on the standard-library corpus, and its table."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from lowprec.demo.data import TOKENIZATIONS, Windows, stdlib_corpus, tokenize

pytest.importorskip("transformers")
pytest.importorskip("torchao")


def test_corpus_split_is_deterministic_and_disjoint():
    a, b = stdlib_corpus(max_bytes=2**20), stdlib_corpus(max_bytes=2**20)
    assert a.train.equal(b.train) and a.heldout.equal(b.heldout)
    assert a.heldout.numel() > 10_000 and a.train.numel() > 10 * a.heldout.numel() // 2
    windows = Windows(a.train, 64, 10, seed=3)
    assert windows[0].shape == (64,) and int(windows[0].max()) < 256
    assert Windows(a.train, 64, 10, seed=3)[7].equal(windows[7])


def test_pair_tokens_read_two_bytes_as_one_id():
    stream = torch.tensor([1, 2, 255, 255, 0, 7, 9], dtype=torch.uint8)
    assert tokenize(stream, "bytes") is stream
    assert tokenize(stream, "pairs").tolist() == [1 * 256 + 2, 65535, 7]  # the odd last byte is dropped
    corpus = stdlib_corpus(max_bytes=2**20)
    pairs = tokenize(corpus.train, "pairs")
    assert int(pairs.max()) < TOKENIZATIONS["pairs"] and pairs.numel() == corpus.train.numel() // 2
    assert len(pairs.unique()) > 2000  # a vocabulary, not a handful of ids
    assert Windows(pairs, 64, 4, seed=0)[0].dtype == torch.int64
    with pytest.raises(ValueError, match="tokenization='words' is not one of 'bytes', 'pairs'"):
        tokenize(stream, "words")


def test_demo_run_on_pair_tokens_has_a_64k_output_head(tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    from lowprec.demo.run import parse_args, run

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # a short window: CPU BF16 GEMMs against a 65536-row head are slow
    result = run(parse_args(["--variant", "fp8", "--steps", "2", "--batch", "2", "--seq-len", "16", "--eval-batches",
                             "1", "--tokens", "pairs", "--no-progress"]))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert result["vocab_size"] == 65536 and result["tokens"] == "pairs"
    head = next(m for m in result["plan"]["modules"] if m["fqn"] == "lm_head")
    assert head["convert"] and tuple(head["shape"]) == (65536, 128)
    assert "modules: 15 of 15 Linear layers in FP8" in result["plan_text"]
    assert result["first_loss"] == pytest.approx(math.log(65536), rel=0.1)  # uniform over the 64K ids at init


def test_demo_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env["TORCHAO_FORCE_SKIP_LOADING_SO_FILES"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU demo (emulated FP8) on a CUDA host too (tests/conftest.py cpu_host)
    proc = subprocess.run(
        [sys.executable, "-m", "lowprec.cli", "demo", "--steps", "12", "--out", str(tmp_path), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "lowprec precision plan: backend torchao" in out
    assert "| BF16 autocast" in out and "| FP8 torchao:tensorwise (emulated)" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    bf16, fp8 = summary["bf16"], summary["fp8"]
    for run in (bf16, fp8):
        assert run["steps"] == 12 and run["final_loss"] < run["first_loss"] - 0.5
    assert fp8["emulated"] and summary["speedup"] is None
    assert len([m for m in fp8["plan"]["modules"] if m["convert"]]) == 15  # every Linear, the head included
    assert abs(summary["heldout_delta"]) < 0.05


def test_demo_run_with_gradient_accumulation(tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    from lowprec.demo.run import parse_args, run

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    result = run(parse_args(["--variant", "fp8", "--steps", "4", "--grad-accum", "2", "--batch", "4",
                             "--no-progress", "--json", str(tmp_path / "r.json")]))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert result["steps"] == 4 and result["tokens_per_step"] == 2 * 4 * 128
    # the library's defaults, not a quietly tuned subset: skip_slow_shapes stays on, and on the CPU
    # (nothing measured) it skips nothing, which the printed plan says
    assert result["plan"]["options"]["skip_slow_shapes"] is True
    assert "skip_slow_shapes: no measured thresholds for CPU (emulated)" in result["plan_text"]
    assert "modules: 15 of 15 Linear layers in FP8" in result["plan_text"]
    assert json.loads((tmp_path / "r.json").read_text())["grad_accum"] == 2
    from lowprec.demo.model import PRESETS
    from lowprec.demo.schedule import lr_schedule

    # one rate an optimizer step, not one a micro-step
    assert result["learning_rates"] == [PRESETS["tiny"].lr * lr_schedule(4)(s) for s in range(4)]


def test_two_ranks_follow_the_same_learning_rates_as_one(tmp_path):
    # Accelerate steps a prepared scheduler once per process each step: on two ranks bench's schedule ended halfway
    # and its cosine climbed back; stepped by the run once an optimizer step, it is the same on any process count
    from conftest import free_port, run_processes

    from lowprec.demo.model import PRESETS
    from lowprec.demo.schedule import lr_schedule

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    # ACCELERATE_USE_CPU: Accelerate's MULTI_CPU (gloo); without it each CPU rank ran a training of its own
    env.update(OMP_NUM_THREADS="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", CUDA_VISIBLE_DEVICES="",
               ACCELERATE_USE_CPU="true")
    out = tmp_path / "r.json"
    proc = run_processes([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), "-m", "lowprec.demo.run", "--variant", "bf16", "--steps", "6",
                          "--grad-accum", "2", "--batch", "2", "--seq-len", "16", "--eval-batches", "1",
                          "--no-progress", "--json", str(out)], env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["steps"] == 6
    assert result["learning_rates"] == pytest.approx([PRESETS["tiny"].lr * lr_schedule(6)(s) for s in range(6)])


@pytest.mark.parametrize("policy", ["bf16", "keep"])
def test_demo_run_stores_fp32_saved_tensors_as_asked(tmp_path, monkeypatch, policy):
    from accelerate.state import AcceleratorState, GradientState

    from lowprec.demo.run import parse_args, run
    from lowprec.runtime.activations_fp32 import ENV

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv(ENV, "fp8")  # restored after the test: the flag sets it for the run
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    result = run(parse_args(["--variant", "fp8", "--backend", "msamp", "--opt-level", "O2", "--activation-dtype", "fp8",
                             "--activations-fp32", policy, "--steps", "2", "--batch", "2", "--no-progress",
                             "--json", str(tmp_path / "r.json")]))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert result["fp8_activations"]["fp32_saved_as"] == policy


def test_demo_run_stores_adams_moments_as_asked(tmp_path):
    # `lowprec bench`'s ",optimizer_states=bf16": the run's recipe takes it, and the model state shrinks by it
    from accelerate.state import AcceleratorState, GradientState

    from lowprec.demo.run import parse_args, run

    states = {}
    for choice in (None, "bf16"):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        argv = ["--variant", "fp8", "--backend", "torchao", "--steps", "2", "--batch", "2", "--no-progress",
                "--json", str(tmp_path / "r.json")] + (["--optimizer-states", choice] if choice else [])
        result = run(parse_args(argv))
        states[choice] = (result["optimizer_states"], result["peak_split"]["model_state_bytes"])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert states[None][0] is None and states["bf16"][0] == "bf16"
    assert states["bf16"][1] < states[None][1]  # BF16 moments: 4 bytes a parameter less than FP32's


def test_demo_refuses_an_fp32_policy_without_fp8_activations(capsys):
    from lowprec.demo.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--variant", "fp8", "--activations-fp32", "keep"])
    assert "--activations-fp32 keep says how FP8 activations store FP32 tensors: it needs --activation-dtype fp8" in \
        capsys.readouterr().err


def test_demo_run_hands_the_amax_algorithm_to_the_recipe(tmp_path):
    # `lowprec bench`'s ",amax_compute_algo=most_recent": the run's recipe takes it and its plan says so
    from accelerate.state import AcceleratorState, GradientState

    from lowprec.demo.run import parse_args, run

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    result = run(parse_args(["--variant", "fp8", "--backend", "msamp", "--recipe", "delayed", "--amax-compute-algo",
                             "most_recent", "--steps", "2", "--batch", "2", "--no-progress",
                             "--json", str(tmp_path / "r.json")]))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert result["amax_compute_algo"] == "most_recent"
    assert "the most_recent amax of the last 16 steps" in result["plan_text"]


# ---- a bad FP8 choice fails before the BF16 baseline runs (issue 16) ------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["--recipe", "bogus"], "FP8RecipeKwargs.recipe='bogus' is not a recipe of any backend"),
    (["--backend", "nope"], "FP8RecipeKwargs.backend='nope' is not one of"),
    (["--backend", "torchao", "--opt-level", "O4"], "FP8RecipeKwargs.opt_level='O4' is not one of"),
])
def test_demo_rejects_a_bad_fp8_choice_before_running(argv, expected, capsys, monkeypatch):
    from lowprec.demo import compare

    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail("a training run was started"))
    assert compare.main(argv + ["--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "the FP8 run cannot start, so nothing was run" in err and expected in err


def test_demo_without_te_says_what_to_install_before_running(capsys, monkeypatch):
    from lowprec.demo import compare

    monkeypatch.setattr("lowprec.backends.base.availability", lambda name: (False, f"{name} is not installed"))
    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail("a training run was started"))
    assert compare.main(["--backend", "te", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "FP8RecipeKwargs(backend='te') cannot be used: transformer_engine is not installed" in err


@pytest.mark.parametrize("steps", ["0", "-3", "x"])
def test_demo_steps_must_be_a_positive_integer(steps, capsys):
    from lowprec.demo import compare

    with pytest.raises(SystemExit):
        compare.parse_args(["--steps", steps])
    assert "argument --steps" in capsys.readouterr().err


def test_demo_shows_the_plan_before_any_training(capsys, monkeypatch, tmp_path):
    # issue 31: the plan is what the FP8 run will do, so it comes before the runs, not after both
    from lowprec.demo import compare

    events = []

    def fake_run(cmd, env=None, **kwargs):
        variant = cmd[cmd.index("--variant") + 1]
        events.append(("run", variant, capsys.readouterr().out, env.get("LOWPREC_QUIET")))
        result = {"label": variant, "emulated": True, "first_loss": 5.0, "final_loss": 3.0, "heldout_loss": 3.1,
                  "tokens_per_s": 1000.0, "peak_memory_bytes": 2**30, "plan_text": plan_text[0]}
        with open(cmd[cmd.index("--json") + 1], "w") as fh:
            json.dump(result, fh)
        return subprocess.CompletedProcess(cmd, 0)

    plan_text = [None]
    original = compare.plan_fp8_run

    def plan_and_remember(*args):
        plan, problem = original(*args)
        plan_text[0] = str(plan)
        return plan, problem

    monkeypatch.setattr(compare, "plan_fp8_run", plan_and_remember)
    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    assert compare.main(["--steps", "2", "--out", str(tmp_path), "--no-progress"]) == 0
    (_, first, before_bf16, quiet), (_, second, before_fp8, _) = events
    assert (first, second) == ("bf16", "fp8") and quiet == "1"  # the FP8 process need not print it again
    assert "lowprec precision plan: backend torchao" in before_bf16 and "modules: 15 of 15 Linear layers" in before_bf16
    after = capsys.readouterr().out
    assert "lowprec precision plan" not in before_fp8 + after  # once, before training
    assert "| fp8 (emulated)" in after  # the comparison table, after the runs


def test_demo_says_so_if_the_fp8_run_prepared_another_plan(capsys, monkeypatch, tmp_path):
    from lowprec.demo import compare

    def fake_run(cmd, env=None, **kwargs):
        result = {"label": "x", "emulated": True, "first_loss": 5.0, "final_loss": 3.0, "heldout_loss": 3.1,
                  "tokens_per_s": 1000.0, "peak_memory_bytes": 2**30, "plan_text": "lowprec precision plan: other"}
        with open(cmd[cmd.index("--json") + 1], "w") as fh:
            json.dump(result, fh)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    assert compare.main(["--steps", "2", "--out", str(tmp_path), "--no-progress"]) == 0
    assert "prepared another plan than the one shown before training:\nlowprec precision plan: other" in (
        capsys.readouterr().out)


def test_msamps_warm_up_steps_are_left_out_of_the_timing(tmp_path):
    # msamp's layers scale from each tensor until their amax window (16 steps) has filled: `lowprec bench` times the
    # steps after it and the recompile at its end, unless told otherwise, and says when a run is too short for that
    from accelerate.state import AcceleratorState, GradientState

    from lowprec.demo.run import parse_args, run

    def timed(*extra):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        argv = ["--variant", "fp8", "--backend", "msamp", "--batch", "2", "--no-progress", "--json",
                str(tmp_path / "r.json"), *extra]
        try:
            return run(parse_args(argv))["timed_steps"]
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()

    assert timed("--steps", "20") == 2  # steps 19 and 20: past the window's 16 and the step after it
    assert timed("--steps", "20", "--warmup", "1") == 19  # as asked
    with pytest.warns(UserWarning, match="none past the 18 warm-up steps"):
        assert timed("--steps", "3") == 3


@pytest.mark.parametrize(("argv", "message"), [(["--steps", "0"], "argument --steps: must be 1 or more, got 0"),
                                               (["--warmup", "-1"], "--warmup must be 0 or more")])
def test_a_runs_bad_step_counts_are_refused_by_name(argv, message, capsys):
    from lowprec.demo.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--variant", "bf16", *argv])
    assert message in capsys.readouterr().err
