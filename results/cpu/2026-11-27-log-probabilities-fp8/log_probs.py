"""A cross-entropy's gradient when the log-probabilities it saves are stored in FP8 (lowprec's 1x128-group E4M3, as
activation_dtype='fp8' stored them before 3422403) or in BF16, against the exact FP32 gradient and against BF16
logits (what BF16 training itself rounds). The softmax part of dlogits (the gradient less the one-hot term) and the
mean row sum of the probabilities backward used (1 when exact). 256 tokens, 32000 classes, logits N(0, std).

    python results/cpu/2026-11-27-log-probabilities-fp8/log_probs.py > log_probs.txt
"""
import torch
import torch.nn.functional as F

from lowprec.kernels.activations import pack_fp8, unpack_fp8

V, T = 32000, 256


def grads(logits, target, pack, unpack):
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = F.cross_entropy(logits, target)
    return torch.autograd.grad(loss, logits)[0]


def fp8_pack(t):
    return pack_fp8(t, None) if t.dim() == 2 and t.is_floating_point() else t


def fp8_unpack(p):
    return p if isinstance(p, torch.Tensor) else unpack_fp8(p)


def bf16_pack(t):
    return ("bf16", t.bfloat16()) if t.dim() == 2 and t.dtype == torch.float32 else t


def bf16_unpack(p):
    return p[1].float() if isinstance(p, tuple) else p


torch.manual_seed(0)
print("logit std | stored as | softmax part rel. error | probabilities' row sum")
for std in (1.0, 3.0, 6.0):
    logits = (torch.randn(T, V) * std).requires_grad_(True)
    target = torch.randint(0, V, (T,))
    exact = grads(logits, target, lambda t: t, lambda t: t)
    onehot = F.one_hot(target, V).float() / T
    bf16_logits = logits.detach().bfloat16().float().requires_grad_(True)
    runs = {"FP8 log-probs": grads(logits, target, fp8_pack, fp8_unpack),
            "BF16 log-probs": grads(logits, target, bf16_pack, bf16_unpack),
            "BF16 logits": grads(bf16_logits, target, lambda t: t, lambda t: t)}
    for name, g in runs.items():
        p, p_exact = g + onehot, exact + onehot
        error = ((p - p_exact).norm() / p_exact.norm()).item()
        print(f"{std} | {name} | {error:.4f} | {(p.sum(1) * T).mean().item():.4f}")
