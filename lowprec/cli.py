"""`lowprec plan | env | demo | bench`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from torch import nn


def _set_value(text: str):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_model_for_plan(model: str | None, config: str | None, overrides: dict) -> tuple[nn.Module, str]:
    """A model on the meta device (shapes only, no memory, nothing downloaded) and its description."""
    import torch

    from .demo.model import PRESETS, build_model, llama_skeleton
    from .utils.imports import is_available, require

    if config is None:
        name = model or "proxy"
        if name not in PRESETS:
            raise SystemExit(f"lowprec plan: --model {name!r} is not one of {', '.join(sorted(PRESETS))}")
        if overrides:
            raise SystemExit("lowprec plan: --set applies to --config models only")
        description = f"built-in Llama-style '{name}' ({PRESETS[name].note})"
        with torch.device("meta"):
            if is_available("transformers"):
                return build_model(PRESETS[name]), description
            # the plan reads names, kinds and shapes only: the quickstart's install has no transformers
            return llama_skeleton(PRESETS[name]), description + "; its layers' shapes, built without transformers"
    if model is not None:
        raise SystemExit(f"lowprec plan: --model {model!r} and --config {config!r} both choose the model; give one")
    transformers = require("transformers", feature="lowprec plan --config")
    if os.path.exists(config):
        try:
            cfg = transformers.AutoConfig.from_pretrained(config, local_files_only=True, **overrides)
        except Exception as exc:  # noqa: BLE001 - unreadable JSON, a field transformers validates: said in one line
            raise SystemExit(f"lowprec plan: --config {config!r} could not be read as a transformers config"
                             f"{' with --set ' + str(overrides) if overrides else ''}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split()[:40])}") from None
    else:
        try:
            cfg = transformers.AutoConfig.for_model(config, **overrides)
        except Exception as exc:  # noqa: BLE001 - transformers' strict config validation raises its own types
            if config in transformers.CONFIG_MAPPING:  # a known type: the --set values were refused
                raise SystemExit(f"lowprec plan: --set {overrides} is not a valid {config!r} config: "
                                 f"{type(exc).__name__}: {' '.join(str(exc).split()[:40])}") from None
            # transformers' message lists all of its several hundred model types: name a few instead
            raise SystemExit(f"lowprec plan: --config {config!r} is neither a local config file/folder nor a "
                             "transformers model type (such as 'llama', 'mistral', 'qwen2', 'gpt2'; the full list "
                             "is transformers.CONFIG_MAPPING)") from None
    with torch.device("meta"):
        try:
            built = transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            built = transformers.AutoModel.from_config(cfg)
    params = sum(p.numel() for p in built.parameters())
    return built, f"{type(built).__name__} from config ({params / 1e6:,.1f}M parameters, random init on meta)"


def cmd_plan(args: argparse.Namespace) -> int:
    from .backends import RunContext, create_backend
    from .frontend.recipe import FP8RecipeKwargs
    from .planning.hardware import assumed_device, device_info
    from .runtime.planner import build_plan

    recipe = FP8RecipeKwargs(
        backend=args.backend,
        recipe=args.recipe,
        fp8_format=args.fp8_format,
        opt_level=args.opt_level,
        weight_dtype=args.weight_dtype,
        weight_grad_dtype=args.weight_grad_dtype,
        optimizer_states=args.optimizer_states,
        grad_comm_dtype=args.grad_comm_dtype,
        activation_dtype=args.activation_dtype,
        include=args.include,
        exclude=args.exclude,
        skip_first_last=args.skip_first_last,
        skip_first_blocks=args.skip_first_blocks,
        skip_last_blocks=args.skip_last_blocks,
        skip_slow_shapes=args.skip_slow_shapes,
        pad_inner_dim=args.pad_inner_dim,
        emulate=args.emulate,
        compile_fp8_layers=args.compile_fp8_layers,
        optimizer_in_backward=args.optimizer_in_backward,
        name=args.name,
    )
    model, description = build_model_for_plan(args.model, args.config, dict(args.set or []))
    device = device_info() if args.capability is None else assumed_device(args.capability)
    if args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size}: the number of processes, 1 or more")
    if args.engine == "single" and args.world_size != 1:
        raise ValueError(f"--world-size {args.world_size} with --engine single: one process trains alone; name the "
                         "engine that runs several (ddp, fsdp2, deepspeed, fsdp1)")
    if args.world_size >= 1 and not 1 <= args.hosts <= args.world_size:
        raise ValueError(f"--hosts {args.hosts}: the machines the --world-size {args.world_size} processes run on, "
                         f"from 1 to {args.world_size}")
    context = RunContext(device=device, engine=args.engine, world_size=args.world_size, hosts=args.hosts,
                         compiled=args.compile)
    backend = create_backend(recipe, context, require_package=False)
    plan = build_plan(model, backend.recipe, context=context, backend=backend)
    if args.json:
        print(json.dumps({"model": description, **plan.to_dict()}, indent=1))
    else:
        print(f"model: {description}")
        print(plan)
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from .frontend.named_recipes import describe, lookup, names

    shown = [lookup(n) for n in (args.names or names())]
    if args.json:
        print(json.dumps([{"name": r.name, "source": r.source, "summary": r.summary, "sets": r.fields()}
                          for r in shown], indent=1, default=str))
        return 0
    print("named recipes: FP8RecipeKwargs(name=...), ACCELERATE_FP8_RECIPE_NAME, or fp8_config: {name: ...}; "
          "fields you set win over the name's")
    for r in shown:
        print(f"\n{r.name}  [{r.source}]\n  {r.summary}\n  sets: {describe(r)}")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    import accelerate
    import torch

    from .backends import registered_backends
    from .planning.hardware import device_info
    from .utils.imports import OPTIONAL_PACKAGES, installed_version

    dev = device_info()
    print(f"lowprec {__import__('lowprec').__version__}, torch {torch.__version__}, "
          f"accelerate {accelerate.__version__}")
    print(f"device: {dev.describe()}; FP8 GEMMs: {'yes' if dev.fp8_gemm else 'no (backends that can will emulate)'}")
    for name in OPTIONAL_PACKAGES:
        print(f"  {name:<20} {installed_version(name) or 'not installed'}")
    print("backends:")
    for cls in registered_backends():
        ok, reason = cls.availability()
        status = "available" if ok else reason
        print(f"  {cls.name:<8} recipes {', '.join(cls.recipes)}: {status}")
    fp8_env = {k: v for k, v in sorted(os.environ.items())
               if k.startswith("ACCELERATE_FP8_") or k in ("ACCELERATE_MIXED_PRECISION", "LOWPREC_QUIET")}
    if fp8_env:
        print("environment:")
        for k, v in fp8_env.items():
            print(f"  {k}={v}")
    return 0


def cmd_demo(argv: list[str]) -> int:
    from .demo.compare import main as demo_main

    return demo_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from .demo.bench import main as bench_main

    return bench_main(argv)


def _bool_flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
    p.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction, default=None,
                   help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowprec", description="FP8 training for Hugging Face Accelerate")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the precision plan for a model (built on the meta device)")
    plan.add_argument("--backend", default=None,
                      help="auto, torchao, te, msamp (default: ACCELERATE_FP8_BACKEND or auto)")
    plan.add_argument("--recipe", default=None)
    plan.add_argument("--name", default=None, help="a named recipe (`lowprec recipes`); the options below win over it")
    plan.add_argument("--fp8-format", default=None, type=str.upper, choices=["HYBRID", "E4M3"])
    plan.add_argument("--opt-level", default=None,
                      help="O1, O2 or O3 (msamp under FSDP2 / DeepSpeed ZeRO-1/2): a preset of the storage knobs below")
    plan.add_argument("--weight-dtype", default=None, help="converted Linear weights: fp32, fp16, bf16")
    plan.add_argument("--weight-grad-dtype", default=None, help="their gradients: fp32, bf16, fp8")
    plan.add_argument("--optimizer-states", default=None, help="fp32, bf16, fp16, fp8, or a pair such as e4m3+fp16")
    plan.add_argument("--grad-comm-dtype", default=None, help="DDP gradient averaging: fp32, bf16, fp8")
    plan.add_argument("--activation-dtype", default=None, help="tensors saved for backward: fp8")
    plan.add_argument("--model", default=None, help="built-in model: tiny, small, proxy (default proxy)")
    plan.add_argument("--config", default=None,
                      help="a transformers config: local config.json / folder, or a model type such as 'llama'")
    plan.add_argument("--set", action="append", type=_set_value, metavar="KEY=VALUE",
                      help="override a config field, e.g. --set hidden_size=4096 (repeatable)")
    plan.add_argument("--capability", default=None,
                      help="plan for a GPU of this compute capability ('9.0' H100/H200, '8.9' L40S, 'cpu')")
    plan.add_argument("--engine", default="single", choices=["single", "ddp", "fsdp2", "deepspeed", "fsdp1"])
    plan.add_argument("--world-size", type=int, default=1)
    plan.add_argument("--hosts", type=int, default=1, help="the machines the --world-size processes run on")
    plan.add_argument("--include", default=None, help="comma-separated module-name patterns to convert")
    plan.add_argument("--exclude", default=None, help="comma-separated module-name patterns to keep")
    _bool_flag(plan, "skip-first-last", "keep the first and last Linear in high precision")
    plan.add_argument("--skip-first-blocks", default=None, metavar="N",
                      help="keep the first N transformer blocks whole in high precision")
    plan.add_argument("--skip-last-blocks", default=None, metavar="N",
                      help="keep the last N transformer blocks whole in high precision")
    _bool_flag(plan, "skip-slow-shapes", "keep Linear layers FP8 would slow down in high precision")
    _bool_flag(plan, "pad-inner-dim", "torchao: pad GEMM dims to multiples of 16")
    _bool_flag(plan, "emulate", "force (or forbid) emulation")
    plan.add_argument("--compile", action="store_true",
                      help="plan for a model compiled whole (dynamo_backend); default: an eager model")
    _bool_flag(plan, "compile-fp8-layers", "eager model: compile each FP8 layer on its own")
    _bool_flag(plan, "optimizer-in-backward", "step each parameter in backward as its gradient is ready (one process)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    recipes = sub.add_parser("recipes", help="the named recipes (FP8RecipeKwargs(name=...)) and what each sets")
    recipes.add_argument("names", nargs="*", help="only these (default: all)")
    recipes.add_argument("--json", action="store_true", help="print them as JSON")
    sub.add_parser("env", help="versions, backends available here, device, FP8 environment variables")
    sub.add_parser("demo", help="short BF16 then FP8 training through Accelerate, with a comparison table",
                   add_help=False)
    sub.add_parser("bench", help="BF16 and every FP8 configuration, each in its own process: speed, memory, "
                                 "loss; JSON, markdown and plots", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return cmd_demo(argv[1:])
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "recipes":
            return cmd_recipes(args)
        return cmd_env(args)
    except (ValueError, RuntimeError, ImportError) as exc:
        hint = ""
        if args.command == "plan" and args.capability is None and "cannot run here" in str(exc):
            hint = " (to plan for another machine, pass --capability, e.g. --capability 9.0 for H100/H200)"
        print(f"lowprec {args.command}: {exc}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
