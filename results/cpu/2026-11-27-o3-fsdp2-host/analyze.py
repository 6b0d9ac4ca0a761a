import json, sys, collections
d = json.load(open(sys.argv[1]))
N = int(sys.argv[2]) if len(sys.argv) > 2 else 40
print(d["info"])
ops = d["ops"]
def tab(filt):
    c = collections.Counter()
    for ph, op, w, k, n in ops:
        if filt(ph, op, w, k): c[ph] += n
    return dict(c), sum(c.values())
print("all ops", tab(lambda *a: True))
print("kernel ops", tab(lambda ph, op, w, k: k == "k"))
print("kernel ops issued in lowprec", tab(lambda ph, op, w, k: k == "k" and not w.startswith("[torch]")))
print("--- top kernel (phase, op, where)")
for ph, op, w, k, n in [o for o in ops if o[3] == "k"][:N]: print(f"{n:5d} {ph:15s} {op:34s} {w}")
print("--- kernel ops by where")
c = collections.Counter()
for ph, op, w, k, n in ops:
    if k == "k": c[(ph, w)] += n
for (ph, w), n in c.most_common(N): print(f"{n:5d} {ph:15s} {w}")
print("--- kernel ops by op name")
c = collections.Counter()
for ph, op, w, k, n in ops:
    if k == "k": c[op] += n
print(c.most_common(25))
print("--- collectives")
c = collections.Counter((x["phase"], x["op"], x["dtype"], x["where"]) for x in d["collectives"])
for k, n in sorted(c.items()): print(n, k)
print("--- compiled", d["compiled_calls"])
print("--- fused adam", d.get("fused_adam"))
print("--- c10d ops", [(o[0], o[1], o[4]) for o in ops if o[1].startswith(("c10d", "_c10d"))])
