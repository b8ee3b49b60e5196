"""The embedded tiny model (`--model tiny`, the default): no hub access needed.

A byte-level BPE tokenizer trained on the environment's own text, a 2-layer Llama from a transformers config, and a
supervised warm start on expert conversations whose <think> states the facts of the observation, so reasoning
starts out input-dependent. Built once per setting and cached on disk; every RL --seed shares it.
"""
import hashlib, json, math, os, random, time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import ragen_mini as rm
import runfiles

SAVE_EVERY = 50  # warm-start steps between checkpoints (about 20 s of work here)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def expert_turns(env, seed, max_turns):
    """One expert conversation as text, [(user message, think, action)] a turn: the warm-start data, and its cache key."""
    obs, turns = env.reset(seed), []
    user = rm.user_turn(1, obs, max_turns)
    for turn in range(1, max_turns + 1):
        think, action = env.expert()
        turns.append((user, think, action))
        obs, reward, done, _ = env.step(action)
        if done:
            break
        user = rm.user_turn(turn + 1, obs, max_turns - turn, reward)
    return turns


def expert_episode(env, seed, chat, max_turns):
    """One expert conversation as (tokens, agent mask)."""
    ids, mask = [], []
    for turn, (user, think, action) in enumerate(expert_turns(env, seed, max_turns)):
        prompt = chat.first(user) if turn == 0 else chat.next(user)
        reply = chat.encode(f" {think} </think> <answer> {action} </answer>") + [chat.tok.eos_token_id]
        ids, mask = ids + prompt + reply, mask + [0] * len(prompt) + [1] * len(reply)
    return ids, mask


def cache_path(cfg):
    """CACHE_DIR/tiny-<hash>: the settings that shape the warm start, and the text of a few expert conversations, so
    that an env whose observations, expert, rewards or turns were edited builds a new warm start, not loads the old."""
    key = {k: getattr(cfg, k) for k in ("env", "max_turns", "tiny_dim", "tiny_layers", "warmup_steps", "warmup_lr")}
    device = rm.pick_device(cfg.device).type
    if device != "cpu":  # a GPU builds other weights (its rounding); runs on a CPU keep the key they had
        key["device"] = device
    key |= {"version": 5, "env_args": json.dumps({k: v for k, v in json.loads(cfg.env_args).items()
                                                  if k != "format_penalty"}, sort_keys=True)}  # the expert's actions are all valid
    env = rm.make_env(cfg)
    text = [rm.SYSTEM, env.instruction] + [x for seed in range(8) for t in expert_turns(env, seed, env.max_turns) for x in t]
    key["data"] = hashlib.sha1("\n".join(text).encode()).hexdigest()
    return os.path.join(os.path.expanduser(cfg.cache_dir), "tiny-" + hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10])


def tiny_policy(cfg, device):
    """Build a byte-level BPE tokenizer and a small Llama from the env's own text, warm-start it on expert
    trajectories (supervised, loss on agent tokens only), cache both on disk keyed by the settings."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging
    path = cache_path(cfg)  # one warm start, shared by every RL --seed
    done = os.path.join(path, "model.safetensors")  # written last: its presence means the cache is complete
    if not os.path.exists(done):
        os.makedirs(path, exist_ok=True)  # an unwritable cache fails now, not after minutes of training
        with runfiles.locked(path, wait=True):  # a second process building the same model waits, then reads it
            if not os.path.exists(done):
                return warm_start(cfg, path, device)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Loading weights" bar for 20 small tensors is noise in the log
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(path, padding_side="left")
        model = LlamaForCausalLM.from_pretrained(path)
    except Exception as e:  # damaged from outside (it is written whole): say which folder and what to do
        raise OSError(f"the warm-start cache {path} is unreadable ({e.__class__.__name__}): remove that folder "
                      "and rerun to build it again") from e
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return model.to(device), tok  # (outside the try: a device out of memory is no damaged cache)


def warm_start(cfg, path, device):
    """Build the tokenizer and the model, train the model on expert conversations, save both in path. Checkpoints
    every SAVE_EVERY steps: an interrupted build resumes where it stopped and ends with the same weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    env = rm.make_env(cfg)
    turns = env.max_turns
    rng = random.Random(0)
    seeds = [rng.randrange(10**6) for _ in range(32 * cfg.warmup_steps + 300)]  # training seeds: [0, 1e6)
    # 1. tokenizer: byte-level BPE trained on expert transcripts, so any text tokenizes (no unknown words)
    texts = []
    for s in seeds[:300]:
        env.reset(s)
        think, action = env.expert()
        texts += [f"system\n{rm.SYSTEM}{env.instruction}\n", f"user\n{rm.user_turn(1, env.render(), turns, 0.0)}\n",
                  f"assistant\n {think} \n <answer> {action} \n"]  # tags and <|im_*|> are added tokens
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<|im_end|>",
                                  padding_side="left", chat_template=CHATML)
    tok.add_tokens(["<think>", "</think>", "<answer>", "</answer>"])  # plain (not special): decode keeps them
    # 2. model
    torch.manual_seed(0)
    d = cfg.tiny_dim
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=d, intermediate_size=2 * d,
                                         num_hidden_layers=cfg.tiny_layers, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)).to(device)
    # 3. warm start: supervised on expert conversations, stopped early so RL has room to improve
    chat = rm.Chat(tok, env.instruction)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1, (i + 1) / 50) * (0.55 + 0.45 * math.cos(math.pi * i / max(cfg.warmup_steps, 1))))
    ckpt, start = os.path.join(path, "warm_start.pt"), 0
    if os.path.exists(ckpt):  # an interrupted build: continue from its last checkpoint
        try:
            c = torch.load(ckpt, map_location="cpu", weights_only=False)  # load_state_dict moves it to the model's device
            model.load_state_dict(c["model"]); opt.load_state_dict(c["opt"]); sched.load_state_dict(c["sched"])
        except Exception as e:  # damaged from outside (it is saved whole)
            raise OSError(f"{ckpt} is unreadable ({e.__class__.__name__}): remove it to build the warm start from the "
                          "start") from e
        start = c["step"]
        print(f"warm start: resuming from step {start} ({ckpt})")
    print(f"warm start: {cfg.warmup_steps - start} supervised steps on expert conversations (minutes on a CPU), then cached in {path}")
    t0 = time.time()
    for i in tqdm(range(start, cfg.warmup_steps), initial=start, total=cfg.warmup_steps, desc="warm start",
                  disable=None):  # None: no bar when stderr is a file or pipe (a log would get 500 of them)
        batch = sorted((expert_episode(env, s, chat, turns) for s in seeds[300 + 32 * i: 300 + 32 * (i + 1)]),
                       key=lambda b: len(b[0]))  # 32 fresh maps; similar lengths share a micro-batch: less padding
        n = sum(sum(m) for _, m in batch)  # agent tokens in the step: the loss is their mean
        opt.zero_grad()
        for j in range(0, len(batch), 8):
            ids, _, mask = rm.pad_right(batch[j:j + 8], tok.pad_token_id, device)  # right padding: causal attention
            hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]  # [8, T-1, d] keeps it out, no mask needed
            agent = mask[:, 1:].bool()  # predict token t+1 from position t, on the agent's tokens only (19%)
            nll = F.cross_entropy(model.lm_head(hidden[agent]).float(), ids[:, 1:][agent], reduction="sum")
            (nll / n).backward()  # the LM head runs on the agent's positions alone
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # without it a late loss spike can undo the warm start
        if not torch.isfinite(gnorm):  # diverged (a --warmup-lr far too high), as update() checks it: cache nothing
            if os.path.exists(ckpt):
                os.remove(ckpt)  # its checkpoints lead here too
            raise ValueError(f"the warm start diverged at step {i + 1} (a non-finite gradient at --warmup-lr {cfg.warmup_lr:g}): "
                             "nothing was cached; lower --warmup-lr")
        opt.step(); sched.step()
        if (i + 1) % SAVE_EVERY == 0 and i + 1 < cfg.warmup_steps:
            runfiles.save_ckpt(ckpt, model=model.state_dict(), opt=opt.state_dict(), sched=sched.state_dict(), step=i + 1)
    tok.save_pretrained(path)
    model.save_pretrained(path + ".tmp")  # then moved in, model.safetensors last: a cut save leaves no half cache
    for f in sorted(os.listdir(path + ".tmp"), key=lambda f: f == "model.safetensors"):
        os.replace(os.path.join(path + ".tmp", f), os.path.join(path, f))
    os.rmdir(path + ".tmp")
    if os.path.exists(ckpt):
        os.remove(ckpt)
    print(f"warm start: done in {time.time() - t0:.0f}s")
    return model, tok
