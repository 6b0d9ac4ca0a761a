"""The migration page's rows for NeMo's and Megatron-Bridge's mixed-precision knobs and Axolotl's FP8 options
(the rows' shape and the other tools are in `migration_knobs`)."""

from __future__ import annotations

from .migration_knobs import Knob, Section

N1, N2, MB = "NeMo 1", "NeMo 2", "Megatron-Bridge"
_TE_CURRENT = {"backend": "te", "recipe": "current"}
_DELAYED_ONLY = "delayed scaling only (with another recipe any value is a `ValueError`)"

MEGATRON = Section(
    "NeMo and Megatron-Bridge",
    """
    NeMo 2's `MegatronMixedPrecision(...)` plugin, Megatron-Bridge's `MixedPrecisionConfig`, and NeMo 1's model
    config (`model.fp8: True`, ...) drive TransformerEngine inside Megatron; with lowprec they become
    `FP8RecipeKwargs(backend='te', ...)` passed to `lowprec.Accelerator(mixed_precision='fp8', kwargs_handlers=[...])`.
    Their defaults differ from lowprec's in places, which the notes say.
    """,
    "knob",
    (
        Knob('fp8="hybrid"', ("fp8",), where=(N2, MB), example={"backend": "te", "fp8_format": "HYBRID"},
             note="FP8 on, E4M3 forward and E5M2 gradients"),
        Knob('fp8="e4m3"', ("fp8",), where=(N2, MB), example={"backend": "te", "fp8_format": "E4M3"}),
        Knob("fp8=None", ("fp8",), where=(N2, MB), lowprec="no `FP8RecipeKwargs`: `mixed_precision='bf16'`"),
        Knob("transformer_engine=True, fp8=True, fp8_hybrid=True", ("transformer_engine", "fp8", "fp8_hybrid"),
             where=(N1,), example={"backend": "te", "fp8_format": "HYBRID"}),
        Knob("fp8_e4m3=True", ("fp8_e4m3",), where=(N1,), example={"backend": "te", "fp8_format": "E4M3"}),
        Knob('fp8_recipe="delayed"', ("fp8_recipe",), where=(N2, MB), example={"backend": "te", "recipe": "delayed"},
             note="NeMo 2's default; lowprec's TE default too"),
        Knob('fp8_recipe="tensorwise"', ("fp8_recipe",), where=(N2, MB),
             example={"backend": "te", "recipe": "tensorwise"},
             note="an alias of `current` (TE's `Float8CurrentScaling`), which the plan's first note names; "
                  "Megatron-Bridge's default. Name `backend='te'`: under `backend='auto'` the name also fits torchao's "
                  "`tensorwise`, and auto may pick torchao"),
        Knob('fp8_recipe="blockwise"', ("fp8_recipe",), where=(N2, MB),
             example={"backend": "te", "recipe": "blockwise"},
             note="an alias of `block` (TE's `Float8BlockScaling`): E4M3 only here, sm_90 and newer"),
        Knob('fp8_recipe="mxfp8"', ("fp8_recipe",), where=(N2, MB), example={"backend": "te", "recipe": "mxfp8"},
             note="Blackwell data-centre GPUs"),
        Knob("fp8_margin=1", ("fp8_margin",), where=(N1, N2, MB),
             example={"backend": "te", "recipe": "delayed", "margin": 1},
             note="0 to 8; delayed scaling only (with another recipe a value other than 0 is a `ValueError`)"),
        Knob("fp8_amax_history_len=1", ("fp8_amax_history_len",), where=(N1, N2, MB),
             example={"backend": "te", "recipe": "delayed", "amax_history_len": 1},
             note=f"{_DELAYED_ONLY}. NeMo 2's and Megatron-Bridge's default is 1, lowprec's (TE's) 1024: write it to "
                  "keep theirs"),
        Knob('fp8_amax_compute_algo="most_recent"', ("fp8_amax_compute_algo",), where=(N1, N2, MB),
             example={"backend": "te", "recipe": "delayed", "amax_compute_algo": "most_recent"},
             note=f"{_DELAYED_ONLY}. NeMo 2's and Megatron-Bridge's default; lowprec's (TE's) is 'max'"),
        Knob("fp8_interval=2", ("fp8_interval",), where=(N1, N2), removed="interval",
             note="(older NeMo 2 releases had it)"),
        Knob("reduce_amax=False", ("reduce_amax",), where=(N1,),
             example={"backend": "te", "recipe": "delayed", "reduce_amax": False}, note="on by default, as in NeMo",
             meanwhile="lowprec's TE delayed scaling always reduces amax across the data-parallel ranks (NeMo's "
                       "default, `reduce_amax=True`)"),
        Knob("fp8_wgrad=False", ("fp8_wgrad",), where=(N2, MB),
             example={"backend": "torchao", "recipe": "rowwise_with_gw_hp"},
             not_offered="TE runs the weight-gradient GEMM of every converted layer in FP8, as their default "
                         "`fp8_wgrad=True` does",
             note="(torchao's recipe with that GEMM in high precision)"),
        Knob("fp8_dot_product_attention=True, fp8_multi_head_attention=True",
             ("fp8_dot_product_attention", "fp8_multi_head_attention"), where=(N2, MB),
             not_offered="lowprec converts Linear and norm layers; attention runs as the model computes it"),
        Knob("fp8_param_gather=True", ("fp8_param_gather", "fp8_param", "fp8_params"), where=(N2, MB),
             example={"backend": "te", "fp8_weights": True},
             not_offered="it is Megatron's distributed optimizer keeping FP8 weights and all-gathering them in FP8",
             note="(FP8-only weights with FP32 masters in TE's FusedAdam, which replaces Adam/AdamW; one process, "
                  "DDP, and FSDP2 with `recipe='delayed'` or `'current'`, where FSDP2 all-gathers the FP8 weights: "
                  "[backends/te.md](backends/te.md#fp8-weights-under-fsdp2)). Also spelled `fp8_param` "
                  "(Megatron-Bridge) and `fp8_params` (NeMo 2, deprecated); most of Megatron-Bridge's named recipes "
                  "set it, lowprec's do not"),
        Knob("use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16",
             ("use_precision_aware_optimizer", "exp_avg_dtype", "exp_avg_sq_dtype"), where=(MB,),
             example={"backend": "te", "recipe": "current", "fp8_weights": True, "optimizer_states": "bf16"},
             note="Megatron-Bridge's `OptimizerConfig`, not `MixedPrecisionConfig`: Adam's moments in TE's FusedAdam. "
                  "`optimizer_states` takes the pair (exp_avg, exp_avg_sq): `'bf16'`, `'fp16'`, `'fp8'` (Megatron's "
                  "`torch.uint8` + `torch.float16`), `('e4m3', 'bf16')`, ... With `fp8_weights=True` TE's FusedAdam "
                  "keeps them, as in Megatron (BF16 pairs not with `recipe='delayed'`, whose FP8-weight kernel takes "
                  "FP32 moments); otherwise lowprec's LowBitAdam(W), with power-of-two scales "
                  "([optimizer-states.md](optimizer-states.md))"),
        Knob("reuse_grad_buf_for_mxfp8_param_ag=True", ("reuse_grad_buf_for_mxfp8_param_ag",), where=(MB,),
             not_offered="a buffer reuse of Megatron's FP8 parameter all-gather under MXFP8, which lowprec does not "
                         "have (above)"),
        Knob("first_last_layers_bf16=True", ("first_last_layers_bf16",), where=(N2, MB),
             example={**_TE_CURRENT, "skip_first_blocks": 1, "skip_last_blocks": 1},
             note="no switch of its own: blocks are kept whenever `skip_first_blocks` / `skip_last_blocks` are above "
                  "0. Not `skip_first_last`, which keeps the first and last Linear layers"),
        Knob("num_layers_at_start_in_bf16=2", ("num_layers_at_start_in_bf16",), where=(N2, MB),
             example={**_TE_CURRENT, "skip_first_blocks": 2},
             note="every converted module of those transformer blocks stays in high precision. The blocks are the "
                  "model's largest `nn.ModuleList` of one class ([recipe.md](recipe.md#module-selection)); a model "
                  "without one is an error at `prepare()`"),
        Knob("num_layers_at_end_in_bf16=2", ("num_layers_at_end_in_bf16",), where=(N2, MB),
             example={**_TE_CURRENT, "skip_last_blocks": 2}),
        Knob('mixed_precision="bf16_with_fp8_current_scaling_mixed"', ("mixed_precision",), where=(MB,),
             example={"name": "bf16_with_fp8_current_scaling_mixed"},
             note="a named recipe: the table below lists Megatron-Bridge's names (and NeMo 2's `bf16_with_fp8_mixed`)"),
        Knob('bf16=True, precision="bf16-mixed"', ("bf16", "precision"), where=(N2, MB),
             lowprec="`mixed_precision='fp8'`",
             note="`lowprec.Accelerator` runs everything outside the FP8 GEMMs in BF16 autocast"),
        Knob('fp16=True, precision="16-mixed"', ("fp16", "precision"), where=(N2, MB),
             not_offered="lowprec runs what is not FP8 in BF16: `lowprec.Accelerator` refuses "
                         "`mixed_precision='fp16'` with an FP8 recipe"),
        Knob("loss_scale, initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis",
             ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
              "fp16_loss_scale", "fp16_initial_loss_scale", "fp16_min_loss_scale", "fp16_loss_scale_window",
              "fp16_hysteresis"), where=(N2, MB),
             not_offered="FP16 loss scaling, which BF16 does not need", note="(NeMo 2 spells them `fp16_*`)"),
        Knob('fp32=True, precision="32"', ("fp32", "precision"), where=(N2, MB),
             lowprec="no `FP8RecipeKwargs`: `mixed_precision='no'`"),
        Knob("params_dtype", ("params_dtype",), where=(N2, MB),
             lowprec="the model's own dtype, as you load it", note="lowprec converts the model it is given"),
        Knob("autocast_dtype, autocast_enabled", ("autocast_dtype", "autocast_enabled"), where=(N2, MB),
             lowprec="Accelerate's `mixed_precision`", note="with 'fp8', BF16 autocast outside the FP8 GEMMs"),
        Knob("pipeline_dtype", ("pipeline_dtype",), where=(N2, MB),
             not_offered="pipeline stages are Megatron's; lowprec runs under Accelerate's engines (one process, DDP, "
                         "FSDP, DeepSpeed)"),
        Knob("grad_reduce_in_fp32=True", ("grad_reduce_in_fp32",), where=(N2, MB),
             example={"backend": "te", "grad_comm_dtype": "fp32"},
             note="their default; unset, lowprec leaves each engine its own (Accelerate's FSDP2 reduces in BF16 in "
                  "FP8 runs): [communication.md](communication.md)"),
        Knob('fp4="e2m1", fp4_recipe="nvfp4"', ("fp4", "fp4_recipe", "fp4_param", "fp4_param_gather"), where=(MB,),
             not_offered="FP4: no backend here has an FP4 recipe"),
    ),
    where_header="in",
    known={
        N1: ("transformer_engine", "fp8", "fp8_e4m3", "fp8_hybrid", "fp8_margin", "fp8_interval",
             "fp8_amax_history_len", "fp8_amax_compute_algo", "reduce_amax"),
        N2: ("precision", "params_dtype", "pipeline_dtype", "autocast_dtype", "autocast_enabled",
             "grad_reduce_in_fp32", "fp8", "fp8_recipe", "first_last_layers_bf16", "fp8_margin",
             "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "fp8_dot_product_attention",
             "fp8_multi_head_attention", "fp8_params", "fp8_param_gather", "fp16_loss_scale",
             "fp16_initial_loss_scale", "fp16_min_loss_scale", "fp16_loss_scale_window", "fp16_hysteresis",
             "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"),
        MB: ("fp32", "fp16", "bf16", "params_dtype", "pipeline_dtype", "autocast_dtype", "autocast_enabled",
             "grad_reduce_in_fp32", "fp8", "fp8_recipe", "first_last_layers_bf16", "fp8_margin",
             "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "fp8_dot_product_attention",
             "fp8_multi_head_attention", "fp8_param", "fp8_param_gather", "fp4", "fp4_recipe", "fp4_param",
             "fp4_param_gather", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
             "hysteresis", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
             "reuse_grad_buf_for_mxfp8_param_ag"),
    },
    after="""
    ### Named recipes

    Megatron-Bridge's recipe names (`mixed_precision="..."`, with `_` or `-`) and NeMo 2's are
    `FP8RecipeKwargs(name=...)`, `fp8_config: {name: ...}` or `ACCELERATE_FP8_RECIPE_NAME`; every field you set wins
    over the name's ([recipe.md](recipe.md#named-recipes)). They set TE as Megatron runs it, except
    `fp8_param_gather` (above) and `fp8='hybrid'` for the block recipes (TE's block scaling runs E4M3 here).
    """,
    named_recipes=True,
)

AXOLOTL = Section(
    "Axolotl",
    """
    Axolotl's FP8 options hand Accelerate a torchao `AORecipeKwargs` inside transformers' `Trainer`. lowprec has no
    Axolotl integration; under `Trainer`, `lowprec.integrations.trainer.FP8Trainer(fp8_recipe=FP8RecipeKwargs(...))`
    trains with `lowprec.Accelerator`.
    """,
    "Axolotl YAML",
    (
        Knob("fp8: true", ("fp8",), example={"backend": "torchao", "recipe": "tensorwise", "skip_first_last": True},
             note="Axolotl passes torchao's default (tensorwise) config and no module filter, so Accelerate keeps the "
                  "first and last Linear layers in BF16: `skip_first_last=True` keeps that"),
        Knob("fp8_enable_fsdp_float8_all_gather: true", ("fp8_enable_fsdp_float8_all_gather",),
             example={"backend": "torchao", "recipe": "tensorwise", "enable_fsdp_float8_all_gather": True},
             note="FSDP2. Axolotl's default is false, lowprec's (None) on wherever it applies: write False to keep "
                  "Axolotl's. The handler Axolotl builds with it (a `Float8LinearConfig` with "
                  "`force_recompute_fp8_weight_in_bwd=True`) is none of torchao's named recipes, and lowprec's "
                  "translation refuses it: write the `FP8RecipeKwargs`"),
        Knob("torch_compile: true", ("torch_compile",), fields=("compile_fp8_layers",),
             lowprec="Accelerate's, not a recipe field: `TrainingArguments(torch_compile=True)` under `FP8Trainer` "
                     "(the Trainer hands Accelerate a `TorchDynamoPlugin`), `Accelerator(dynamo_backend='inductor')`, "
                     "or `accelerate launch --dynamo_backend inductor`",
             note="lowprec plans for the compiled model (`backend='auto'` tries torchao first; te's `delayed` is "
                  "refused under compile). Without it, `compile_fp8_layers` compiles each FP8 layer on its own where "
                  "measured to pay ([performance.md](performance.md))"),
        Knob("bf16: auto", ("bf16",), lowprec="nothing to write",
             note="with `mixed_precision='fp8'`, `lowprec.Accelerator` runs everything outside the FP8 GEMMs in BF16 "
                  "autocast, whatever `bf16` says; `FP8Trainer` refuses `fp16=True`"),
    ),
    known={"": ("fp8", "fp8_enable_fsdp_float8_all_gather", "torch_compile", "bf16")},
)
