"""The examples run as examples/README.md says (CPU, emulated FP8, a few steps), and every
`accelerate launch` config's fp8_config section is a recipe lowprec accepts for that config's engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

pytest.importorskip("torchao")
pytest.importorskip("transformers")

ROOT = os.path.join(os.path.dirname(__file__), "..")
EXAMPLES = os.path.join(ROOT, "examples")
CONFIGS = sorted(f for f in os.listdir(os.path.join(EXAMPLES, "configs")) if f.endswith(".yaml"))
ENGINE_OF = {"NO": "single", "MULTI_GPU": "ddp", "FSDP": "fsdp2", "DEEPSPEED": "deepspeed"}


def config(name: str) -> dict:
    with open(os.path.join(EXAMPLES, "configs", name)) as fh:
        return yaml.safe_load(fh)


def fp8_env(name: str) -> dict[str, str]:
    """What `accelerate launch --config_file` exports for the config's fp8_config section."""
    return {f"ACCELERATE_FP8_{key.upper()}": str(value) for key, value in config(name)["fp8_config"].items()}


def launcher_env(path: str) -> dict[str, str]:
    """What `accelerate launch --config_file PATH` exports as ACCELERATE_FP8_*, computed by accelerate's own code
    (its argument parser, the config-file merge and setup_fp8_env), without starting the script: the config's
    fp8_config keys and the launcher's own defaults for every FP8 flag the config leaves out."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import setup_fp8_env

    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    args, _, _ = _validate_launch_command(args)
    return setup_fp8_env(args, {})


def clean_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def test_train_llama_takes_its_recipe_from_the_config_file_and_saves_a_plain_model(tmp_path):
    env = clean_env(ACCELERATE_MIXED_PRECISION="fp8", **fp8_env("single_gpu.yaml"))
    cmd = [sys.executable, os.path.join(EXAMPLES, "train_llama.py"), "--steps", "12", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "backend torchao (TorchAO float8), recipe 'tensorwise'" in out and "memory level O2" in out
    assert "held-out loss" in out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0]
    from safetensors.torch import load_file

    from lowprec.demo.model import PRESETS, build_model

    plain = build_model(PRESETS["tiny"])
    state = load_file(str(tmp_path / "model.safetensors"))
    plain.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)  # lm_head may be tied
    missing = set(plain.state_dict()) - set(state)
    assert missing <= {"lm_head.weight"}, missing
    assert all(v.dtype in (torch.float32, torch.float16) for v in state.values())


@pytest.mark.slow
def test_train_llama_under_ddp_on_two_cpu_processes():
    from conftest import free_port, run_processes

    env = clean_env(ACCELERATE_USE_CPU="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(EXAMPLES, "train_llama.py"), "--backend", "torchao", "--opt-level", "O1", "--steps", "10"]
    proc = run_processes(cmd, env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "where:     ddp x2" in proc.stdout and "memory level O1" in proc.stdout
    assert proc.stdout.count("held-out loss") == 1  # printed by the main process only


@pytest.mark.parametrize("name", CONFIGS)
def test_each_config_is_a_recipe_its_engine_accepts(name, monkeypatch):
    from support_matrix_cells import _te_available

    from lowprec import FP8RecipeKwargs
    from lowprec.backends import RunContext, create_backend
    from lowprec.planning.hardware import assumed_device

    cfg = config(name)
    assert cfg["mixed_precision"] == "fp8"
    engine = ENGINE_OF[cfg["distributed_type"]]
    if engine == "fsdp2":
        assert cfg["fsdp_config"]["fsdp_version"] == 2
    for key, value in fp8_env(name).items():
        monkeypatch.setenv(key, value)
    recipe = FP8RecipeKwargs()  # every field from the environment, as in train_llama.py
    assert recipe.backend == cfg["fp8_config"]["backend"]
    with _te_available():
        backend = create_backend(recipe, RunContext(device=assumed_device("9.0"), engine=engine,
                                                    world_size=cfg["num_processes"]))
    if engine == "deepspeed":  # what Accelerate's plugin builds from the config (BF16 for mixed_precision fp8)
        ds = {"zero_optimization": {"stage": cfg["deepspeed_config"]["zero_stage"]}, "bf16": {"enabled": True}}
        assert backend.engine_config_problem(ds) is None


def test_trainer_example_trains_in_fp8_through_fp8_trainer(tmp_path):
    cmd = [sys.executable, os.path.join(EXAMPLES, "trainer.py"), "--backend", "torchao", "--steps", "10",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend torchao (TorchAO float8)" in proc.stdout and "in FP8" in proc.stdout
    assert "held-out loss" in proc.stdout


# ---- the shipped configs run warning-free: launcher defaults are no choice of the user's (issue 31) ---------
def _fp8_modules():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))


@pytest.mark.parametrize("name", CONFIGS)
def test_each_config_as_launched_warns_nothing_and_applies_what_it_writes(name, monkeypatch):
    import warnings

    from support_matrix_cells import _te_available

    from lowprec import FP8RecipeKwargs, RunContext, build_plan
    from lowprec.planning.hardware import assumed_device

    cfg = config(name)
    exported = launcher_env(os.path.join(EXAMPLES, "configs", name))
    assert exported["ACCELERATE_FP8_OPT_LEVEL"] in ("O2", "O3")  # the launcher's own defaults are among them
    for key, value in exported.items():
        monkeypatch.setenv(key, value)
    engine = ENGINE_OF[cfg["distributed_type"]]
    with warnings.catch_warnings(record=True) as record, _te_available():
        warnings.simplefilter("always")
        recipe = FP8RecipeKwargs()
        plan = build_plan(_fp8_modules(), recipe, context=RunContext(device=assumed_device("9.0"), engine=engine,
                                                                     world_size=cfg["num_processes"]))
    assert not [str(w.message) for w in record if "lowprec" in str(w.message) or "ACCELERATE_FP8" in str(w.message)]
    for key, value in cfg["fp8_config"].items():  # every key the config writes is applied
        field = key.removeprefix("lowprec_")
        assert getattr(recipe, field) == FP8RecipeKwargs._parse(field, str(value)), key
    assert plan.backend == cfg["fp8_config"]["backend"]


def test_single_gpu_config_as_launched_prepares_with_no_warning_but_emulation(monkeypatch, fresh_accelerate_state):
    import warnings

    from lowprec import Accelerator

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    for key, value in launcher_env(os.path.join(EXAMPLES, "configs", "single_gpu.yaml")).items():
        monkeypatch.setenv(key, value)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        accelerator = Accelerator(cpu=True)
        model = _fp8_modules()
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    lowprec_warnings = {str(w.message) for w in record if "lowprec" in str(w.message)}
    # this CPU's, once per process (an earlier test may have had it); none on an FP8 GPU
    assert lowprec_warnings <= {"lowprec: torchao runs emulated: CPU has no FP8 tensor cores. FP8 numerics are exact, "
                                "matmuls run in high precision, no speed-up"}
    assert accelerator.precision_plan.opt_level == "O2"


def test_a_value_other_than_the_launchers_default_is_the_users_and_applied(tmp_path, monkeypatch):
    # `pad_inner_dim: true` reaches the script as "True", the launcher's own default as "1": only the user wrote
    # "True". `opt_level: O2` and `margin: 0` reach it exactly as the launcher's defaults do: neither applied nor
    # warned about; the plan's notes name the one that would have changed the run.
    import warnings

    from lowprec import FP8RecipeKwargs, RunContext, build_plan
    from lowprec.planning.hardware import assumed_device

    path = tmp_path / "fp8.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\n"
                    "mixed_precision: fp8\nfp8_config:\n  backend: torchao\n  pad_inner_dim: true\n"
                    "  opt_level: O2\n  margin: 0\n")
    exported = launcher_env(str(path))
    assert (exported["ACCELERATE_FP8_PAD_INNER_DIM"], exported["ACCELERATE_FP8_OPT_LEVEL"]) == ("True", "O2")
    for key, value in exported.items():
        monkeypatch.setenv(key, value)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        recipe = FP8RecipeKwargs()
        plan = build_plan(_fp8_modules(), recipe, context=RunContext(device=assumed_device("9.0")))
    assert not [w for w in record if "lowprec" in str(w.message)]
    assert recipe.pad_inner_dim is True and recipe.opt_level is None and recipe.margin is None
    note = next(n for n in plan.notes if n.startswith("accelerate launch exported its own defaults"))
    assert "ACCELERATE_FP8_OPT_LEVEL=O2 (in force: None)" in note and "PAD_INNER_DIM" not in note


@pytest.mark.slow
def test_ddp_config_on_a_cpu_host_warns_that_its_processes_train_apart(tmp_path):
    # The real condition (accelerate 1.15): torchrun starts 2 processes, each Accelerate state finds no GPU and
    # runs alone (distributed_type NO, num_processes 1, both main). Rank 0 warns, once.
    script = tmp_path / "show.py"
    # one write per process: two processes share the pipe, and print() writes its pieces one by one
    script.write_text("import sys\nfrom lowprec import Accelerator\na = Accelerator()\n"
                      "sys.stdout.write(f'STATE {a.distributed_type.value} {a.num_processes}\\n')\n")
    from conftest import free_port, run_processes

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(EXAMPLES, "configs", "ddp.yaml"), "--main_process_port", str(free_port()), str(script)]
    proc = run_processes(cmd, clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("STATE NO 1") == 2
    assert proc.stderr.count("lowprec: the launcher started 2 processes (WORLD_SIZE=2)") == 1
    assert "ACCELERATE_USE_CPU=1 accelerate launch" in proc.stderr
    assert "ACCELERATE_FP8_" not in proc.stderr  # no launcher default reported as a dropped choice

    fixed = run_processes(cmd, clean_env(ACCELERATE_USE_CPU="1"))
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert fixed.stdout.count("STATE MULTI_CPU 2") == 2 and "the launcher started" not in fixed.stderr
