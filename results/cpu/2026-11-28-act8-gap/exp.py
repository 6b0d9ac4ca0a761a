import json, os, sys
import lowprec.demo.model as M
import lowprec.demo.run as R
from lowprec.demo.model import ModelPreset
M.PRESETS["tiny"] = ModelPreset(256, 2, 2, 768, 512, 4, 1.5e-3, "exp: head_dim 128, T 512")
R.PRESETS = M.PRESETS
mode = os.environ.get("EXP_MODE", "")
if mode:
    from lowprec.runtime import activations as A
    orig = A.ActivationStorage.__init__ if hasattr(A, "ActivationStorage") else None
    cls = [c for c in vars(A).values() if isinstance(c, type) and hasattr(c, "leave_alone")][0]
    init = cls.__init__
    def patched(self, model, *a, **k):
        init(self, model, *a, **k)
        for name, m in model.named_modules():
            kind = type(m).__name__
            if (mode == "attn" and kind.endswith("Attention")) or (mode == "mlp" and kind.endswith("MLP")) \
               or (mode == "norm" and kind.endswith("RMSNorm")):
                self.leave_alone(m)
    cls.__init__ = patched
tk = os.environ.get("EXP_TRACE_KEEP", "")
if tk:
    from lowprec.runtime import activations as A2
    orig_pt = A2.FP8ActivationStorage.pack_traced
    def pt(self, t):
        if (tk == "fp32" and t.dtype == __import__("torch").float32) or (tk == "4d" and t.dim() == 4) \
           or (tk == "ffn" and t.shape[-1] == 768):
            return t
        return orig_pt(self, t)
    A2.FP8ActivationStorage.pack_traced = pt
args = R.parse_args(sys.argv[1:])
r = R.run(args)
print("HELDOUT", r["heldout_loss"], r["fp8_activations"] and r["fp8_activations"].get("packed_tensors_per_forward"))
