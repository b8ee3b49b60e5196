"""How template-like is a demo's reasoning? `python docs/template_probe.py runs/demo-s0-<hash>` (from the repo root).

For the warm start and the demo's three final models: one first-turn reasoning on each of 128 held-out maps, at
T = 0.5 and T = 1, counted as: one of the expert's input-free sentences (envs.GENERIC_THINKS, there when the demo
ran with `generic_think` in --env-args), containing a 3-word run of one of them, or fact-shaped ("P r c G r c ...").
A probe for README's stretch-goal paragraph, not part of the package.
"""
import copy, json, os, sys

import torch

sys.path.insert(0, os.getcwd())
import envs
import ragen_mini as rm

folder = sys.argv[1]
cfg = rm.Config(**json.load(open(os.path.join(folder, "a_no_filter", "config.json"))))
start, tok = rm.load_policy(cfg, torch.device("cpu"))
models = {"warm start": start}
for run in ("a_no_filter", "b_snr_filter", "c_control"):
    models[run] = copy.deepcopy(start)
    models[run].load_state_dict(torch.load(os.path.join(folder, run, "ckpt.pt"), weights_only=False)["model"])
grams = {tuple(g.split()[i:i + 3]) for g in envs.GENERIC_THINKS for i in range(len(g.split()) - 2)}
for name, model in models.items():
    cells = []
    for T in (0.5, 1.0):
        torch.manual_seed(0)
        thinks = [e["first_think"].strip() for e in rm.rollout(model, tok, cfg, [10**6 + i for i in range(128)], 1, T)]
        exact = sum(t in envs.GENERIC_THINKS for t in thinks)
        run3 = sum(any(tuple(w[i:i + 3]) in grams for i in range(len(w) - 2)) for w in map(str.split, thinks))
        facts = sum(t.startswith("P ") and " G " in t for t in thinks)
        cells.append(f"T={T}: generic sentence {exact}, 3-word run of one {run3}, fact-shaped {facts} (of 128)")
        if T == 0.5 and name == "a_no_filter":
            samples = thinks[:8]
    print(f"{name:>12}: " + " | ".join(cells))
print("run (a), the first 8 maps at T = 0.5:")
for t in samples:
    print("   ", "".join(c if c.isprintable() else "?" for c in t)[:100])
