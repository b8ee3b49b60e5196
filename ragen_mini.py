"""ragen_mini: RAGEN-2 (arXiv 2604.06268) in one readable file.

Multi-turn GRPO for a causal LM on toy agent tasks, with the paper's two contributions built in:
  * online mutual-information proxies (metrics.py) that see *template collapse*: reasoning that stays
    varied (high entropy) but stops depending on the input (low I(X;Z));
  * SNR-aware filtering: keep only the prompt groups whose episode returns spread the most.

    python ragen_mini.py --filter snr                 # main run: FrozenLake, embedded tiny model, CPU ok
    python ragen_mini.py --demo                       # collapse without the filter, fixed by the filter
    python ragen_mini.py --plot runs                  # every run's last readings, and their curves in runs/plot.png
    python ragen_mini.py --model Qwen/Qwen2.5-0.5B-Instruct --env sokoban --filter snr --lr 1e-6 --micro-batch 32 --max-new-tokens 128
                                                      # a real model, one GPU (README: its replies need room)

Algorithm per step (README "The method", steps 1-8): rollout -> rewards -> diagnostics -> filter ->
advantages -> loss -> optimizer step -> log.

Deviations from the paper / reference code (veRL-based RAGEN), all deliberate:
  * one process, one device, no vLLM: generation is a plain KV-cached sampling loop over the policy itself;
  * GRPO only (no critic/PPO-GAE); one optimizer step per batch (on-policy), so the clipped ratio is ~1 unless
    --ppo-epochs > 1; old log-probs come from the fp32 sampler (equal to a recompute up to rounding); in bf16 on a
    GPU the training forward recomputes them (veRL always recomputes);
  * on a GPU: fp32 weights and optimizer state, bf16 autocast (mixed precision);
  * dropout off throughout RL, the update included (eval mode), so the loss scores tokens as the sampler did;
  * the rollout's KV cache is kept across turns: each turn encodes only the new environment message;
  * the default model is an embedded tiny Llama warm-started on expert traces (no hub access needed);
  * filter score is the group reward *std* (reference code); --filter-score var gives the ports' variant; --filter snr is
    the reference's linear top-p rule (its recommended one); the paper's main-table runs used its softmax rule
    (--filter-prob softmax), which keeps about p of the groups;
  * no dual clip (veRL's clip_ratio_c = 3 bounds -A * ratio for A < 0): with one on-policy step the ratio stays ~1;
  * the loss is one token mean over the whole batch by default (the reference's PPO and DAPO runs; its main-table GRPO
    runs take the mean of per-episode token means, --loss-agg seq-mean-token-mean, so a short episode weighs as much as
    a long one); --adv drgrpo changes the advantage only (Dr.GRPO divides the token sum by a constant);
  * the agent is trained on, and sees in later turns, its replies as sampled (the reference re-renders a parsed reply
    as <think>...</think><answer>...</answer> first);
  * a reasoning that is empty or never closed stays in the MI proxies (README "Metrics"; the reference drops it).
"""
import copy, functools, json, math, os, random, signal, sys, time
from dataclasses import dataclass, asdict


def interrupted_early(*_):
    """^C while the libraries import or the flags are read: nothing has started, so nothing to save. It exits at
    once: an exception raised inside an import can garble it (transformers then reports a missing module)."""
    sys.stderr.write("\ninterrupted before anything started\n")
    os._exit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, interrupted_early)  # main() hands ^C back to Python once the imports are done

import torch
import torch.nn.functional as F
from tqdm import tqdm

import envs
import metrics
import runfiles


@dataclass
class Config:
    # --- task ---
    env: str = "frozenlake"  # environment: a name in envs.ENVS
    env_args: str = "{}"  # JSON kwargs for the env constructor, e.g. '{"slip": 0.2}'
    max_turns: int = 0  # turns per episode, passed to the env (ref: max_turn); 0 = the env's default
    max_actions: int = 2  # actions per turn, separated by '||' (reference code: 2)
    # --- model ---
    model: str = "tiny"  # 'tiny' (embedded Llama, warm-started, cached) or a HF hub id / local path
    tiny_dim: int = 128  # tiny model: hidden size
    tiny_layers: int = 2  # tiny model: transformer layers
    warmup_steps: int = 500  # tiny model: supervised warm-start steps on expert traces (stopped early on purpose)
    warmup_lr: float = 3e-3  # tiny model: warm-start learning rate
    cache_dir: str = "~/.cache/ragen_mini"  # where warm-started tiny models are cached
    # --- rollout ---
    groups: int = 8  # prompt groups per step (ref: env_groups)
    group_size: int = 8  # samples per prompt, all from the same env seed (ref: group_size; TRL: num_generations)
    max_new_tokens: int = 0  # tokens per agent turn; 0 = the env's default (32 or 64: fits its expert; real models want more)
    temperature: float = 1.0  # sampling temperature for training rollouts
    # --- GRPO ---
    steps: int = 60  # RL iterations
    lr: float = 3e-5  # AdamW learning rate (paper: 1e-6 for 3B models; the --demo uses 1e-4)
    adv: str = "grpo"  # advantage: grpo = (R-mean)/(std+1e-6), drgrpo = R-mean (ref: adv_estimator; TRL: scale_rewards)
    clip_low: float = 0.2  # PPO clip range below 1 (ref: clip_ratio_low; TRL: epsilon)
    clip_high: float = 0.28  # PPO clip range above 1 (ref: clip_ratio_high; TRL: epsilon_high)
    entropy_coeff: float = 0.001  # entropy bonus on agent tokens (ref: entropy_coeff)
    kl_coef: float = 0.0  # k3 KL to the frozen start model; 0 keeps no reference model (ref: kl_loss_coef; TRL: beta)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay, the paper's third input-agnostic regulariser (ref: actor.optim.weight_decay, default 0.01)
    loss_agg: str = "token-mean"  # token-mean: one mean over every agent token of the batch (DAPO; the reference's PPO runs) | seq-mean-token-mean: the mean over episodes of each one's token mean (the reference's main-table GRPO runs) (ref: loss_agg_mode)
    ppo_epochs: int = 1  # optimizer steps per batch
    micro_batch: int = 8  # sequences per forward/backward, sorted by length (gradient accumulation; raise it on a GPU) (ref: ppo_micro_batch_size_per_gpu)
    grad_clip: float = 1.0  # max global grad norm
    reg_only: bool = False  # ablation: zero all task advantages, leaving only the regularisers
    reg_scale_from: str = ""  # control run: multiply regulariser coefficients by 'kept_frac' per step from this JSONL
    # --- SNR filter ---
    filter: str = "none"  # none | snr (top-p on reward spread) | topk (top fraction by spread) (ref: rollout_filter_strategy)
    filter_p: float = 0.9  # snr: keep the top groups holding this share of total spread (ref: rollout_filter_value)
    filter_k: float = 0.25  # topk: fraction of groups kept (ref: rollout_filter_value)
    filter_score: str = "std"  # group score: std (the reference code's reward_variance metric, which is a std) or var (the authors' ports to other trainers)
    filter_prob: str = "linear"  # snr: p is a share of the summed spreads (linear, the reference's recommended rule) or of softmax(spreads) (softmax, the paper's main-table runs: near uniform, it keeps about p of the groups) (ref: rollout_filter_top_p_prob_mode)
    include_zero: bool = True  # zero-spread groups may be kept: snr with p >= 1 is then no filter, topk keeps top groups even without spread (ref: rollout_filter_include_zero, default True)
    # --- diagnostics, evaluation, runs ---
    diag_every: int = 5  # entropy + MI proxies every k steps, on the unfiltered batch (ref: collapse_detection.compute_freq)
    mi_any_turn: bool = False  # also the MI proxies on one turn per episode, drawn uniformly, under its whole context (ref: collapse_detection.multi_turn_enabled)
    gradnorm_every: int = 0  # task / entropy / KL gradient norms by reward-variance bucket every k steps with reward spread (0 = off)
    eval_every: int = 20  # evaluation every n steps (and at the start and end)
    eval_episodes: int = 128  # held-out seeds per evaluation (binomial noise: +-0.04 at success 0.3)
    eval_temperature: float = 0.5  # sampling temperature for evaluation
    save_every: int = 10  # checkpoint every n steps; rerunning the same command resumes
    seed: int = 0  # seed for env sampling and torch (the tiny warm start is shared by all seeds)
    out: str = "runs"  # runs are written to OUT/<name>
    name: str = ""  # run name, one folder under --out; default from env, filter, seed and a hash of the settings that differ from the defaults
    device: str = "auto"  # auto | cpu | cuda | mps
    demo: bool = False  # run the template-collapse demo (demo.py) instead of one training run
    bench: bool = False  # run the speed benchmark (bench.py) instead of training
    plot: str = ""  # run folders, comma-separated (a folder of runs: all of them): their last readings and curves (OUT/plot.png), instead of training


CHOICES = {"adv": ["grpo", "drgrpo"], "filter": ["none", "snr", "topk"], "filter_score": ["std", "var"],
           "filter_prob": ["linear", "softmax"], "loss_agg": ["token-mean", "seq-mean-token-mean"],
           "device": ["auto", "cpu", "cuda", "mps"]}  # the settings that take one of some names (--env: a name in envs.ENVS)


def parse_args(argv=None) -> Config:
    """One flag per field of Config, the comment beside it its --help; every value checked before any work starts
    (runfiles.parse_flags)."""
    return runfiles.parse_flags(Config, CHOICES, argv, description=__doc__.split("\n")[0])


def make_env(cfg):
    """--env built with --env-args; --max-turns, when given, is the env's own turn limit (its maps, its `done`)."""
    return envs.make_env(cfg.env, **{"max_turns": cfg.max_turns or None, **json.loads(cfg.env_args)})  # flag_problem: not both


# ----------------------------------------------------------------------------- chat format
SYSTEM = "You're a helpful assistant. "
THINK = "<think>"  # prefilled after the generation prompt: the agent always starts by reasoning
DATE = "26 Jul 2024"  # for templates that print today's date (Llama-3.x): prompts must not change at midnight


def user_turn(turn, obs, turns_left, reward=None):
    """The user message of one turn (reference code's wording, shortened; it counts the actions left, we count turns)."""
    head = "" if reward is None else f"Reward: {reward:g}\n"
    return (f"{head}Turn {turn}:\nState:\n{obs}\nYou have {turns_left} turns left. "
            f"Always output: <think> ... </think> <answer> ... </answer>")


def reasoning(reply):
    """What the MI proxies score as a reply's reasoning: the text after the prefilled <think> up to </think>, or the
    whole reply when it never closes it (README "Metrics")."""
    return reply[len(THINK):].split("</think>")[0]


class Chat:
    """Token pieces of a multi-turn conversation under the model's own chat template.

    The template is rendered once with placeholders; what sits between an assistant reply and the next user
    message (and after it, up to the generation prompt) is cut out, so each new turn is appended as tokens
    without re-rendering history. Assumes the template closes an assistant turn with the tokenizer's EOS
    (ChatML, Llama-3, SmolLM2 and Qwen2.5 all do) and renders a conversation as the start of its continuation
    (not Mistral's, which moves the system prompt to the last user turn, nor DeepSeek-R1's, whose generation prompt
    opens a <think> that earlier turns do not show). Qwen3's drops earlier turns' reasoning: here it stays in context."""

    def __init__(self, tok, instruction):
        self.tok, self.system = tok, SYSTEM + instruction
        msgs = [{"role": r, "content": c} for r, c in [("system", self.system), ("user", "USERONE"),
                                                        ("assistant", "ASSISTANTONE"), ("user", "USERTWO")]]
        text = self.render(msgs)
        between = text[text.index("ASSISTANTONE") + 12: text.index("USERTWO")]
        if not tok.eos_token or not between.startswith(tok.eos_token):
            raise ValueError(f"chat template does not end assistant turns with the tokenizer's EOS ({tok.eos_token!r})")
        if not text.startswith(self.render(msgs[:2])):
            raise ValueError("chat template renders earlier turns otherwise once the conversation goes on (it moves the "
                             "system prompt, or drops the <think> it opened), so turns cannot be appended to a kept KV cache")
        self.between, self.tail = between[len(tok.eos_token):], text[text.index("USERTWO") + 7:]
        self.think = "" if self.tail.rstrip().endswith(THINK) else THINK  # a generation prompt may open <think> itself

    def render(self, messages):
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, date_string=DATE)

    def encode(self, text):
        return self.tok(text, add_special_tokens=False).input_ids

    def first(self, user):  # -> tokens of system + first user message + generation prompt + "<think>"
        return self.encode(self.render([{"role": "system", "content": self.system},
                                        {"role": "user", "content": user}]) + self.think)

    def next(self, user):  # -> tokens appended after the agent's EOS to open the next turn
        return self.encode(self.between + user + self.tail + self.think)


# ----------------------------------------------------------------------------- model
def pick_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":  # cuDNN attention builds a plan per new shape, and a growing KV cache is a new shape every token
        torch.backends.cuda.enable_cudnn_sdp(False)  # (8x slower rollouts on an H200: README "Performance")
    return torch.device(name)


AMP_DEVICES = ("cuda",)  # where the model runs in bf16 autocast


def amp(fn):
    """Run fn(model, ...) in bf16 autocast on a GPU, in fp32 elsewhere. Weights and AdamW state stay fp32 (mixed
    precision, as RL trainers do): in bf16 a weight near 0.02 moves in steps of 1.2e-4, so lr-1e-6 steps would round away."""
    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=model.device.type in AMP_DEVICES):
            return fn(model, *args, **kwargs)
    return run


def load_policy(cfg, device, quiet=False):
    """-> (model, tokenizer). 'tiny' builds and warm-starts the embedded model (cached); else from_pretrained, with fp32
    weights (bf16 compute: amp()), refused in one line when it cannot run here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    runfiles.quiet_transformers()  # no 20 lines of retries for an unreachable hub id; no HF progress bars in a log file
    if cfg.model == "tiny":
        import tiny  # tokenizer + Llama built locally, warm-started on expert traces, cached (tiny.py)
        return tiny.tiny_policy(cfg, device)
    name, gguf = runfiles.model_source(cfg.model)  # a hub id or a folder; gguf: its .gguf file, if that is all it holds
    tok = AutoTokenizer.from_pretrained(name, padding_side="left", **gguf)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **gguf).to(device)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    runfiles.check_model(cfg, model, tok, quiet, Chat, agent_logits, make_env)  # exits on a chat template, logits, attention it cannot run
    return model, tok


# ----------------------------------------------------------------------------- rollout
@amp
@torch.no_grad()
def generate(model, chunks, max_new, temperature, stop, pad_id, state=None):
    """Batched sampling with a KV cache that is kept across turns.

    chunks: per sequence, the tokens not yet in the cache (turn 1: the prompt; later: the rest of the last
    reply + the environment's next message). state: (cache, attention [B, cached length], last position [B]) from the
    previous turn, rows matching chunks, or None. Chunks are left-padded; padding is masked out and positions
    come from the mask, so the cache may hold holes. -> (new token lists, their log-probs at this temperature,
    state, unfed: per sequence, whether its last token is still outside the cache). stop: the id(s) that end a turn.
    Each token list ends at (and includes) a stop id, or is max_new long when the turn was cut."""
    dev, B, T = model.device, len(chunks), max(len(c) for c in chunks)
    stop = torch.tensor(stop if isinstance(stop, (list, tuple)) else [stop], device=dev)
    ids = torch.tensor([[pad_id] * (T - len(c)) + c for c in chunks], device=dev)  # [B, T]
    new_attn = torch.arange(T, device=dev)[None] >= torch.tensor([T - len(c) for c in chunks], device=dev)[:, None]
    cache, attn, pos = state or (None, ids.new_zeros(B, 0), ids.new_full((B,), -1))
    attn, new_attn = torch.cat([attn, new_attn.long()], 1), new_attn.long()
    positions = (pos[:, None] + new_attn.cumsum(1)).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    pos, done, toks, lps = positions[:, -1], torch.zeros(B, dtype=torch.bool, device=dev), [], []
    for t in range(max_new):
        logp = F.log_softmax(out.logits[:, -1].float() / max(temperature, 1e-5), -1)  # [B, V]
        nxt = torch.multinomial(logp.exp(), 1)[:, 0] if temperature > 0 else logp.argmax(-1)
        toks.append(torch.where(done, pad_id, nxt)); lps.append(logp.gather(1, nxt[:, None])[:, 0])
        if t == max_new - 1 or (done | torch.isin(nxt, stop)).all():
            break  # the last sampled token is not fed: the next turn's chunk starts with it
        live = (~done).long()[:, None]  # tokens after EOS are padding: masked out, position not advanced
        attn, pos = torch.cat([attn, live], 1), pos + live[:, 0]
        out = model(input_ids=toks[-1][:, None], attention_mask=attn, position_ids=pos[:, None],
                    past_key_values=out.past_key_values, use_cache=True)
        done |= torch.isin(nxt, stop)
    K, toks, lps = len(toks), torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()
    ends = set(stop.tolist())
    lens = [next((k + 1 for k, x in enumerate(row) if x in ends), len(row)) for row in toks]
    unfed = [n == K for n in lens]  # True when a sequence's last token was sampled at the final step
    return [t[:n] for t, n in zip(toks, lens)], [lp[:n] for lp, n in zip(lps, lens)], (out.past_key_values, attn, pos), unfed


def stop_ids(model, tok):
    """The ids that end an agent turn: the template's EOS and the model's own generation-config stop ids, if any."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return sorted({tok.eos_token_id} | set([extra] if isinstance(extra, int) else extra or []))


def rollout(model, tok, cfg, seeds, group_size, temperature):
    """Play len(seeds) * group_size episodes, all G of a group from the same env seed, turn by turn.
    Returns per-episode dicts: tokens, agent mask (from roles), sampler log-probs, return, success, texts."""
    eps = []
    for s in seeds:
        for _ in range(group_size):
            env = make_env(cfg)
            env.reset(s)
            eps.append(dict(env=env, seed=s, ids=[], mask=[], logp=[], ret=0.0, success=False, done=False,
                            fmt_errors=0, turns=0, first_prompt=None, first_think=None, replies=[], chunk=[], starts=[]))
    chat, turns = Chat(tok, eps[0]["env"].instruction), eps[0]["env"].max_turns
    budget = cfg.max_new_tokens or eps[0]["env"].reply_tokens  # tokens per agent turn
    stop = stop_ids(model, tok)
    live, state = eps, None
    for turn in range(1, turns + 1):
        for e in live:  # the environment's message opens the turn (env tokens: not trained on)
            user = user_turn(turn, e["env"].render(), turns - turn + 1, e.get("r"))
            p = chat.first(user) if turn == 1 else chat.next(user)
            e["ids"] += p; e["mask"] += [0] * len(p); e["logp"] += [0.0] * len(p); e["chunk"] += p
            e["first_prompt"] = e["first_prompt"] or p
            e["starts"].append(len(e["ids"]))  # the turn's context ends here, at its prefilled <think>
        new, lps, state, unfed = generate(model, [e["chunk"] for e in live], budget, temperature,
                                          stop, tok.pad_token_id, state)
        for e, t, lp, u in zip(live, new, lps, unfed):
            e["ids"] += t; e["mask"] += [1] * len(t); e["logp"] += lp  # the agent's own tokens, EOS included
            e["chunk"] = t[-1:] if u else []
            if t[-1] != tok.eos_token_id:  # turn cut at max_new_tokens, or ended by another stop id: close it (not trained on)
                e["ids"] += [tok.eos_token_id]; e["mask"] += [0]; e["logp"] += [0.0]; e["chunk"] += [tok.eos_token_id]
            reply = THINK + tok.decode(t, skip_special_tokens=True)
            e["replies"].append(reply)
            e["first_think"] = e["first_think"] if turn > 1 else reasoning(reply)
            _, e["r"], done, info = envs.step_reply(e["env"], reply, cfg.max_actions)
            e["ret"] += e["r"]; e["turns"] = turn; e["fmt_errors"] += not info.get("format_ok", True)
            e["success"] = e["success"] or bool(info.get("success")); e["done"] = done
        keep = [i for i, e in enumerate(live) if not e["done"]]
        if not keep:
            break
        live, idx = [live[i] for i in keep], torch.tensor(keep, device=model.device)
        state[0].batch_select_indices(idx)  # drop finished episodes from the KV cache
        state = (state[0], state[1][idx], state[2][idx])
    return eps


# ----------------------------------------------------------------------------- diagnostics
@amp
def diagnostics(model, tok, eps, G, ema, temperature=1.0, turn_rng=None):
    """Entropy and MI proxies on the unfiltered batch (README "Metrics"): cross-score every first-turn
    reasoning z_i under every group's first prompt x_j, L[i, j] = log p(z_i | x_j), p the policy at the sampling
    temperature (as the loss scores tokens). Only think_len (0) when no episode wrote any reasoning: a model that
    skips it. With turn_rng (--mi-any-turn), also mi_turn / retrieval_turn: see any_turn_pairs."""
    prompts = [eps[g * G]["first_prompt"] for g in range(len(eps) // G)]
    reasons = [tok(e["first_think"] or "", add_special_tokens=False).input_ids for e in eps]
    form = {"think_len": sum(map(len, reasons)) / len(reasons)}  # mean tokens of a first-turn reasoning
    if not any(reasons):
        return form
    form["seq_rep4"] = metrics.seq_rep(reasons, 4)  # repeated 4-grams within a reasoning: -> 1 in an echo trap
    col = torch.arange(len(eps)) // G  # c(i): the column of each reasoning's own prompt
    cs = metrics.cross_score(model, prompts, reasons, tok.pad_token_id, matched=col.tolist(), temperature=temperature)
    keys = [tuple(p) for p in prompts]  # identical prompts (same seed twice) are the same column
    if len(set(keys)) < 2:  # one distinct prompt (--groups 1, or an env whose start never varies): no MI to estimate
        return {"token_entropy": cs["entropy"]} | form
    mi, mi_sum = metrics.mi_metrics(cs["L_mean"], col, keys), metrics.mi_metrics(cs["L_sum"], col, keys)
    turn = {}
    if turn_rng is not None:  # one turn per episode, each pair its own column (identical contexts: one column)
        xs, zs = any_turn_pairs(eps, tok, turn_rng)
        mt = metrics.mi_metrics(metrics.cross_score(model, xs, zs, tok.pad_token_id, temperature=temperature)["L_mean"],
                                torch.arange(len(xs)), [tuple(x) for x in xs])
        turn = {"mi_turn": mt["mi"], "retrieval_turn": mt["retrieval_acc"], "retrieval_turn_chance": mt["retrieval_chance"]}
    return {"token_entropy": cs["entropy"]} | form | {"mi": mi["mi"], "mi_seq": mi_sum["mi"], "retrieval": mi["retrieval_acc"],
            "retrieval_chance": mi["retrieval_chance"], "h_cond": mi["h_cond"], "h_marg": mi["h_marg"],
            "mi_zscore": mi["mi_zscore"], "mi_zscore_ema": ema.update(mi["matched"], mi["marginal"])} | turn


def any_turn_pairs(eps, tok, rng):
    """--mi-any-turn (the reference's trajectory-uniform sampling): per episode, a turn drawn uniformly from those
    it played; x = the whole conversation up to that turn's prefilled <think>, z = that turn's reasoning tokens.
    -> (contexts, reasonings). Later turns' contexts hold the episode's own history, so most pairs are their own
    column, and the proxies ask whether a turn's reasoning still depends on where the episode stands."""
    turns = [rng.randrange(len(e["starts"])) for e in eps]
    return ([e["ids"][:e["starts"][t]] for e, t in zip(eps, turns)],
            [tok(reasoning(e["replies"][t]), add_special_tokens=False).input_ids for e, t in zip(eps, turns)])


# ----------------------------------------------------------------------------- filter, advantages, loss
def flat(returns):
    """[P, G] -> [P] bool: a group whose G returns are all equal carries no task signal. Said exactly: in float32
    the mean of eight 0.9s is 6e-8 off and their std 6e-8 or 0, so (R - mean) / (std + 1e-6) would give the whole
    group one advantage of an arbitrary sign (-0.06 for 0.9; +-0.47 for some of Sokoban's returns)."""
    return (returns == returns[:, :1]).all(1)


def filter_groups(returns, mode="snr", p=0.9, k=0.25, score="std", include_zero=True, prob="linear"):
    """SNR-aware filter (README step 4). returns [P, G] -> sorted list of kept group indices.
    snr: sort groups by reward spread, keep the shortest prefix whose spread reaches p of the total minus 0.01 (the
    reference code's tolerance; p >= 1 keeps all), or with prob="softmax" whose softmax(spread) mass reaches p; topk:
    keep the int(k * P + 1e-9) groups with the largest spread (at least 1); none: every group, include_zero or not.
    Zero-spread groups are dropped first unless include_zero, as the reference does (linear snr with p < 1 never
    keeps one anyway: the prefix is full before them). An empty list means: skip this update. The 0.01 is in the
    score's units: under var (squared units) a batch whose group variances sum to under 0.011, e.g. only single
    format errors, keeps nothing."""
    s = returns.std(1) if score == "std" else returns.var(1)  # unbiased, over the G samples of a group
    s = s.masked_fill(flat(returns), 0.0)  # G equal returns (or G = 1): no spread, exactly (float32 leaves 6e-8 for 0.9)
    order = torch.argsort(s, descending=True, stable=True).tolist()
    if mode == "none":
        return list(range(len(returns)))
    order = [g for g in order if include_zero or s[g] > 0]
    if mode == "topk":
        order = order[:max(1, int(k * len(returns) + 1e-9))]  # k * P rounded down (+1e-9: 0.29 * 100 is 28.999... in floats, 28 by the reference's int())
    elif p < 1 and prob == "softmax":  # softmax over the groups left: without include_zero, those with spread
        order = order[:int((torch.cumsum(torch.softmax(s[order], 0), 0) < p).sum()) + 1]
    elif p < 1:
        cum, need = torch.cumsum(s[order], 0), p * s.sum() - 0.01
        order = order[:int((cum < need).sum()) + 1] if need > 0 else []  # need <= 0: the empty prefix reaches it
    return sorted(order)


def advantages(returns, kind="grpo"):
    """Group-relative advantage per episode. returns [P, G] -> [P, G].
    grpo: (R - mean) / (std + 1e-6) (DeepSeekMath); drgrpo: R - mean (Dr.GRPO, no std scaling)."""
    centred = (returns - returns.mean(1, keepdim=True)).masked_fill(flat(returns)[:, None], 0.0)  # (see flat)
    if kind == "drgrpo" or returns.shape[1] == 1:
        return centred
    return centred / (returns.std(1, keepdim=True) + 1e-6)


def pad_right(seqs, pad_id, device, extra=None):
    """[(ids, mask)] -> right-padded tensors: ids [B,T], attention [B,T], mask [B,T] (+ extra: float lists, padded alike)."""
    T = max(len(s[0]) for s in seqs)
    pad = lambda rows, v, dt: torch.tensor([r + [v] * (T - len(r)) for r in rows], dtype=dt, device=device)
    out = (pad([s[0] for s in seqs], pad_id, torch.long), pad([[1] * len(s[0]) for s in seqs], 0, torch.long),
           pad([s[1] for s in seqs], 0, torch.float))
    return out + ((pad(extra, 0.0, torch.float),) if extra is not None else ())


def agent_logits(model, ids, sel):
    """Logits [K, V] at the K positions where sel [B, T] is True, for right-padded ids [B, T]. No attention mask is
    needed: causal attention never lets a real token see the padding after it. The LM head runs on those positions
    only: agent tokens are about a fifth of a conversation, and with a real model's 150k-word vocabulary the full
    [B, T, V] logits of a batch would not fit in memory. (Assumes logits = LM head of the last hidden state, as in
    Llama, Qwen2 and SmolLM2; load_policy checks it.)"""
    return model.get_output_embeddings()(model.base_model(input_ids=ids).last_hidden_state[sel])


def agent_logprobs(model, ids, sel, temperature):
    """log pi [K, V] at the sampling temperature, at the K positions where sel [B, T-1] is True: position t of
    right-padded ids [B, T] predicts token t+1. The loss, the reference model and (under bf16) pi_old score tokens this
    way; in fp32 pi_old is the sampler's, equal up to rounding."""
    return F.log_softmax(agent_logits(model, ids[:, :-1], sel).float() / max(temperature, 1e-5), -1)


def loss_terms(model, ref, batch, adv, cfg):
    """Token-mean terms of the GRPO objective over the agent tokens of a (micro-)batch (README step 6), or under
    --loss-agg seq-mean-token-mean the mean over its B episodes of each one's token mean (ntok then counts episodes).
    batch: ids/attn/mask/old_logp [B, T] (attn unused: right padding); adv [B]. -> dict(pg, entropy, kl, ntok)."""
    ids, _, mask, old = batch
    sel = mask[:, 1:].bool()  # [B, T-1]: position t predicts token t+1, an agent token
    tgt, n = ids[:, 1:][sel], sel.sum().clamp(min=1)  # tgt [K]: the agent's tokens
    logp_all = agent_logprobs(model, ids, sel, cfg.temperature)  # [K, V]
    logp = logp_all.gather(-1, tgt[:, None])[:, 0]  # [K] log pi(token)
    ratio = torch.exp(logp - old[:, 1:][sel])  # [K] pi / pi_old
    A = adv[:, None].expand_as(sel)[sel]  # [K] one advantage for every token of the trajectory
    pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))  # PPO clipped surrogate
    entropy = metrics.entropy(logp_all)  # [K] full-softmax entropy (a -inf logit, p = 0, adds 0, not NaN)
    kl = torch.zeros_like(logp)
    if ref is not None:  # k3 estimator of KL(pi || pi_ref): exp(d) - d - 1, d = log pi_ref - log pi
        with torch.no_grad():
            ref_logp = agent_logprobs(ref, ids, sel, cfg.temperature).gather(-1, tgt[:, None])[:, 0]
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
    if cfg.loss_agg == "seq-mean-token-mean":  # a token's weight: 1 / (its episode's agent tokens * B)
        w = (1 / (sel.sum(1, keepdim=True) * len(ids))).expand_as(sel)[sel]  # [K]
        return dict(pg=(pg * w).sum(), entropy=(entropy * w).sum(), kl=(kl * w).sum(), ntok=torch.tensor(len(ids)))
    return dict(pg=pg.sum() / n, entropy=entropy.sum() / n, kl=kl.sum() / n, ntok=n)


def micro_batches(seqs, size):
    """Episode indices in micro-batches of size, sorted by length: similar lengths share one, so less padding."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    return [order[i:i + size] for i in range(0, len(seqs), size)]


@torch.no_grad()
def train_batch(model, seqs, idx, cfg):
    """Episodes idx of seqs [(ids, mask, sampler log-probs)] as one right-padded batch (ids, attn, mask, old_logp).
    pi_old is the sampler's in fp32 (equal up to rounding); under bf16 the KV-cached sampler rounds otherwise and
    pi / pi_old would not start at 1, so the training forward recomputes it (veRL always does)."""
    batch = pad_right([seqs[i][:2] for i in idx], 0, model.device, [seqs[i][2] for i in idx])
    if not torch.is_autocast_enabled(model.device.type):
        return batch
    ids, _, mask, _ = batch
    sel, old = mask[:, 1:].bool(), torch.zeros_like(mask)
    old[:, 1:][sel] = agent_logprobs(model, ids, sel, cfg.temperature).gather(-1, ids[:, 1:][sel][:, None])[:, 0]
    return batch[:3] + (old,)


@amp
def update(model, ref, opt, seqs, adv, cfg, reg_scale=1.0):
    """One GRPO update on the kept episodes: micro-batched, one mean (--loss-agg) over the whole batch. -> stats."""
    total = sum(sum(s[1]) for s in seqs) if cfg.loss_agg == "token-mean" else len(seqs)  # agent tokens (or episodes)
    model.eval()  # dropout off (GPT-2, OPT, Phi-2 ship with it), as the sampler ran: else pi / pi_old starts off 1 (TRL: disable_dropout)
    chunks = micro_batches(seqs, cfg.micro_batch)
    batches = [train_batch(model, seqs, idx, cfg) for idx in chunks]  # pi_old before any step: every epoch clips against it
    stats = dict(loss=0.0, pg=0.0, entropy=0.0, kl=0.0)
    for group in opt.param_groups:  # weight decay is a regulariser too: the control run scales it with the others
        group["weight_decay"] = reg_scale * cfg.weight_decay
    for epoch in range(cfg.ppo_epochs):
        opt.zero_grad(set_to_none=True)
        for idx, batch in zip(chunks, batches):
            t = loss_terms(model, ref, batch, adv[idx], cfg)
            loss = t["pg"] - reg_scale * cfg.entropy_coeff * t["entropy"] + reg_scale * cfg.kl_coef * t["kl"]
            w = (t["ntok"] / max(total, 1)).item()  # micro-batch share of all agent tokens (or episodes): keeps it one mean
            (loss * w).backward()
            for k in stats:
                stats[k] += w * (loss if k == "loss" else t[k]).item() / cfg.ppo_epochs
            if not math.isfinite(stats["loss"]):
                break  # the step is skipped below: the remaining micro-batches need not run
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if not (torch.isfinite(gnorm) and math.isfinite(stats["loss"])):  # NaN/inf loss or gradient: no step
            opt.zero_grad(set_to_none=True)
            return dict(stats, loss=float("nan"), epochs_stepped=epoch)  # --ppo-epochs > 1: earlier epochs' steps stand
        opt.step()
        if not torch.stack([p.isfinite().all() for p in model.parameters()]).all():  # a finite gradient times an --lr far too high
            raise FloatingPointError(f"the optimizer step left non-finite weights (--lr {cfg.lr:g} is far too high); stopped "
                                     "before they were saved: the last checkpoint stands (a lower --lr starts a new run)")
    return stats


# ----------------------------------------------------------------------------- the mechanism, measured; evaluation
@amp
def grad_norms_by_bucket(model, ref, seqs, returns, cfg, n_buckets=3):
    """The paper's SNR mechanism, measured: bucket groups by reward variance and take the norm of the task,
    entropy-bonus and KL gradients separately (separate backward passes, no optimizer step). The task term uses the
    rewards' advantages even under --reg-only, which zeroes them in the update: it shows the signal the ablation drops."""
    P, G = returns.shape
    model.eval()  # dropout off, as update() runs
    out, params = {}, [p for p in model.parameters() if p.requires_grad]
    adv = advantages(returns, cfg.adv).flatten()
    for b, groups in enumerate(metrics.variance_buckets(returns.var(1).tolist(), n_buckets)):
        if not groups:  # fewer groups than buckets
            continue
        idx = [g * G + i for g in groups for i in range(G)]
        t = loss_terms(model, ref, train_batch(model, seqs, idx, cfg), adv[idx].to(model.device), cfg)
        terms = {"task": t["pg"], "entropy": cfg.entropy_coeff * t["entropy"], "kl": cfg.kl_coef * t["kl"]}
        out |= {f"gn_{k}_b{b}": v for k, v in metrics.grad_norms(terms, params).items()}
        out[f"rv_b{b}"] = float(returns[groups].var(1).mean())
    return out


def evaluate(model, tok, cfg):
    """Per held-out map (seeds >= 1e6, never used for training): solved at the evaluation temperature? [bool]"""
    torch.manual_seed(10**6)  # the same sampling noise at every evaluation: runs compare on equal terms
    model.eval()  # no dropout (the tiny Llama has none; some real models do)
    eps = rollout(model, tok, cfg, [10**6 + i for i in range(cfg.eval_episodes)], 1, cfg.eval_temperature)
    return [e["success"] for e in eps]


# ----------------------------------------------------------------------------- the loop
def train(cfg, quiet=False):
    """Run GRPO (+ optional SNR filter) for cfg.steps in its run folder (runfiles.py), resuming from its last
    checkpoint. -> (summary, model, tok)."""
    out = runfiles.run_dir(cfg)
    with runfiles.locked(out):  # one process per run folder, released however train ends
        return train_locked(cfg, out, quiet)


def train_locked(cfg, out, quiet):
    """train()'s body, run while it holds the folder's lock."""
    device = pick_device(cfg.device)
    c = runfiles.resume(cfg, out, device)  # the last checkpoint, or None; refuses a folder of other settings
    model, tok = load_policy(cfg, device, quiet)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None  # frozen start model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ema, log_path, ckpt = metrics.ZScoreEMA(), os.path.join(out, "log.jsonl"), os.path.join(out, "ckpt.pt")
    start, state = 0, {"mi0": None, "ent0": None, "alarm": False, "eval0": None}  # the loop's running statistics
    if c is not None:  # resume: weights, optimizer, EMA, reference model, step and those statistics (save_ckpt below)
        start, state = runfiles.restore(c, out, cfg, model=model, opt=opt, ema=ema, ref=ref)
    # control run (demo c): the regularisers x the kept fraction that another run had at each step
    reg_scales = runfiles.kept_fractions(cfg.reg_scale_from, cfg.steps) if cfg.reg_scale_from else {}
    if not quiet:
        print("config: " + " ".join(f"{k}={v}" for k, v in asdict(cfg).items()))
    if state["eval0"] is None:  # the warm start's evaluation, map by map: the end compares the same maps
        state["maps0"] = state["maps"] = evaluate(model, tok, cfg)
        state["eval0"] = sum(state["maps0"]) / len(state["maps0"])
    P, G, log, shown = cfg.groups, cfg.group_size, {}, {}
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=os.path.basename(out),
               disable=quiet or None)  # None: no bar when stderr is a file or a pipe, where the step lines say it all
    for step in bar:
        t0 = time.time()
        torch.manual_seed(cfg.seed * 100_003 + step)  # every step reproducible, so a resumed run continues exactly
        rng = random.Random(cfg.seed * 100_003 + step)
        seeds = [rng.randrange(10**6) for _ in range(P)]
        # 1. rollout: P groups x G samples, multi-turn
        model.eval()
        eps = rollout(model, tok, cfg, seeds, G, cfg.temperature)
        # 2. rewards: one return per episode (rv_before / rv_after: the mean within-group std)
        R = torch.tensor([e["ret"] for e in eps]).view(P, G)
        log = {"step": step, "success": sum(e["success"] for e in eps) / len(eps), "reward": R.mean().item(),
               "reward_std": R.std().item(), "rv_before": R.std(1).mean().item(), "fmt_err": sum(e["fmt_errors"] for e in eps) / len(eps)}
        # 3. diagnostics on the unfiltered batch, so filtered and unfiltered runs are measured alike
        seqs = [(e["ids"], e["mask"], e["logp"]) for e in eps]
        if step % cfg.diag_every == 0 or step == cfg.steps - 1:
            log |= diagnostics(model, tok, eps, G, ema, cfg.temperature, rng if cfg.mi_any_turn else None)
        if math.isfinite(log.get("mi", math.nan)):  # (a non-finite reading neither starts nor fires the alarm)
            state["mi0"] = state["mi0"] if state["mi0"] is not None else log["mi"]
            state["ent0"] = state["ent0"] if state["ent0"] is not None else log["token_entropy"]
            if log["mi"] < 0.5 * state["mi0"] and state["mi0"] > 0.05 and log["token_entropy"] >= 0.8 * state["ent0"]:  # (MI near 0 at the start: nothing to lose)
                if not state["alarm"]:
                    tqdm.write(f"COLLAPSE ALARM step {step}: MI {log['mi']:.3f} < 50% of its start {state['mi0']:.3f} "
                               f"while token entropy holds ({log['token_entropy']:.3f} vs {state['ent0']:.3f})")
                state["alarm"] = True
                log["alarm"] = 1
        if cfg.gradnorm_every and step % cfg.gradnorm_every == 0 and R.var(1).max() > 0:  # no spread: buckets are arbitrary
            log |= grad_norms_by_bucket(model, ref, seqs, R, cfg)
        # 4. SNR-aware filter: keep whole groups with the largest reward spread
        kept = filter_groups(R, cfg.filter, cfg.filter_p, cfg.filter_k, cfg.filter_score, cfg.include_zero, cfg.filter_prob)
        log |= {"kept_frac": len(kept) / P, "rv_after": R[kept].std(1).mean().item() if kept else 0.0}
        if not kept:
            log |= {"skipped": 1, "loss": 0.0}
        else:
            # 5. advantages on the kept groups only
            adv = advantages(R[kept], cfg.adv).flatten() * (0.0 if cfg.reg_only else 1.0)
            # 6-7. loss and optimizer step
            stats = update(model, ref, opt, [seqs[g * G + i] for g in kept for i in range(G)], adv.to(device), cfg, reg_scales.get(step, 1.0))
            stepped = stats.pop("epochs_stepped", cfg.ppo_epochs)  # fewer: a non-finite loss or gradient stopped it
            log |= stats | ({"skipped": 1} if stepped == 0 else {})
            if stepped < cfg.ppo_epochs:
                tqdm.write(f"step {step}: non-finite loss or gradient, " + ("optimizer step skipped" if stepped == 0 else
                           f"its epochs after the first {stepped} of {cfg.ppo_epochs} skipped"))
        # 8. evaluate, log, checkpoint
        if (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1:
            state["maps"] = evaluate(model, tok, cfg)
            log["eval_success"] = sum(state["maps"]) / len(state["maps"])
        log["sec"] = time.time() - t0
        runfiles.write_log(log_path, [log])
        if not quiet:
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in log.items()))
        shown |= {k: log[k] for k in ("success", "token_entropy", "mi", "kept_frac") if k in log}
        bar.set_postfix({k: f"{v:.2f}" for k, v in shown.items()})
        if (step + 1) % cfg.save_every == 0 or step == cfg.steps - 1:
            runfiles.save_ckpt(ckpt, model=model.state_dict(), opt=opt.state_dict(), ema=ema.state_dict(), step=step + 1,
                      state=state, ref=ref.state_dict() if ref is not None else None)
    return runfiles.finish(cfg, out, model, tok, state, quiet), model, tok  # export the policy, sum up, the done line


def main(argv=None):
    cfg = parse_args(argv)
    if __name__ == "__main__":  # the script: the model code's imports (2 s) under interrupted_early too, then
        from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401  a ^C is reported below
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with runfiles.one_line_errors(cfg):  # ^C: how to resume; a failing model path, a damaged folder: one line each
        if cfg.demo or cfg.plot:
            import demo
            return demo.plot_runs(cfg) if cfg.plot else demo.main(cfg)
        if cfg.bench:
            import bench
            return bench.main(cfg)
        train(cfg)


if __name__ == "__main__":
    main()
