"""Where a rollout's time goes on a GPU: `python docs/gpu_profile.py [training flags]` (run from the repo root).

Prints the machine's launch and sync latency, the rollout's wall-clock (and with one CPU thread), one decode
forward with variants of its inputs, HF generate on the same prompts, and the top of a torch.profiler table.
"""
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
import ragen_mini as rm


CUDA = torch.cuda.is_available()
sync = torch.cuda.synchronize if CUDA else (lambda: None)


def ms(f, n=20):
    ts = []
    for _ in range(n):
        sync(); t0 = time.perf_counter(); f(); sync()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


dev = torch.device("cuda" if CUDA else "cpu")
x = torch.zeros(16, device=dev)
sync(); t0 = time.perf_counter()
for _ in range(2000):
    x.add_(1)
t_launch = (time.perf_counter() - t0) / 2000 * 1e6; sync()
t_sync = ms(lambda: (x.add_(1), x.sum().item()), 200)
t0 = time.perf_counter(); sum(range(10**7)); t_py = time.perf_counter() - t0
print(f"machine: launch {t_launch:.1f} us/kernel (queued), add+item round trip {t_sync * 1e3:.0f} us, "
      f"python sum(range(1e7)) {t_py:.2f} s, torch threads {torch.get_num_threads()}")

cfg = rm.parse_args(sys.argv[1:])
model, tok = rm.load_policy(cfg, dev)
model.eval()
seeds = list(range(cfg.groups))
rm.rollout(model, tok, cfg, seeds, cfg.group_size, 1.0)  # warm-up
for threads in (torch.get_num_threads(), 1):
    torch.set_num_threads(threads)
    ts = []
    for i in range(2):
        torch.manual_seed(i); sync(); t0 = time.perf_counter()
        eps = rm.rollout(model, tok, cfg, seeds, cfg.group_size, 1.0)
        sync(); ts.append(time.perf_counter() - t0)
    n = sum(sum(e["mask"]) for e in eps)
    print(f"rollout with {threads} threads: {' '.join(f'{t:.2f}s' for t in ts)} ({n} agent tokens, {len(eps)} episodes)")

# one decode forward after a 64-sequence prefill, with variants of its inputs
chat = rm.Chat(tok, rm.make_env(cfg).instruction)
env = rm.make_env(cfg)
prompts = []
for s in range(cfg.groups * cfg.group_size):
    env.reset(s)
    prompts.append(chat.first(rm.user_turn(1, env.render(), env.max_turns, None)))
new, _, (cache, attn, pos), _ = rm.generate(model, prompts, 16, 1.0, rm.stop_ids(model, tok), tok.pad_token_id)
nxt = torch.tensor([t[-1] for t in new], device=dev)[:, None]
import copy
base = copy.deepcopy(cache)
amp = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=CUDA)


def fwd(**kw):
    ts = []
    for _ in range(20):
        c = copy.deepcopy(base)  # the same cache each time (a forward appends to it)
        sync(); t0 = time.perf_counter()
        with torch.no_grad(), amp():
            model(input_ids=nxt, past_key_values=c, use_cache=True, **kw)
        sync(); ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


a1 = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
print(f"one decode forward (64 seqs, cache {base.get_seq_length()}): ours {fwd(attention_mask=a1, position_ids=pos[:, None] + 1):.2f} ms, "
      f"mask only {fwd(attention_mask=a1):.2f} ms, no mask {fwd():.2f} ms, "
      f"bool mask {fwd(attention_mask=a1.bool(), position_ids=pos[:, None] + 1):.2f} ms")
T = max(len(p) for p in prompts)
ids = torch.tensor([[tok.pad_token_id] * (T - len(p)) + p for p in prompts], device=dev)
am = (ids != tok.pad_token_id).long()
with torch.no_grad(), amp():
    g = lambda: model.generate(input_ids=ids, attention_mask=am, max_new_tokens=32, min_new_tokens=32, do_sample=True,
                               top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
    print(f"HF generate, 64 seqs x 32 tokens: {ms(g, 3):.0f} ms; our generate, same: "
          f"{ms(lambda: rm.generate(model, prompts, 32, 1.0, [-1], tok.pad_token_id), 3):.0f} ms")

from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * CUDA) as prof:
    rm.rollout(model, tok, cfg, seeds, cfg.group_size, 1.0)
    sync()
ka = prof.key_averages()
print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
if CUDA:
    print(ka.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))
