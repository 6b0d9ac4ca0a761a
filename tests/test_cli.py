"""`lowprec plan` and `lowprec env`, run in-process."""

from __future__ import annotations

import json
import sys

import pytest

from lowprec.cli import main

pytest.importorskip("transformers")


def test_plan_builtin_proxy_for_h100(capsys):
    assert main(["plan", "--model", "proxy", "--capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "execution: hardware FP8" in out
    # every projection in FP8; the 4096->256 byte-vocabulary head is a shape FP8 loses at
    assert "28 of 29 Linear layers in FP8" in out and "lm_head " in out
    assert "| this plan (torchao:tensorwise) | FP8 E4M3/E5M2 |" in out


def test_plan_from_transformers_config_with_overrides(capsys):
    args = ["plan", "--config", "llama", "--set", "hidden_size=2048", "--set", "intermediate_size=5632",
            "--set", "num_hidden_layers=2", "--set", "num_attention_heads=16", "--set", "vocab_size=32000",
            "--recipe", "rowwise", "--capability", "9.0", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recipe"] == "rowwise" and plan["emulated"] is False
    by_name = {m["fqn"]: m for m in plan["modules"]}
    # rowwise thresholds keep N=2048 projections in BF16 but convert the 2048->5632 MLP inputs
    assert by_name["model.layers.1.mlp.up_proj"]["convert"] is True
    assert "N=2048 <= 2048" in by_name["model.layers.1.self_attn.k_proj"]["reason"]
    assert plan["model_state_bytes_per_param"] == 16


def test_plan_local_config_file(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                vocab_size=1000).save_pretrained(tmp_path)
    assert main(["plan", "--config", str(tmp_path), "--no-skip-slow-shapes", "--no-skip-first-last"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM from config" in out
    assert "lm_head" in out and "1000 not divisible by 16" in out.replace("out_features=", "")


@pytest.mark.parametrize(("args", "said"), [
    (["--config", "llama", "--set", "hidden_size=abc"], "--set {'hidden_size': 'abc'} is not a valid 'llama' config"),
    (["--config", "llama", "--set", "hidden_size=-8"], "--set {'hidden_size': -8} is not a valid 'llama' config"),
    (["--config", "BAD_JSON"], "could not be read as a transformers config"),
])
def test_a_config_that_cannot_be_read_is_one_line_not_a_traceback(tmp_path, args, said):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    args = [str(bad) if a == "BAD_JSON" else a for a in args]
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    assert said in str(exc.value) and str(exc.value).startswith("lowprec plan: ")


@pytest.mark.parametrize(("args", "said"), [
    (["--engine", "ddp", "--world-size", "-4"], "--world-size -4: the number of processes, 1 or more"),
    (["--engine", "ddp", "--world-size", "0"], "--world-size 0: the number of processes, 1 or more"),
    (["--world-size", "0"], "--world-size 0: the number of processes, 1 or more"),  # not "--engine single"'s
    (["--world-size", "4"], "--world-size 4 with --engine single"),
    (["--engine", "fsdp2", "--world-size", "4", "--hosts", "5"], "--hosts 5: the machines the --world-size 4"),
    (["--engine", "fsdp2", "--world-size", "4", "--hosts", "0"], "from 1 to 4"),
    (["--capability", "-1.0"], "capability='-1.0' is not of the form MAJOR.MINOR with MAJOR from 1 to 15"),
    (["--capability", "99.0"], "capability='99.0' is not of the form MAJOR.MINOR with MAJOR from 1 to 15 and MINOR "
                               "one digit"),
    (["--capability", "9.99"], "capability='9.99' is not of the form"),
])
def test_an_impossible_machine_is_refused(capsys, args, said):
    assert main(["plan", *args]) == 2
    assert said in capsys.readouterr().err


def test_plan_for_backend_that_cannot_run_here_is_a_clear_error(capsys):
    assert main(["plan", "--backend", "te"]) == 2
    err = capsys.readouterr().err
    assert "TransformerEngine has no emulation mode" in err and "--capability" in err


def test_plan_te_for_h100_needs_no_te_installed(capsys):
    assert main(["plan", "--backend", "te", "--recipe", "current", "--capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "backend te (NVIDIA TransformerEngine), recipe 'current'" in out
    assert "9 of 9 norm layers replaced" in out  # 2 per layer x 4 layers + the final norm


def test_plan_bad_option_value(capsys):
    assert main(["plan", "--recipe", "blockwise", "--backend", "torchao"]) == 2
    err = capsys.readouterr().err
    assert "FP8RecipeKwargs.recipe='blockwise'" in err and "'tensorwise'" in err


def test_env_lists_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torchao  recipes tensorwise, rowwise, rowwise_with_gw_hp: available" in out
    assert "te       recipes" in out


def test_plan_tiny_for_hopper_states_that_nothing_is_fp8(capsys):
    assert main(["plan", "--model", "tiny", "--capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "modules: 0 of 15 Linear layers in FP8" in out
    assert "  WARNING: no Linear layer (of 15) runs in FP8 on assumed GPU (sm_90)" in out
    assert "-> skip_slow_shapes=False converts them anyway" in out and "skip_first_last" not in out


def test_plan_tiny_on_cpu_converts_what_the_defaults_convert(capsys):
    assert main(["plan", "--model", "tiny", "--capability", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "modules: 15 of 15 Linear layers in FP8" in out and "WARNING" not in out
    assert "skip_slow_shapes: no measured thresholds for CPU (emulated); every eligible Linear is converted" in out


def test_plan_storage_options(capsys):
    argv = ["plan", "--model", "proxy", "--capability", "9.0", "--backend", "torchao", "--engine", "ddp",
            "--world-size", "2", "--opt-level", "O1", "--weight-dtype", "bf16", "--optimizer-states", "fp8",
            "--grad-comm-dtype", "bf16", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {t["kind"]: t["dtype"] for t in plan["tensors"]}
    assert rows["weight"].startswith("BF16 (FP8 Linear)")
    assert rows["weight_grad"].startswith("FP8 E4M3 (FP8 Linear)")
    assert rows["optimizer_states"] == "FP8 E4M3+FP16"
    assert rows["grad_comm"] == "FP8 E4M3, shared scale (FP8 Linear), BF16 (rest)"
    assert main(["plan", "--backend", "msamp", "--weight-grad-dtype", "bf16"]) == 2
    assert "weight_grad_dtype='bf16' cannot be honoured by backend 'msamp'" in capsys.readouterr().err


@pytest.mark.parametrize("hosts, comm", [("1", "BF16"), ("2", "FP8")])
def test_plan_o3_under_fsdp2_for_one_host_or_several(capsys, hosts, comm):
    argv = ["plan", "--model", "proxy", "--capability", "9.0", "--backend", "msamp", "--opt-level", "O3",
            "--engine", "fsdp2", "--world-size", "16", "--hosts", hosts, "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {t["kind"]: t["dtype"] for t in plan["tensors"]}["grad_comm"].startswith(comm)


def test_plan_model_and_config_together_is_an_error(capsys):
    with pytest.raises(SystemExit, match="--model 'tiny' and --config 'llama' both choose the model"):
        main(["plan", "--model", "tiny", "--config", "llama"])


def test_plan_unknown_config_is_a_short_error():
    with pytest.raises(SystemExit) as err:
        main(["plan", "--config", "/no/such/config"])
    message = str(err.value)
    assert "neither a local config file/folder nor a transformers model type" in message and len(message) < 400


def test_plan_keeps_the_index_of_a_lone_layer(capsys):
    # skip_first_last keeps layer 0's q_proj; the other layer's q_proj is FP8: two different lines
    assert main(["plan", "--model", "tiny", "--capability", "9.0", "--no-skip-slow-shapes", "--skip-first-last"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj" in out and "model.layers.1.self_attn.q_proj" in out
    assert "model.layers.*.self_attn.q_proj" not in out


def test_plan_shows_which_layers_of_a_split_pattern_each_line_holds(capsys):
    # layers 0 and 1 kept by pattern, 2 and 3 in FP8: each line names its layers
    argv = ["plan", "--config", "llama", "--set", "num_hidden_layers=4", "--set", "hidden_size=256",
            "--set", "intermediate_size=512", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
            "--set", "vocab_size=512", "--capability", "9.0", "--no-skip-slow-shapes", "--no-skip-first-last",
            "--exclude", "model.layers.[01].*"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "model.layers.{2-3}.mlp.up_proj x2" in out and "model.layers.{0-1}.mlp.up_proj x2" in out
    assert "model.layers.*.mlp.up_proj" not in out


def test_plan_for_an_eager_or_a_compiled_model(capsys):
    # d2048 on an H100: eager (the layers compiled one by one) FP8 was measured slower there, compiled not
    args = ["plan", "--backend", "torchao", "--config", "llama", "--set", "hidden_size=2048",
            "--set", "intermediate_size=5632", "--set", "num_hidden_layers=2", "--capability", "9.0", "--json"]
    assert main(args) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main([*args, "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    fp8 = [sum(m["convert"] for m in plan["modules"]) for plan in (eager, compiled)]
    assert fp8[0] == 0 < fp8[1]
    assert all("in an eager model (FP8 layers compiled one by one)" in m["reason"] for m in eager["modules"]
               if m["rule"] == "skip_slow_shapes")
    assert not any("compiled by torch.compile" in note for note in compiled["notes"])


def test_plan_keeps_whole_blocks(capsys):
    argv = ["plan", "--model", "tiny", "--capability", "cpu", "--skip-first-blocks", "1", "--skip-last-blocks", "1",
            "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    kept = {m["fqn"]: m["reason"] for m in plan["modules"] if not m["convert"]}
    assert len(kept) == 14 and all(name.startswith("model.layers.") for name in kept)  # the two blocks, every Linear
    assert kept["model.layers.1.mlp.up_proj"] == "in block 1 of model.layers (skip_last_blocks=1)"
    assert (plan["options"]["skip_first_blocks"], plan["options"]["skip_last_blocks"]) == (1, 1)


@pytest.mark.parametrize("argv,message", [
    (["--skip-first-blocks", "2", "--skip-last-blocks", "1"],
     "FP8RecipeKwargs.skip_first_blocks=2 and skip_last_blocks=1 keep 3 blocks in high precision, but "
     "LlamaForCausalLM has 2"),
    (["--skip-last-blocks", "-1"], "FP8RecipeKwargs.skip_last_blocks='-1' must be an integer >= 0"),
    (["--skip-first-blocks", "x"], "FP8RecipeKwargs.skip_first_blocks='x' must be an integer >= 0"),
])
def test_plan_bad_block_counts(capsys, argv, message):
    assert main(["plan", "--model", "tiny", "--capability", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny", "small", "proxy"])
def test_plan_of_a_built_in_model_needs_no_transformers(monkeypatch, capsys, model):
    # the quickstart installs lowprec with torchao only; its next command is `lowprec plan`
    import lowprec.utils.imports as imports

    assert main(["plan", "--model", model, "--backend", "te", "--capability", "9.0", "--json"]) == 0
    with_transformers = json.loads(capsys.readouterr().out)
    real = imports.is_available
    monkeypatch.setattr(imports, "is_available", lambda name: False if name == "transformers" else real(name))
    monkeypatch.setitem(sys.modules, "transformers", None)  # importing it would now fail
    assert main(["plan", "--model", model, "--backend", "te", "--capability", "9.0", "--json"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert without.pop("model").endswith("; its layers' shapes, built without transformers")
    with_transformers.pop("model")
    assert without == with_transformers  # every module, kind, shape, reason and row the same


def test_a_missing_package_is_named_in_a_readable_sentence(monkeypatch):
    from lowprec.demo.model import PRESETS, build_model
    from lowprec.utils.imports import MissingDependencyError

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr("lowprec.utils.imports.availability",
                        lambda name: (False, f"{name} is not installed. Install it with: pip install {name}"))
    with pytest.raises(MissingDependencyError, match="^the demo model needs transformers: transformers is not "
                                                     "installed. Install it with: pip install transformers$"):
        build_model(PRESETS["tiny"])


def test_plan_shows_what_is_saved_for_backward(capsys):
    assert main(["plan", "--model", "proxy", "--backend", "msamp", "--opt-level", "O2", "--capability", "9.0",
                 "--activation-dtype", "fp8", "--json"]) == 0
    section = json.loads(capsys.readouterr().out)["activations"]
    assert section["other_tensors"].startswith("FP8 E4M3, a power-of-2 scale per 128 values")
    # the proxy's Linear inputs per token and block: 6 x 4096 + the FFN width, one byte each against BF16's two
    assert section["linear_bytes_per_token"] == pytest.approx(section["baseline_linear_bytes_per_token"] / 2)
    assert main(["plan", "--model", "proxy", "--activation-dtype", "fp4"]) == 2
    assert "activation_dtype='fp4' is not one of 'fp8'" in capsys.readouterr().err
