"""Top functions of a cProfile dump (per step), filtered to lowprec/ and torch's subclass/FSDP2/DTensor machinery.
python analyze_prof.py X.prof NSTEPS [N]"""
import pstats, sys
st = pstats.Stats(sys.argv[1])
n = int(sys.argv[2]); N = int(sys.argv[3]) if len(sys.argv) > 3 else 20
KEYS = ("/lowprec/", "torch/distributed/tensor/", "torch/distributed/fsdp/", "torch/utils/_pytree", "torch/_ops.py",
        "torch/utils/_python_dispatch", "torch/autograd/function.py", "torch/optim/", "torch/_dynamo/eval_frame",
        "torch/distributed/distributed_c10d", "torch/nn/modules/module.py", "torch/_tensor.py")
rows = []
for (f, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
    short = f
    for k in KEYS:
        if k in f:
            short = k.strip("/") + ":" + f.split(k)[-1] if k != "/lowprec/" else "lowprec/" + f.split(k)[-1]
            break
    else:
        if not f.startswith("~"):
            continue
    rows.append((short, line, name, nc / n, tt * 1e3 / n, ct * 1e3 / n))
total = sum(r[4] for r in rows)
print(f"profiled ms/step (all functions, self): {sum(v[2] for v in st.stats.values())*1e3/n:.1f}")
def show(key, title, filt=lambda r: True):
    print(f"--- {title}")
    print(f"{'calls/step':>10} {'self ms':>8} {'cum ms':>8}  function")
    for r in sorted(filter(filt, rows), key=key, reverse=True)[:N]:
        print(f"{r[3]:10.0f} {r[4]:8.2f} {r[5]:8.2f}  {r[0]}:{r[1]}({r[2]})")
show(lambda r: r[5], "by cumulative, lowprec only", lambda r: r[0].startswith("lowprec/"))
show(lambda r: r[4], "by self, lowprec only", lambda r: r[0].startswith("lowprec/"))
show(lambda r: r[5], "by cumulative, torch machinery", lambda r: not r[0].startswith(("lowprec/", "~")))
show(lambda r: r[4], "by self, all incl. builtins")
