"""`lowprec bench`: configurations parsed, each run in its own process, ratios against BF16, outputs written."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from lowprec.demo.bench import available_configs, main, markdown, parse_args, parse_config, summarise

pytest.importorskip("torchao")
pytest.importorskip("transformers")


def test_parse_config():
    assert parse_config("bf16")["backend"] is None
    assert parse_config("msamp:delayed:O2") == {"name": "msamp:delayed:O2", "backend": "msamp", "recipe": "delayed",
                                                "opt_level": "O2", "options": {}}
    for bad in ("torchao", "a:b:c:d", "torchao::O1"):
        with pytest.raises(argparse.ArgumentTypeError, match="backend:recipe"):
            parse_config(bad)


def test_parse_config_options_turn_a_layer_rule_off():
    config = parse_config("torchao:tensorwise,skip_first_last=false,skip_slow_shapes=True")
    assert config["backend"] == "torchao" and config["recipe"] == "tensorwise" and config["opt_level"] is None
    assert config["options"] == {"skip_first_last": False, "skip_slow_shapes": True}
    for bad in ("torchao:tensorwise,skip_first_last=maybe", "torchao:tensorwise,fast=true", "torchao:tensorwise,"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not one of skip_first_last=true|false"):
            parse_config(bad)


def test_parse_config_takes_fp8_activations():
    config = parse_config("msamp:delayed:O2,activation_dtype=fp8")
    assert config["options"] == {"activation_dtype": "fp8"} and config["opt_level"] == "O2"
    for bad in ("msamp:delayed:O2,activation_dtype=fp4", "msamp:delayed:O2,activation_dtype=true"):
        with pytest.raises(argparse.ArgumentTypeError, match="activation_dtype=fp8"):
            parse_config(bad)


def _run_command(monkeypatch, config: dict) -> list[str]:
    """The command line `bench.run_one` starts for `config` (the process itself stopped before it runs)."""
    import lowprec.demo.bench as bench

    seen = {}
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: seen.update(cmd=cmd) or argparse.Namespace(
        returncode=1, stderr="stopped here"))
    bench.run_one(config, "llama", [], "/nonexistent", raw=False)
    return seen["cmd"]


def test_parse_config_takes_how_fp8_activations_store_fp32_tensors(monkeypatch):
    config = parse_config("msamp:delayed:O2,activation_dtype=fp8,activations_fp32=BF16")
    assert config["options"] == {"activation_dtype": "fp8", "activations_fp32": "bf16"}
    with pytest.raises(argparse.ArgumentTypeError, match=r"activations_fp32=fp8\|bf16\|keep"):
        parse_config("msamp:delayed:O2,activation_dtype=fp8,activations_fp32=fp16")
    # handed to the run as its flag
    assert _run_command(monkeypatch, config)[-4:] == ["--activation-dtype", "fp8", "--activations-fp32", "bf16"]


def test_parse_config_takes_the_optimizers_states(monkeypatch):
    # Adam's moments are a configuration's too: te and torchao with FP8 activations peak at their model state
    config = parse_config("te:delayed,activation_dtype=fp8,optimizer_states=BF16")
    assert config["options"] == {"activation_dtype": "fp8", "optimizer_states": "bf16"}
    with pytest.raises(argparse.ArgumentTypeError, match=r"optimizer_states=fp32\|bf16\|fp16\|fp8"):
        parse_config("te:delayed,optimizer_states=e5m2")
    config = parse_config("torchao:tensorwise,optimizer_states=fp8")
    assert _run_command(monkeypatch, config)[-2:] == ["--optimizer-states", "fp8"]


def test_parse_config_names_where_fp8_activations_are_stored(monkeypatch):
    # the hooks' form is a configuration of its own, so that its runs are never pooled with the in-graph ones
    config = parse_config("msamp:delayed:O2,activation_dtype=fp8,activations_in_graph=false")
    assert config["options"] == {"activation_dtype": "fp8", "activations_in_graph": False}
    for bad in ("msamp:delayed:O2,activations_in_graph=false", "msamp:delayed:O2,activations_fp32=bf16"):
        with pytest.raises(argparse.ArgumentTypeError, match="it needs activation_dtype=fp8"):
            parse_config(bad)
    assert _run_command(monkeypatch, config)[-3:] == ["--activation-dtype", "fp8", "--no-activations-in-graph"]


def test_parse_config_takes_a_delayed_recipes_amax_algorithm_and_tes_first_scales(monkeypatch):
    # the A/Bs of te's first delayed step and of its amax history, each paired with BF16 in one bench
    config = parse_config("te:delayed,amax_compute_algo=MOST_RECENT,te_first_scales=false")
    assert config["options"] == {"amax_compute_algo": "most_recent", "te_first_scales": False}
    assert _run_command(monkeypatch, config)[-3:] == ["--amax-compute-algo", "most_recent", "--no-te-first-scales"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"amax_compute_algo=max\|most_recent"):
        parse_config("te:delayed,amax_compute_algo=mean")
    for bad in ("te:current,te_first_scales=false", "msamp:delayed:O2,te_first_scales=true"):
        with pytest.raises(argparse.ArgumentTypeError, match="te_first_scales .* it needs te:delayed"):
            parse_config(bad)


def test_parse_config_takes_tes_fp8_only_weights(monkeypatch):
    # te with FP8-only weights against te and BF16 in one bench: the loss of FusedAdam's moments measured so
    from lowprec.demo.run import parse_args as run_args

    config = parse_config("te:current,fp8_weights=true,optimizer_states=bf16")
    assert config["options"] == {"fp8_weights": True, "optimizer_states": "bf16"}
    assert _run_command(monkeypatch, config)[-3:] == ["--fp8-weights", "--optimizer-states", "bf16"]
    assert _run_command(monkeypatch, parse_config("te:delayed,fp8_weights=false"))[-1] == "--no-fp8-weights"
    for bad in ("torchao:tensorwise,fp8_weights=true", "msamp:delayed:O2,fp8_weights=false"):
        with pytest.raises(argparse.ArgumentTypeError, match="fp8_weights .* it needs backend te"):
            parse_config(bad)
    assert run_args(["--variant", "fp8", "--backend", "te", "--fp8-weights"]).fp8_weights is True
    assert run_args(["--variant", "fp8", "--backend", "te"]).fp8_weights is None  # the library's default
    for other in (["--variant", "fp8", "--backend", "torchao"], ["--variant", "bf16"]):
        with pytest.raises(SystemExit):
            run_args([*other, "--fp8-weights"])


def test_the_run_hands_the_amax_algorithm_to_the_recipe_and_the_first_scales_to_te(monkeypatch):
    from lowprec.backends.te import first_scales
    from lowprec.demo.run import parse_args as run_args

    args = run_args(["--variant", "fp8", "--backend", "te", "--recipe", "delayed", "--amax-compute-algo", "most_recent",
                     "--no-te-first-scales"])
    assert (args.amax_compute_algo, args.te_first_scales) == ("most_recent", False)
    with pytest.raises(SystemExit):
        run_args(["--variant", "fp8", "--amax-compute-algo", "mean"])
    for other in (["--backend", "te", "--recipe", "current"], ["--backend", "torchao"]):
        with pytest.raises(SystemExit):
            run_args(["--variant", "fp8", *other, "--te-first-scales"])
    monkeypatch.delenv(first_scales.ENV, raising=False)
    assert first_scales.enabled()


def test_the_run_sets_where_fp8_activations_are_stored(monkeypatch):
    from lowprec.demo.run import parse_args as run_args

    with pytest.raises(SystemExit):
        run_args(["--variant", "fp8", "--no-activations-in-graph"])
    assert run_args(["--variant", "fp8", "--activation-dtype", "fp8", "--no-activations-in-graph"]
                    ).activations_in_graph is False


def test_parse_config_names_the_bad_level():
    with pytest.raises(argparse.ArgumentTypeError, match="level 'O9' is not one of O1, O2, O3"):
        parse_config("torchao:tensorwise:O9")


def test_available_configs_on_cpu_are_what_lowprec_accepts_here():
    skipped = {}
    names = available_configs(compiled=False, skipped=skipped)
    assert names[0] == "bf16"
    assert "te:delayed" in skipped and "transformer_engine" in skipped["te:delayed"]  # the reason is kept
    assert {"torchao:tensorwise", "torchao:tensorwise:O1", "torchao:tensorwise:O2", "msamp:delayed:O2"} <= set(names)
    assert not any(n.startswith("te:") for n in names)  # TransformerEngine has no CPU mode


def run(arch, config, tokens, heldout, emulated=False, state=16.0, peak=2**30, split=None):
    return {"arch": arch, "config": config, "tokens_per_s": tokens, "step_ms_median": 1000 / tokens,
            "peak_memory_bytes": peak, "model_state_bytes_per_param": {"all_params": {"total": state}},
            "peak_memory_kind": "process peak RSS" if split is None else "cuda max_memory_allocated",
            "peak_split": split, "heldout_loss": heldout, "emulated": emulated, "losses": [2.0, 1.0]}


def test_the_peak_is_split_into_model_state_and_the_rest():
    gib = 2**30
    bf16 = run("llama", "bf16", 100.0, 2.0, peak=20 * gib,
               split={"model_state_bytes": 8 * gib, "rest_bytes": 12 * gib, "held_by_forward_bytes": 10 * gib})
    fp8 = run("llama", "msamp:delayed:O2,activation_dtype=fp8", 125.0, 2.01, state=6.0, peak=9 * gib,
              split={"model_state_bytes": 3 * gib, "rest_bytes": 6 * gib, "held_by_forward_bytes": 5 * gib})
    rows = {r["config"]: r for r in summarise([bf16, fp8])}
    row = rows["msamp:delayed:O2,activation_dtype=fp8"]
    assert row["peak_vs_bf16"] == pytest.approx(0.45)
    assert (row["state_gib"], row["rest_gib"], row["held_by_forward_gib"]) == (3.0, 6.0, 5.0)
    table = markdown(list(rows.values()), "header")
    assert "| 9.00 | 0.450x | 3.00 | 6.00 | 5.00 | 6.0 |" in table
    # a CPU run's peak is the process's RSS: no ratio, no split
    cpu = {r["config"]: r for r in summarise([run("llama", "bf16", 1.0, 2.0), run("llama", "torchao:tensorwise", 1.0,
                                                                                   2.0, emulated=True)])}
    assert "peak_vs_bf16" not in cpu["torchao:tensorwise"] and cpu["torchao:tensorwise"]["rest_gib"] is None


def test_ratios_are_against_the_bf16_run_of_the_same_model_class():
    rows = summarise([run("llama", "bf16", 100.0, 2.0), run("llama", "torchao:tensorwise", 130.0, 2.02),
                      run("qwen2", "bf16", 50.0, 3.0), run("qwen2", "msamp:delayed:O2", 60.0, 2.97, state=6.0),
                      {"arch": "qwen2", "config": "te:current", "error": ["te missing"]}])
    by = {(r["arch"], r["config"]): r for r in rows}
    assert by["llama", "torchao:tensorwise"]["speedup"] == pytest.approx(1.3)
    assert by["llama", "torchao:tensorwise"]["heldout_delta"] == pytest.approx(0.01)
    assert by["qwen2", "msamp:delayed:O2"]["speedup"] == pytest.approx(1.2)
    assert by["qwen2", "te:current"]["error"] == "te missing"
    table = markdown(rows, "header")
    assert "| llama | torchao:tensorwise | 130 | 1.300x |" in table and "failed: te missing" in table


def test_runs_that_shared_devices_compare_losses_and_memory_but_not_speed():
    rows = summarise([run("llama", "bf16", 100.0, 2.0), run("llama", "msamp:delayed:O2", 130.0, 2.02)], speeds=False)
    assert rows[1]["speedup"] is None and rows[1]["heldout_delta"] == pytest.approx(0.01)
    assert "| 130 | not compared |" in markdown(rows, "header")  # not "emulated": a GPU's run that shared it


@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_jobs_below_one_are_refused_by_name(jobs, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--jobs", jobs])
    assert f"--jobs {jobs}: give at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("emulated", [True, False])
def test_an_emulated_overhead_says_it_is_no_fp8_figure(emulated):
    fp8 = {**run("llama", "torchao:tensorwise", 20.0, 2.0, emulated=emulated), "overhead_vs_raw": 6.2}
    table = markdown(summarise([run("llama", "bf16", 100.0, 2.0), fp8]), "header")
    assert ("+620.0% (emulated: not an FP8 figure) |" in table) == emulated
    assert ("Emulated runs (no FP8 GPU here)" in table) == emulated
    assert ("+620.0% |" in table) == (not emulated)


@pytest.mark.slow
def test_bench_runs_each_configuration_in_its_own_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "lowprec.cli", "bench", "--size", "tiny", "--steps", "4", "--no-progress",
           "--configs", "torchao:tensorwise", "torchao:tensorwise,skip_first_last=true",
           "msamp:delayed:O2,activation_dtype=fp8", "--out", str(tmp_path), "--jobs", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    configs = [r["config"] for r in result["rows"]]
    # BF16 added: every ratio needs it
    assert configs == ["bf16", "torchao:tensorwise", "torchao:tensorwise,skip_first_last=true",
                       "msamp:delayed:O2,activation_dtype=fp8"]
    runs = {r["config"]: r for r in result["runs"]}
    assert len({r["pid"] for r in result["runs"]}) == 4  # four processes
    assert result["tokens"] == "bytes" and all(r["vocab_size"] == 256 for r in result["runs"])
    assert result["jobs"] == 2 and all(r.get("speedup") is None for r in result["rows"])  # two at a time: no speeds
    kept = runs["torchao:tensorwise,skip_first_last=true"]  # the head (and first Linear) in BF16: not the default
    assert kept["plan"]["options"]["skip_first_last"] is True
    assert "modules: 13 of 15 Linear layers in FP8" in kept["plan_text"] and kept["raw"]["fp8_layers"] == 13
    o2_run = runs["msamp:delayed:O2,activation_dtype=fp8"]
    o2 = o2_run["model_state_bytes_per_param"]["linear_weights"]["total"]
    assert o2 == pytest.approx(6.0, abs=0.01)
    # saved activations in FP8: packed in every forward, about half the bytes (1 + 1/128 per element from 2 or 4)
    assert o2_run["plan"]["options"]["activation_dtype"] == "fp8"
    act = o2_run["fp8_activations"]
    assert act["packed_tensors_per_forward"] >= 4
    assert act["bytes_after_per_forward"] < 0.6 * act["bytes_before_per_forward"]
    assert runs["torchao:tensorwise"]["fp8_activations"] is None
    split = o2_run["peak_split"]  # on CPU: the model state alone (the peak is the process's RSS)
    assert split["rest_bytes"] is None and split["held_by_forward_bytes"] is None
    assert split["model_state_bytes"] == pytest.approx(o2_run["model_state_bytes_per_param"]["all_params"]["total"]
                                                       * o2_run["params"])
    assert runs["torchao:tensorwise"]["raw"]["fp8_layers"] == 15 and "overhead_vs_raw" in runs["torchao:tensorwise"]
    assert all(len(r["losses"]) == 4 for r in result["runs"])
    assert (tmp_path / "results.md").read_text().count("| llama |") == 4
    assert (tmp_path / "throughput.png").stat().st_size > 1000 and (tmp_path / "loss.png").stat().st_size > 1000


def test_fp8_activation_counts_say_where_the_tensors_were_encoded():
    """Python hooks count every packed tensor and its bytes; graphs that encode inside themselves count what they
    pack once, at compile time, and no bytes: reported as such, never as zero bytes packed."""
    from types import SimpleNamespace

    from lowprec.demo.run import activation_counts
    from lowprec.runtime.activations import ActivationCounts

    hooks = SimpleNamespace(in_graph=False, fp32_policy="fp8",
                            counts=ActivationCounts(packed=8, bytes_before=800, bytes_after=404, untracked_fp32_kept=4,
                                                    logits_kept=2, constants_kept=8))
    assert activation_counts(hooks, 4) == {"inside_compiled_graphs": False, "packed_tensors_per_forward": 2.0,
                                           "bytes_before_per_forward": 200.0, "bytes_after_per_forward": 101.0,
                                           "fp32_saved_as": "fp8", "untracked_fp32_kept_per_forward": 1.0,
                                           "logits_kept_per_forward": 0.5, "constants_kept_per_forward": 2.0}
    graphs = SimpleNamespace(in_graph=True, fp32_policy="bf16",
                             counts=ActivationCounts(packed=0, traced_packed=10, traced_kept=3))
    counted = activation_counts(graphs, 4)
    assert counted["fp32_saved_as"] == "bf16"
    assert counted["inside_compiled_graphs"] and counted["packed_tensors_per_graph"] == 10
    assert counted["kept_tensors_per_graph"] == 3 and counted["bytes_after_per_forward"] is None
    # in-graph asked for, but nothing was compiled (an eager model): the hooks' own counts
    eager = SimpleNamespace(in_graph=True, fp32_policy="keep",
                            counts=ActivationCounts(packed=8, bytes_before=800, bytes_after=404))
    assert activation_counts(eager, 4)["packed_tensors_per_forward"] == 2.0
    assert activation_counts(None, 4) is None


@pytest.mark.parametrize(("visible", "count", "expected"), [
    (None, 2, ["0", "1"]),          # unset: the devices by index
    ("1", 1, ["1"]),                # a parent on GPU 1: its children too (they were given "0", another's GPU)
    ("3,1", 2, ["3", "1"]),
    (" GPU-5b2c , MIG-0 ", 2, ["GPU-5b2c", "MIG-0"]),
])
def test_parallel_runs_are_placed_on_the_devices_the_bench_itself_sees(visible, count, expected, monkeypatch):
    from lowprec.demo.bench import visible_devices

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_devices(count) == expected


def test_each_parallel_run_gets_a_device_the_bench_sees(tmp_path, monkeypatch):
    # `CUDA_VISIBLE_DEVICES=1 lowprec bench --jobs 4` put its four runs on GPU 0, beside another call's work there
    from lowprec.demo import bench

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(bench.torch.cuda, "current_device", lambda: 0)  # the configurations' check describes it
    monkeypatch.setattr(bench.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(bench, "plot", lambda *a: [])
    placed = []

    def fake_run_one(config, arch, common, out, raw, gpu=None, seed=None):
        placed.append(gpu)
        return {"config": config["name"], "arch": arch, "seed": seed, "error": "not run"}

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    bench.main(["--size", "tiny", "--steps", "2", "--no-progress", "--no-raw", "--no-compile", "--jobs", "4",
                "--configs", "msamp:delayed:O2", "--seeds", "2", "--out", str(tmp_path)])
    assert placed == ["1"] * 4


@pytest.mark.parametrize("compiled", [True, False])
def test_a_configuration_the_mode_refuses_is_named_before_any_run(compiled, tmp_path, capsys, monkeypatch):
    # TE's DelayedScaling does not compile: once BF16 had run for minutes, the failure came after it (2026-11-29)
    monkeypatch.setattr("lowprec.demo.bench.run_one", lambda *a, **k: pytest.fail("a run started"))
    flag = "--compile" if compiled else "--no-compile"
    if compiled:
        assert main(["--configs", "bf16", "te:delayed,optimizer_states=bf16", flag, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "'te:delayed,optimizer_states=bf16'" in err and "DelayedScaling" in err and "--no-compile" in err
    assert main(["--configs", "bf16", "nosuch:delayed", flag, "--out", str(tmp_path)]) == 2
    assert "'nosuch:delayed': FP8RecipeKwargs.backend='nosuch' is not one of 'auto'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_configuration_its_recipe_refuses_is_named_before_any_run_without_the_modes_advice(tmp_path, capsys,
                                                                                              monkeypatch):
    # torchao:nonsense trained BF16 first, then showed as a failed row (2026-11-30 audit): each is now made into its
    # FP8RecipeKwargs and adapter before anything runs
    monkeypatch.setattr("lowprec.demo.bench.run_one", lambda *a, **k: pytest.fail("a run started"))
    bad = ["torchao:nonsense", "torchao:tensorwise:O3", "torchao:rowwise,amax_compute_algo=max"]
    assert main(["--configs", "bf16", *bad, "torchao:tensorwise", "--no-compile", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "FP8RecipeKwargs.recipe='nonsense' is not a recipe of backend 'torchao'; it offers 'tensorwise'" in err
    assert "'torchao:tensorwise:O3': FP8RecipeKwargs.opt_level='O3'" in err
    assert "'torchao:rowwise,amax_compute_algo=max': FP8RecipeKwargs.amax_compute_algo='max'" in err
    assert "'torchao:tensorwise'" not in err.replace("'torchao:tensorwise:O3'", "")  # the good one is not named
    assert "This bench runs" not in err  # the mode is not the problem: no advice to change it
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--batch", "--seq-len", "--steps"])
@pytest.mark.parametrize("value", ["0", "-5", "x"])
def test_bench_and_demo_refuse_a_count_below_one_naming_the_flag(flag, value, capsys):
    # `lowprec demo --batch 0` trained with the preset's batch of 8, unsaid; --seq-len -5 failed deep in a subprocess
    from lowprec.demo.compare import parse_args as demo_args
    from lowprec.demo.run import parse_args as run_args

    for parse, extra in ((parse_args, []), (demo_args, []), (run_args, ["--variant", "bf16"])):
        with pytest.raises(SystemExit) as exc:
            parse([*extra, flag, value])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and ("1 or more" in err or "at least 1" in err), err
