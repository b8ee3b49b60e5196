"""Does the warm start need its attention mask? `python docs/warm_start_probe.py` (from the repo root, alone).

Runs the warm start's micro-batches (6 steps of 32 expert conversations, right-padded, micro-batches of 8) on the
cached default tiny model, with the attention mask (as before `06c990f`) and without it (since), REPS times each,
alternating; prints whether the gradients are equal bit for bit and the median time of each. A probe for README's
performance section, not part of the package.
"""
import copy, os, random, statistics, sys, time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
import ragen_mini as rm
import tiny

REPS = 6
cfg = rm.parse_args([])
model, tok = tiny.tiny_policy(cfg, torch.device("cpu"))  # built (minutes) if not cached yet
env = rm.make_env(cfg)
chat, rng = rm.Chat(tok, env.instruction), random.Random(0)
seeds = [rng.randrange(10**6) for _ in range(6 * 32)]
batches = [sorted((tiny.expert_episode(env, s, chat, env.max_turns) for s in seeds[32 * i: 32 * (i + 1)]),
                  key=lambda b: len(b[0])) for i in range(6)]


def steps(use_mask):
    """-> (seconds, per-step gradients) of the warm start's forward/backward on the 6 batches."""
    m, grads, t0 = copy.deepcopy(model), [], time.perf_counter()
    for batch in batches:
        n = sum(sum(mask) for _, mask in batch)
        m.zero_grad()
        for j in range(0, len(batch), 8):
            ids, attn, mask = rm.pad_right(batch[j:j + 8], tok.pad_token_id, "cpu")
            hidden = m.model(input_ids=ids, attention_mask=attn if use_mask else None).last_hidden_state[:, :-1]
            agent = mask[:, 1:].bool()
            (F.cross_entropy(m.lm_head(hidden[agent]).float(), ids[:, 1:][agent], reduction="sum") / n).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    return time.perf_counter() - t0, grads


times, same = {True: [], False: []}, True
for _ in range(REPS):
    (t_mask, g_mask), (t_none, g_none) = steps(True), steps(False)
    times[True].append(t_mask); times[False].append(t_none)
    same &= all(torch.equal(a, b) for a, b in zip(g_mask, g_none))
print(f"gradients equal bit for bit: {same}; median of {REPS}: with mask {statistics.median(times[True]):.2f} s, "
      f"without {statistics.median(times[False]):.2f} s (6 warm-start steps each)")
