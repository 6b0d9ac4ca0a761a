"""Llama-style `transformers` models built from a config (random init, nothing downloaded)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..utils.imports import require
from .data import VOCAB_SIZE


@dataclass(frozen=True)
class ModelPreset:
    hidden: int
    layers: int
    heads: int
    ffn: int
    seq_len: int
    batch: int
    lr: float
    note: str


PRESETS: dict[str, ModelPreset] = {
    # Small enough for two CPU cores even where BF16 matmuls run in software (no AVX512-BF16,
    # ~100x slower than FP32); at this width FP8 would be slower than BF16 on a GPU too.
    "tiny": ModelPreset(128, 2, 4, 512, 128, 8, 2e-3, "CPU-sized: 0.5M parameters"),
    "small": ModelPreset(1024, 8, 16, 2816, 1024, 8, 6e-4, "FP8 does not pay at d=1024 (gpu-baselines.md)"),
    # The Llama-style proxy of ../shared/reference/gpu-baselines.md (byte vocabulary here).
    "proxy": ModelPreset(4096, 4, 32, 14336, 2048, 4, 1.5e-4, "d=4096 x 4 layers, ffn 14336, B4 T2048"),
}


# `transformers` decoder families built from the same preset (config class, model class).
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def default_size() -> str:
    """The proxy on an FP8 GPU (where FP8 can pay), the CPU-sized model elsewhere."""
    import torch

    fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return "proxy" if fp8_gpu else "tiny"


def llama_config(preset: ModelPreset, vocab_size: int = VOCAB_SIZE, arch: str = "llama"):
    transformers = require("transformers", feature="the demo model")
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {', '.join(ARCHS)}")
    return getattr(transformers, ARCHS[arch][0])(
        vocab_size=vocab_size,
        hidden_size=preset.hidden,
        intermediate_size=preset.ffn,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.heads,
        max_position_embeddings=max(preset.seq_len, 2048),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        # training and the held-out loss read no KV cache; with one, each compiled block guarded on whether the
        # cache's first layer was filled yet (two graphs a block: a recompile for each block after the first)
        use_cache=False,
    )


def build_model(preset: ModelPreset, arch: str = "llama", vocab_size: int = VOCAB_SIZE) -> nn.Module:
    transformers = require("transformers", feature="the demo model")
    return getattr(transformers, ARCHS[arch][1])(llama_config(preset, vocab_size, arch=arch))


class _RMSNorm(nn.RMSNorm):
    """Named as transformers names its norm, so a plan reads the same with or without transformers."""


_RMSNorm.__name__ = _RMSNorm.__qualname__ = "LlamaRMSNorm"


class _DecoderLayer(nn.Module):
    """Named as transformers names its block (the plan's saved-activations section names it)."""


_DecoderLayer.__name__ = _DecoderLayer.__qualname__ = "LlamaDecoderLayer"


def llama_skeleton(preset: ModelPreset, vocab_size: int = VOCAB_SIZE) -> nn.Module:
    """transformers' LlamaForCausalLM as `lowprec plan` sees it (the same module names, classes of the
    same kind and shapes), from torch alone: a plan of a built-in model needs no transformers. It has
    no forward; build it on the meta device."""

    def linear(n_in: int, n_out: int) -> nn.Linear:
        return nn.Linear(n_in, n_out, bias=False)

    d, ffn, eps = preset.hidden, preset.ffn, 1e-6
    layers = nn.ModuleList()
    for _ in range(preset.layers):
        layer = _DecoderLayer()
        layer.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, linear(d, d))
        layer.mlp = nn.Module()
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj = linear(d, ffn), linear(d, ffn), linear(ffn, d)
        layer.input_layernorm, layer.post_attention_layernorm = _RMSNorm(d, eps=eps), _RMSNorm(d, eps=eps)
        layers.append(layer)
    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Embedding(vocab_size, d)
    root.model.layers = layers
    root.model.norm = _RMSNorm(d, eps=eps)
    root.lm_head = linear(d, vocab_size)
    return root
