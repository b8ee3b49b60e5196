"""Speed benchmark: `python ragen_mini.py --bench [any training flags]` (README "Performance").

Runs a few GRPO iterations with the given settings and prints, per iteration, where the time goes: rollout
(prefill and decode apart, tokens/s), environment, diagnostics, update; then the overhead ratio
    iteration time / pure model compute
where pure model compute is timed in the same run on the same work: Hugging Face `model.generate` for every turn
(same sequences, same context lengths, same number of new tokens) plus one plain forward+backward+AdamW step over
the same training batch, in the update's micro-batches (gradient accumulation). That plain step runs the full LM
head at every position, as a plain trainer does; the update's own kernels do less, so it also prints the update
against a plain NLL step on those kernels (the LM head on the agent's tokens only): what the GRPO terms and the code
around them cost. Also:
the update time with --filter none vs snr (or --filter's rule) on the same rollouts, and peak memory.
Run it alone: two CPU-heavy processes on 2 cores slow torch many times over.
"""
import copy, dataclasses, random, resource, statistics, sys, time

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

import envs
import ragen_mini as rm


class Clock:
    """Accumulates wall-clock time of model forwards (prefill vs one-token decode) and of env calls."""

    def __init__(self, model):
        self.t = dict(prefill=0.0, decode=0.0, env=0.0, prefill_tok=0, decode_tok=0)
        self.on, self.depth = False, 0
        model.register_forward_pre_hook(self.pre, with_kwargs=True)
        model.register_forward_hook(self.post, with_kwargs=True)
        envs.step_reply = self.timed(envs.step_reply)  # environment time: every step of every episode, and building,
        rm.make_env = self.timed_env(rm.make_env)  # resetting and rendering the envs (a one-shot command: patched for good)

    def timed(self, fn):
        def wrapper(*a, **k):
            if self.depth:  # inside another timed env call (step renders): counted there
                return fn(*a, **k)
            self.depth, t0 = 1, time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.depth, self.t["env"] = 0, self.t["env"] + time.perf_counter() - t0
        return wrapper

    def timed_env(self, make_env):
        make_env = self.timed(make_env)
        def build(*a, **k):
            env = make_env(*a, **k)
            env.reset, env.render = self.timed(env.reset), self.timed(env.render)
            return env
        return build

    def pre(self, module, args, kwargs):
        sync()
        self.t0 = time.perf_counter()

    def post(self, module, args, kwargs, out):
        if not self.on:
            return
        sync()
        ids = kwargs["input_ids"]
        kind = "prefill" if ids.shape[1] > 1 else "decode"
        self.t[kind] += time.perf_counter() - self.t0
        self.t[kind + "_tok"] += int(kwargs["attention_mask"][:, -ids.shape[1]:].sum()) if "attention_mask" in kwargs else ids.numel()


def sync():  # a GPU runs its kernels queued: wait for them before reading the clock
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elif torch.backends.mps.is_available():
        torch.mps.synchronize()


def peak_memory(device):
    """Peak so far, GB: what torch allocated on the GPU, or the process's resident set elsewhere (on a Mac's mps
    too: its GPU memory is not counted)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)  # bytes on macOS


def turns_of(e):
    """(context length, generated length) of each agent turn, read back from the episode's role mask."""
    out, m = [], e["mask"]
    for i in range(len(m)):
        if m[i] and (i == 0 or not m[i - 1]):
            n = next((j for j in range(i, len(m)) if not m[j]), len(m)) - i
            out.append((i, n))
    return out


@rm.amp  # in bf16 on a GPU, as the loop's own generation runs
@torch.no_grad()
def hf_generate_time(model, tok, eps, temperature):
    """Pure generation cost: `model.generate` per turn, same contexts and same number of new tokens, sampling at the
    loop's temperature and nothing else (none of a hub model's own generation settings: a repetition penalty, top-p)."""
    model.eval()  # as the rollout runs
    total, by_turn, eos = 0.0, {}, model.generation_config.eos_token_id
    for e in eps:
        for k, (start, n) in enumerate(turns_of(e)):
            by_turn.setdefault(k, []).append((e["ids"][:start], n))
    for k, items in sorted(by_turn.items()):
        ctx, n = [c for c, _ in items], max(n for _, n in items)
        T = max(len(c) for c in ctx)
        ids = torch.tensor([[tok.pad_token_id] * (T - len(c)) + c for c in ctx], device=model.device)
        attn = torch.tensor([[0] * (T - len(c)) + [1] * len(c) for c in ctx], device=model.device)
        own, model.generation_config = model.generation_config, GenerationConfig(eos_token_id=eos)  # generate() fills
        try:  # what a config leaves unset from the model's own: a fresh one, so only these settings act
            sync(); t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                           temperature=temperature, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
            sync(); total += time.perf_counter() - t0
        finally:
            model.generation_config = own
    return total


@rm.amp  # in bf16 on a GPU, as the loop's own update runs
def plain_step_time(model, seqs, cfg, own_kernels=False):
    """Pure training cost: --ppo-epochs forward+backward+AdamW steps over the same episodes, next-token NLL on the
    agent's tokens, in the update's micro-batches (length-sorted, --micro-batch at a time: gradient accumulation), the
    batches padded before the clock starts. By default what a plain trainer runs on them: the model's forward with
    its attention mask, the full LM head at every position. own_kernels: the update's own kernels instead (the LM
    head on the agent's tokens only), so update / this = the cost of the GRPO terms (clipped ratio, full-softmax
    entropy, KL's reference forward) and of the code around them."""
    model = copy.deepcopy(model).eval()  # dropout off, as update() runs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batches = [rm.pad_right([seqs[j][:2] for j in idx], 0, model.device) for idx in rm.micro_batches(seqs, cfg.micro_batch)]
    total = sum(sum(s[1]) for s in seqs)  # (update()'s micro-batches, padded before the clock starts)
    sync(); t0 = time.perf_counter()
    for _ in range(cfg.ppo_epochs):  # the update makes --ppo-epochs optimizer steps on its batch
        opt.zero_grad()
        for ids, attn, mask in batches:
            if own_kernels:
                sel = mask[:, 1:].bool()
                nll = -rm.agent_logprobs(model, ids, sel, 1.0).gather(-1, ids[:, 1:][sel][:, None]).sum()
            else:
                logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
                nll = (F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none") * mask[:, 1:]).sum()
            (nll / max(total, 1)).backward()
        opt.step()
    sync()
    return time.perf_counter() - t0


def main(cfg, iters=4):
    cfg = dataclasses.replace(cfg, bench=False)
    device = rm.pick_device(cfg.device)
    model, tok = rm.load_policy(cfg, device)
    clock, ema = Clock(model), rm.metrics.ZScoreEMA()
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None  # as train() keeps it
    P, G = cfg.groups, cfg.group_size
    print(f"bench: {cfg.model} on {device}, {P} groups x {G}, env {cfg.env}, max_turns {cfg.max_turns or 'env default'}, "
          f"diagnostics every {cfg.diag_every} steps (amortised), {torch.get_num_threads()} threads")
    rows, peak_loop, peak_all = [], 0.0, 0.0
    for it in range(iters + 1):  # iteration 0 warms up allocators and caches; not reported
        torch.manual_seed(cfg.seed * 10**6 + it)  # seed 0: the figures of earlier code
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        clock.t = dict.fromkeys(clock.t, 0)
        clock.on = True
        t0 = time.perf_counter()
        model.eval()
        eps = rm.rollout(model, tok, cfg, [cfg.seed * 10**6 + it * 1000 + g for g in range(P)], G, cfg.temperature)
        t_roll = time.perf_counter() - t0
        R = torch.tensor([e["ret"] for e in eps]).view(P, G)
        seqs = [(e["ids"], e["mask"], e["logp"]) for e in eps]
        clock.on = False
        t1 = time.perf_counter()
        rm.diagnostics(model, tok, eps, G, ema, cfg.temperature, random.Random(it) if cfg.mi_any_turn else None)  # as the loop
        t_diag = (time.perf_counter() - t1) / cfg.diag_every  # amortised over the diagnostics period
        adv = rm.advantages(R, cfg.adv).flatten().to(device)
        rule = cfg.filter if cfg.filter != "none" else "snr"  # the filtered update: --filter's rule (snr by default)
        kept = rm.filter_groups(R, rule, cfg.filter_p, cfg.filter_k, cfg.filter_score, cfg.include_zero, cfg.filter_prob)
        times = {}
        for mode, groups in (("none", list(range(P))), ("snr", kept)):
            idx = [g * G + i for g in groups for i in range(G)]
            m2 = copy.deepcopy(model)  # both filters update the same weights from the same state
            o2 = torch.optim.AdamW(m2.parameters(), lr=cfg.lr)
            sync(); t2 = time.perf_counter()
            if idx:
                rm.update(m2, ref, o2, [seqs[i] for i in idx], adv[idx], cfg)
            sync(); times[mode] = time.perf_counter() - t2
            del m2, o2  # on a GPU the next copy would otherwise sit beside this one: a peak the loop never has
        t_update = times["none" if cfg.filter == "none" else "snr"]
        t_iter = t_roll + t_diag + t_update
        if device.type == "cuda" or it == 0:  # the CPU's resident-set peak cannot be reset: its first iteration's
            peak_loop = max(peak_loop, peak_memory(device))  # ... before the reference steps (generate re-encodes every context)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_gen = hf_generate_time(model, tok, eps, cfg.temperature)
        trained = seqs if cfg.filter == "none" else [seqs[g * G + i] for g in kept for i in range(G)]
        t_plain = plain_step_time(model, trained, cfg) if trained else 0.0  # nothing kept: no update to compare
        t_own = plain_step_time(model, trained, cfg, own_kernels=True) if trained else 0.0
        peak_all = max(peak_all, peak_loop, peak_memory(device))
        c = clock.t
        row = dict(rollout=t_roll, prefill=c["prefill"], decode=c["decode"], env=c["env"], diag=t_diag, update=t_update,
                   update_none=times["none"], update_snr=times["snr"], kept=len(kept) / P, iter=t_iter,
                   prefill_tps=c["prefill_tok"] / max(c["prefill"], 1e-9), decode_tps=c["decode_tok"] / max(c["decode"], 1e-9),
                   hf_generate=t_gen, plain_step=t_plain, overhead=t_iter / (t_gen + t_plain),
                   own_step=t_own, update_vs_own=t_update / t_own if t_own else 0.0,
                   own_overhead=t_iter / (c["prefill"] + c["decode"] + t_diag + t_own))  # the loop's own forwards, timed in it
        if it:
            rows.append(row)
            print(f"iter {it}: " + " ".join(f"{k}={v:.3g}" for k, v in row.items()))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"\nmedian of {len(rows)} iterations ({cfg.filter} filter in the iteration time; not in it: the evaluation every "
          f"--eval-every steps, checkpoints{', the --gradnorm-every buckets' if cfg.gradnorm_every else ''}):")
    print(f"  iteration {med['iter']:.2f}s = rollout {med['rollout']:.2f}s (prefill {med['prefill']:.2f}s at {med['prefill_tps']:.0f} tok/s, "
          f"decode {med['decode']:.2f}s at {med['decode_tps']:.0f} tok/s, env {med['env']:.3f}s) + diagnostics {med['diag']:.2f}s + update {med['update']:.2f}s")
    print(f"  shares of the iteration: env {med['env'] / med['iter']:.1%}, diagnostics {med['diag'] / med['iter']:.1%}, update {med['update'] / med['iter']:.1%}")
    print(f"  pure model compute: HF generate {med['hf_generate']:.2f}s + plain fwd/bwd/step (full LM head, the update's micro-batches) {med['plain_step']:.2f}s -> overhead ratio {med['overhead']:.2f}")
    print(f"  the update against a plain NLL step on its own kernels (same micro-batches, LM head on the agent's tokens only): "
          f"{med['update']:.2f}s vs {med['own_step']:.2f}s -> {med['update_vs_own']:.2f}x")
    print(f"  the rollout outside the model's forwards (sampling, tokenizing, the env, bookkeeping): "
          f"{med['rollout'] - med['prefill'] - med['decode']:.2f}s of {med['rollout']:.2f}s; the iteration against the loop's own "
          f"kernels (its rollout forwards + diagnostics + that plain step): {med['own_overhead']:.2f}")
    print(f"  update with --filter none {med['update_none']:.2f}s vs {rule} {med['update_snr']:.2f}s (kept {med['kept']:.2f} of groups): "
          + (f"{1 - med['update_snr'] / med['update_none']:.0%} shorter" if med['kept'] else "no group kept, so no update (every group's rewards were equal)"))
    print(f"  peak memory {peak_loop:.2f} GB in the loop alone{'' if device.type == 'cuda' else ' (its first iteration)'}, "
          f"{peak_all:.2f} GB with the reference steps "
          f"({'GPU allocated' if device.type == 'cuda' else 'process RSS'})")
    return med
