"""Is the KL gradient pushed harder where rewards spread? A probe for README's gradient-norm paragraph, not part of the
package. Run from the repo root:

    python docs/kl_bucket_probe.py SEED OUT      # train run (a) of `--demo --seed SEED --gradnorm-every 1` into OUT
    python docs/kl_bucket_probe.py --read LOG    # only the report, from any log with bucket readings

Training, it runs exactly what the demo's run (a) runs on a 2-core CPU (demo.SETUP, no filter, one torch thread,
bucket readings at every step with reward spread: every logged value of seeds 0-4 and 6 equals the demo's own
run with --gradnorm-every 1) and adds to each reading, per reward-variance bucket b, the bucket's mean k3 KL value
`klv_b{b}` (from the forward the KL gradient is taken from) and its agent-token count `ntok_b{b}`; training is
untouched. The report (see `report`) reads the norms within each step, since they grow several-fold over a run,
and at equal token counts: the norm of a token mean of n per-token gradients that add like noise falls like
1 / sqrt(n), and a bucket's token count depends on how soon its episodes end.
"""
import os, statistics, sys

import torch

sys.path.insert(0, os.getcwd())
import demo
import metrics
import ragen_mini as rm

seen = []  # (KL value, agent tokens) of each bucket's loss_terms call in the reading under way
_loss_terms, _grad_norms = rm.loss_terms, rm.grad_norms_by_bucket


def loss_terms(*args, **kw):
    t = _loss_terms(*args, **kw)
    seen.append((float(t["kl"].detach()), int(t["ntok"])))
    return t


def grad_norms_by_bucket(model, ref, seqs, returns, cfg, n_buckets=3):
    """rm.grad_norms_by_bucket, with loss_terms recording during it only (the update's calls stay as they are)."""
    seen.clear()
    rm.loss_terms = loss_terms
    try:
        log = _grad_norms(model, ref, seqs, returns, cfg, n_buckets)
    finally:
        rm.loss_terms = _loss_terms
    filled = [b for b, g in enumerate(metrics.variance_buckets(returns.var(1).tolist(), n_buckets)) if g]
    for b, (kl, n) in zip(filled, seen):  # it calls loss_terms once per non-empty bucket, in order
        log |= {f"klv_b{b}": kl, f"ntok_b{b}": n}
    return log


def report(log, title):
    """Per bucket: medians over the steps with spread (step 0 left out: no KL yet) of the KL gradient norm (also over
    the first and the second half of those steps apart) and of each bucket's share of its step's norm (3 norm_b / sum
    of the three: the step's own scale divided out); where the log has them, also of the KL value, the token count
    and the shares of norm x sqrt(tokens), without and with a division by the KL value."""
    rows = [r for r in rm.runfiles.read_log(log) if "gn_kl_b0" in r and r["rv_b2"] > 0 and min(r[f"gn_kl_b{b}"] for b in range(3)) > 0]
    med = lambda f, some=rows: [statistics.median(f(r, b) for r in some) for b in range(3)]
    share = lambda f: med(lambda r, b: 3 * f(r, b) / sum(f(r, c) for c in range(3)))
    norm = lambda r, b: r[f"gn_kl_b{b}"]
    half = len(rows) // 2
    lines = [("KL gradient norm", med(norm)), ("  over the first half", med(norm, rows[:half])),
             ("  over the second half", med(norm, rows[half:])), ("its share of the step's", share(norm))]
    if "klv_b0" in rows[0]:
        scaled = lambda r, b: norm(r, b) * r[f"ntok_b{b}"] ** 0.5
        lines += [("KL value (k3, token mean)", med(lambda r, b: r[f"klv_b{b}"])), ("agent tokens", med(lambda r, b: r[f"ntok_b{b}"])),
                  ("share: norm x sqrt(tokens)", share(scaled)), ("share: ... / KL value", share(lambda r, b: scaled(r, b) / r[f"klv_b{b}"]))]
    print(f"{title}: {len(rows)} readings; medians over steps, buckets low / mid / high reward variance")
    for name, v in lines:
        print(f"  {name:27s}" + "  ".join(f"{x:9.4g}" for x in v) + f"   max/min {max(v) / min(v):.2f}x")


if sys.argv[1] == "--read":  # a finished run's log, e.g. the demo's own run (a) with --gradnorm-every 1
    report(sys.argv[2], sys.argv[2])
    sys.exit()
seed, out = int(sys.argv[1]), sys.argv[2]
rm.grad_norms_by_bucket = grad_norms_by_bucket  # the loop looks it up at call time
torch.set_num_threads(max(1, torch.get_num_threads() // 2))  # as the demo's runs (one thread each on 2 cores): the same rounding
flags = demo.SETUP | dict(gradnorm_every=1, seed=seed, filter="none", out=os.path.dirname(out) or ".", name=os.path.basename(out))
rm.main([f"--{k.replace('_', '-')}={v}" for k, v in flags.items()])  # on a finished run: prints its result again
report(os.path.join(out, "log.jsonl"), f"seed {seed}")
