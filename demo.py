"""The template-collapse demo: `python ragen_mini.py --demo [--seed N]` (README "The demo").

From one warm-started tiny model, three runs that share seeds, steps and every hyperparameter:
  (a) no filter   -> low reward-variance groups let the input-agnostic regularisers dominate: MI falls, entropy holds
  (b) SNR filter  -> only groups with reward spread are trained on: MI and success are kept
  (c) control     -> no filter, regulariser coefficients x the kept fraction (b) had at each step
Task: frozenlake-mixed (3 turns, 5 maps in 8 unsolvable) without the format penalty, so a group on an unsolvable
map has exactly zero reward variance; a strong entropy bonus and a small KL to the start model, the regularisers
whose push is the same for every input.
Writes DEMO_DIR/{table.md (the table, gradient norms and sample reasonings), demo.png} and the three runs' JSONL logs.
Its figure also serves `--plot RUN,RUN,...` (plot_runs): the same curves for any runs, from their logs.
"""
import copy, dataclasses, hashlib, json, math, multiprocessing, multiprocessing.connection, os, signal, statistics, sys, threading, time

import torch

import ragen_mini as rm
import runfiles

SETUP = dict(env="frozenlake-mixed", env_args='{"format_penalty": 0, "unsolvable_frac": 0.625}', max_turns=0, max_actions=1,
             groups=8, group_size=8, max_new_tokens=0, steps=200, lr=1e-4, entropy_coeff=0.045, kl_coef=0.025, diag_every=5,
             gradnorm_every=5, eval_every=25, eval_episodes=128)


OWN = ("filter", "name", "reg_scale_from")  # set by the demo for each run: not flags of the demo


def demo_config(cfg):
    """The demo's settings: SETUP over the defaults, except for the flags typed on the command line, which win
    (`--demo --kl-coef 0`, `--demo --steps 100`): a fork's experiment is one flag away."""
    typed = getattr(cfg, "typed", set())
    if typed & set(OWN):
        sys.exit(f"error: --demo sets {', '.join('--' + k.replace('_', '-') for k in OWN)} itself for each of its three runs")
    base = dataclasses.replace(cfg, **{k: v for k, v in SETUP.items() if k not in typed}, demo=False)
    if base.steps < 1 or base.groups < 3:
        sys.exit("error: --demo needs --steps >= 1 and --groups >= 3 (its gradient buckets are three)")
    problem = runfiles.flag_problem(base)  # the typed flags checked against the demo's own (e.g. another --env)
    if problem:
        sys.exit(f"error: --demo with its set-up: {problem}" + (" (that set-up is for frozenlake-mixed: with another "
                 "--env, give its --env-args too)" if "env" in typed and "env_args" not in typed else ""))
    return base


def changes(cfg):
    """The typed flags that change what the demo trains (the run settings runfiles.run_key names, and --steps; the seed
    is in the folder's name) and whose values differ from the demo's own set-up (SETUP over the defaults)."""
    pure, settings = rm.Config(**SETUP), (set(runfiles.run_key(cfg)) | {"steps"}) - {"seed"}
    return {k: getattr(cfg, k) for k in sorted(getattr(cfg, "typed", set()) & settings) if getattr(cfg, k) != getattr(pure, k)}


def demo_dir(cfg):
    """runs/demo-s<seed>, or runs/demo-s<seed>-<hash of the changes> when flags changed the set-up."""
    changed = changes(cfg)
    tag = "-" + hashlib.sha1(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:6] if changed else ""
    return os.path.join(os.path.expanduser(cfg.out), f"demo-s{cfg.seed}{tag}")


def rows_of(out):
    return runfiles.read_log(os.path.join(out, "log.jsonl"))


def last(rows, key):
    return next((r[key] for r in reversed(rows) if key in r), float("nan"))


DIAGNOSTICS = ("token_entropy", "think_len", "seq_rep4", "mi", "retrieval", "retrieval_chance", "mi_zscore_ema",
               "mi_turn", "retrieval_turn", "retrieval_turn_chance")  # in both tables (the last three: --mi-any-turn)


def readings(rows):
    """A run's last reading of each diagnostic and its totals over the log: the demo's table and --plot's."""
    return dict({k: last(rows, k) for k in ("eval_success",) + DIAGNOSTICS},
                kept=sum(r["kept_frac"] for r in rows) / len(rows), skipped=sum(r.get("skipped", 0) for r in rows),
                alarm="fired" if any(r.get("alarm") for r in rows) else "quiet")


def sample_reasonings(model, tok, cfg, seeds):
    """One first-turn reasoning per seed at the evaluation temperature."""
    torch.manual_seed(0)
    eps = rm.rollout(model, tok, cfg, seeds, 1, cfg.eval_temperature)
    return ["".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in e["first_think"].strip()) for e in eps]  # no raw control bytes


HELDOUT_MAPS, HELDOUT_BATCHES = 32, 4  # the fixed held-out batches that score every model's MI: 4 x 32 maps


def heldout_mi(model, tok, cfg):
    """The MI proxies on fixed held-out batches, the same maps and sampling noise for every model: each batch is
    HELDOUT_MAPS maps x G samples at the training temperature; -> the mean over HELDOUT_BATCHES disjoint batches,
    so a final reading is not one noisy 8-map training batch (on the README's runs the batches of one model
    span 4-6 points)."""
    out = []
    for k in range(HELDOUT_BATCHES):
        torch.manual_seed(k)
        eps = rm.rollout(model, tok, cfg, [10**6 + k * HELDOUT_MAPS + i for i in range(HELDOUT_MAPS)], cfg.group_size, cfg.temperature)
        out.append(rm.diagnostics(model, tok, eps, cfg.group_size, rm.metrics.ZScoreEMA(), cfg.temperature))
    out = [d for d in out if "mi" in d]  # a batch with no reasoning (or one distinct prompt) has no MI proxies
    return {key: sum(d[key] for d in out) / len(out) if out else float("nan") for key in ("mi", "retrieval", "retrieval_chance")}


@torch.no_grad()
def follows_reasoning(model, tok, cfg, n=64):
    """Does the answer still read the reasoning? Teacher-force map k's expert reasoning under map j's prompt
    (j != k, different expert moves) and count how often the greedy answer is map k's move, not map j's."""
    env_j, env_k, chat = rm.make_env(cfg), rm.make_env(cfg), None
    hits = tot = own = 0
    for i in range(n):
        env_j.reset(10**6 + i)
        env_k.reset(10**6 + n + i)
        (_, a_j), (z_k, a_k) = env_j.expert(), env_k.expert()
        if a_j == a_k:
            continue
        chat = chat or rm.Chat(tok, env_j.instruction)
        prompt = chat.first(rm.user_turn(1, env_j.render(), env_j.max_turns)) + chat.encode(f" {z_k} </think> <answer>")
        new, _, _, _ = rm.generate(model, [prompt], 6, 0.0, tok.eos_token_id, tok.pad_token_id)
        answer = tok.decode(new[0], skip_special_tokens=True).split("</answer>")[0].strip().lower()
        hits, own, tot = hits + (answer == a_k), own + (answer == a_j), tot + 1
    return hits / max(tot, 1), own / max(tot, 1)


def bucket_norms(rows):
    """Per reward-variance bucket, the task / entropy / KL gradient norm over the logged steps where the buckets
    differ (top bucket with spread; once every group has zero variance the buckets are an arbitrary split): its
    mean and standard error, and a paired max/min ratio that compares the buckets within each step, since the
    norms grow several-fold over a run and the means mix that in: g_b = geometric mean over steps of
    norm_b / (mean over buckets of norm), then max g / min g (None without a step where every bucket's norm > 0).
    -> ({name: [mean per bucket]}, {name: [s.e. per bucket]}, {name: paired ratio}, number of steps)"""
    rows = [r for r in rows if "gn_task_b0" in r and r.get("rv_b2", 0) > 0]  # (no rv_b2: under 3 groups, no top bucket)
    mean, se, paired = {}, {}, {}
    for name in ["task", "entropy", "kl"]:
        cols = [[r[f"gn_{name}_b{b}"] for r in rows] for b in range(3)]  # [bucket][step]
        mean[name] = [statistics.fmean(c) if c else 0.0 for c in cols]
        se[name] = [statistics.stdev(c) / len(c) ** 0.5 if len(c) > 1 else 0.0 for c in cols]
        steps = [n for n in zip(*cols) if min(n) > 0]  # each step's three norms, where none is zero
        g = [statistics.geometric_mean(3 * n[b] / sum(n) for n in steps) for b in range(3)] if steps and name != "task" else None
        paired[name] = max(g) / min(g) if g else None  # regularisers only: the task norm is meant to differ
    return mean, se, paired, len(rows)


def plot(runs, path, eval_start, eval_temperature=0.5):
    """The runs' curves ({label: log rows}) in one PNG at path; eval_start: {label: the start model's evaluation or
    None}. -> False (and a message) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no figure; plot from the JSONL logs instead")
        return False
    keys = [("eval_success", "eval success" + (f" (T={eval_temperature:g})" if eval_temperature is not None else "")), ("token_entropy", "reasoning token entropy"),
            ("mi", "MI estimate (nats)"), ("retrieval", "retrieval accuracy"), ("kept_frac", "kept fraction")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (k, title) in zip(axes.flat, keys):
        for label, rows in runs.items():
            # x = updates done: a step's diagnostics come before its update, its evaluation after it
            pts = [(r["step"] + (k == "eval_success"), r[k]) for r in rows if k in r]
            pts = ([(0, eval_start[label])] if k == "eval_success" and eval_start[label] is not None else []) + pts
            ax.plot(*zip(*pts), label=label, marker="." if k == "eval_success" else None)
        if k == "retrieval" and math.isfinite(chance := last(runs[next(iter(runs))], "retrieval_chance")):  # nan: no MI
            ax.axhline(chance, color="grey", ls=":", label="chance")
        ax.set_title(title); ax.set_xlabel("updates")
    next((a for a in axes.flat if a.lines), axes.flat[0]).legend()  # (no run evaluated yet: on the next panel)
    ax, first = axes.flat[5], next(iter(runs))  # gradient norms by reward-variance bucket, over the first run's logged steps
    norms, se, _, n = bucket_norms(runs[first])
    for i, (name, vals) in enumerate(norms.items() if n else []):  # error bars: standard error over the logged steps
        ax.bar([b + 0.27 * (i - 1) for b in range(3)], vals, yerr=se[name], capsize=2, width=0.27, label=name)
    if n:
        ax.set_xticks(range(3), ["low RV", "mid RV", "high RV"]); ax.set_title(f"gradient norm by reward-variance bucket: {os.path.basename(first)}")
        ax.legend()
    else:  # the first run did not log them (--gradnorm-every 0, the default outside the demo): the batches' success
        for label, rows in runs.items():
            ax.plot([r["step"] for r in rows], [r["success"] for r in rows], label=label, lw=0.8)
        ax.set_title("success on the training batches"); ax.set_xlabel("updates")
    fig.tight_layout(); fig.savefig(path, dpi=90)
    return True


def plot_runs(cfg):
    """`--plot RUN,RUN,...`: any runs' curves in one figure, OUT/plot.png (success, entropy, MI, retrieval, kept
    fraction, and the first run's gradient buckets if it logged them), and their last readings as a table: an MI
    dashboard to compare, e.g., --filter none with --filter snr on your own task. It reads their log.jsonl, and the
    start's evaluation from their ckpt.pt."""
    runs = {run: rows_of(run) for run in runfiles.plotted(cfg)}  # parse_args checked each has rows
    start = {run: start_eval(run) for run in runs}
    print("| run | steps | success (last 10 steps) | eval: start -> last | token entropy | reasoning tokens | repetition | "
          "MI estimate | retrieval (chance) | kept fraction | skipped | alarm |\n" + "|---" * 12 + "|")
    for run, rows in runs.items():  # the last reading of each diagnostic, as in the demo's table
        s = readings(rows)
        print(f"| {run} | {len(rows)} | {statistics.fmean(r['success'] for r in rows[-10:]):.3f} | {float('nan') if start[run] is None else start[run]:.3f} -> {s['eval_success']:.3f} | "
              f"{s['token_entropy']:.3f} | {s['think_len']:.1f} | {s['seq_rep4']:.3f} | {s['mi']:.3f} | {s['retrieval']:.3f} ({s['retrieval_chance']:.3f}) | "
              f"{s['kept']:.3f} | {s['skipped']} | {s['alarm']} |")
    out = os.path.expanduser(cfg.out)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "plot.png")
    if plot(runs, path, start, eval_temperature=None):
        print(f"figure: {path}")


def start_eval(run):
    """A run's evaluation before its first update, kept in its checkpoint's state (not in the log); None if unreadable.
    mmap: a real model's checkpoint is read for this number without loading its weights."""
    try:
        return torch.load(os.path.join(run, "ckpt.pt"), map_location="cpu", mmap=True, weights_only=True)["state"]["eval0"]
    except Exception:  # no checkpoint yet (a run stopped before --save-every steps), or an older format
        return None


def exit_with(parent):
    """End this worker once the demo's process `parent` is gone, however it went: a SIGKILL or SIGTERM runs none of
    the parent's clean-up, and an orphan would train on, holding its run folder. Its last checkpoint stays."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def train_arm(cfg, threads, conn, parent):
    """One run of the demo in a worker process: `threads` torch threads; quiet but for the collapse alarm and notes.
    Sends ("ok", summary) or ("error", message) back through conn."""
    threading.Thread(target=exit_with, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)  # SIGINT is ignored here from the start (Arm): ^C is the parent's, which stops the workers
    try:
        conn.send(("ok", rm.train(cfg, quiet=True)[0]))
    except Exception as e:
        conn.send(("error", f"run {cfg.name}: {type(e).__name__}: {e}"))


class Arm:
    """A demo run in its own process (spawned: a fresh interpreter). result() returns its summary, or raises its
    error, or says that its process died (killed, out of memory): a lost worker never leaves the demo waiting."""

    def __init__(self, ctx, cfg, threads):
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc, self.name, self.out = ctx.Process(target=train_arm, args=(cfg, threads, child, os.getpid()), daemon=True), cfg.name, None
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child inherits ^C ignored, from its first line on
        try:                                                     # (while it imports torch a ^C printed its traceback)
            self.proc.start()
        finally:
            signal.signal(signal.SIGINT, sigint)
        child.close()

    def ready(self):
        return self.out is not None or self.conn.poll() or not self.proc.is_alive()

    def result(self):
        if self.out is None and self.conn.poll():
            try:
                self.out = self.conn.recv()
            except EOFError:  # the pipe closed without a message: the process died
                pass
        if self.out is None:
            self.proc.join(5)  # it has ended without a word
            raise RuntimeError(f"run {self.name}: its process died (exit code {self.proc.exitcode}); rerun the command to resume it")
        if self.out[0] == "error":
            raise RuntimeError(self.out[1])
        return self.out[1]


def wait_for(arms, running, cfgs, every=30):
    """Block until `arms` have ended, printing one status line from the runs' logs every `every` seconds. A run of
    `running` that fails raises at once, rather than after the others have run for minutes."""
    while True:
        ready = {id(r): r.ready() for r in arms + running}  # one reading: an arm that ends between two would slip by
        for r in running:
            if ready[id(r)]:
                r.result()  # raises if the run failed or its process died
        if all(ready[id(r)] for r in arms):
            return
        waited = {id(r): r for r in running + arms if not ready[id(r)]}.values()  # any run's end or failure wakes it
        multiprocessing.connection.wait([x for r in waited for x in (r.conn, r.proc.sentinel)], every)
        parts = []
        for c in cfgs:
            rows = rows_of(runfiles.run_dir(c))  # complete lines only: the run may be writing its next one
            parts.append(f"{c.name} step {len(rows)}/{c.steps}" + (f" success {rows[-1]['success']:.2f} MI {last(rows, 'mi'):.2f}" if rows else ""))
        print(" | ".join(parts), flush=True)


def run_all(a, b, c, parallel):
    """(a), (b), then (c), which reads (b)'s kept fractions. On a CPU (parallel) (a) and (b) run side by side and
    (c) starts when (b) has ended well, each process on half the threads: on a 2-core CPU that saves the overlap, a
    minute or two against the runs one after another (README "The demo"). -> their summaries."""
    if not parallel:
        return [rm.train(x)[0] for x in (a, b, c)]
    threads = max(1, torch.get_num_threads() // 2)
    print(f"(a) and (b) side by side, then (c) once (b) is done, {threads} thread(s) each; progress every 30 s:")
    ctx, arms = multiprocessing.get_context("spawn"), []
    try:
        arms += [Arm(ctx, x, threads) for x in (a, b)]
        wait_for(arms[1:], arms, [a, b])  # raises if (b) failed: (c) must not scale its regularisers by a half-written log
        arms.append(Arm(ctx, c, threads))
        wait_for([arms[0], arms[2]], arms, [a, b, c])
        return [r.result() for r in arms]
    finally:  # on ^C or an error, stop the workers at once (their last checkpoints stay); else they have exited
        for r in arms:
            if r.proc.is_alive():
                r.proc.terminate()
            r.proc.join()


def main(cfg):
    out, changed = demo_dir(cfg), changes(cfg)
    base = dataclasses.replace(demo_config(cfg), out=out)
    if changed:
        print("the demo with your flags over its set-up: " + " ".join(f"{k}={v}" for k, v in changed.items()) + f" -> {out}")
    t0 = time.time()
    a = dataclasses.replace(base, filter="none", name="a_no_filter")
    # the gradient buckets are measured in (a) only: they change no trained value, and in (b) and (c), whose
    # runs one after the other set the demo's wall-clock, they cost about a quarter of the time
    b = dataclasses.replace(base, filter="snr", name="b_snr_filter", gradnorm_every=0)
    c = dataclasses.replace(base, filter="none", name="c_control", gradnorm_every=0,
                            reg_scale_from=os.path.join(out, "b_snr_filter", "log.jsonl"))
    device = rm.pick_device(base.device)
    start, tok = rm.load_policy(base, device)  # the warm start: built (or read from the cache) once, for all three runs
    labels = ["(a) no filter", "(b) SNR filter", "(c) control"]
    try:
        summaries = run_all(a, b, c, parallel=device.type == "cpu" and torch.get_num_threads() >= 2)
    except RuntimeError as e:  # a run failed, or its process died: one line; every run's last checkpoint stays
        sys.exit(f"error: {e}")
    models, runs, times, maps = {}, {}, {}, {}
    for label, summary in zip(labels, summaries):
        models[label] = copy.deepcopy(start)  # the run's final weights, from its last checkpoint
        ckpt = torch.load(os.path.join(summary["out"], "ckpt.pt"), map_location=device, weights_only=False)
        models[label].load_state_dict(ckpt["model"])
        maps["warm start"], maps[label] = ckpt["state"].get("maps0"), ckpt["state"].get("maps")  # per held-out map: solved?
        runs[label], times[label], eval_start = rows_of(summary["out"]), summary["sec"], summary["eval_start"]
    held = {k: heldout_mi(m, tok, base) for k, m in [("warm start", start)] + list(models.items())}
    first = next((r for r in runs["(a) no filter"] if "mi" in r), {})  # the first diagnostics, at step 0 unless it had none
    table = ["| | warm start | " + " | ".join(runs) + " |", "|---" * (len(runs) + 2) + "|"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    stats = {"warm start": dict(eval_success=eval_start, **{k: first.get(k, float("nan")) for k in DIAGNOSTICS},
                                kept="-", skipped="-", alarm="-", sec="-")}
    for label, rows in runs.items():
        stats[label] = readings(rows) | dict(sec=f"{times[label]:.0f}s")
    for label, s in stats.items():
        h = held[label]  # the same held-out batches for every model
        s |= dict(ret=s["retrieval"] - s["retrieval_chance"], mi_held=h["mi"], ret_held=h["retrieval"] - h["retrieval_chance"],
                  ret_turn=s["retrieval_turn"] - s["retrieval_turn_chance"])
    names = [("eval_success", f"eval success ({base.eval_episodes} held-out maps, T={base.eval_temperature:g})"), ("token_entropy", "reasoning token entropy"),
             ("think_len", "reasoning length (tokens, first turn)"), ("seq_rep4", "repetition inside a reasoning (seq-rep-4)"),
             ("mi", "MI estimate (nats)"), ("ret", "retrieval accuracy above chance"),
             ("mi_held", f"MI estimate, held-out batches (mean of {HELDOUT_BATCHES} x {HELDOUT_MAPS} maps x {base.group_size})"),
             ("ret_held", "retrieval above chance, held-out batches"),
             *([("mi_turn", "MI estimate, a turn drawn per episode (--mi-any-turn)"),
                ("ret_turn", "retrieval above chance, a turn drawn per episode")] if base.mi_any_turn else []),
             ("mi_zscore_ema", "MI z-score (EMA)"),
             ("kept", "mean kept fraction"), ("skipped", "skipped steps"), ("alarm", "collapse alarm"), ("sec", "wall-clock")]
    for key, title in names:
        table.append(f"| {title} | " + " | ".join(fmt(s[key]) for s in stats.values()) + " |")
    duels = [("(b) SNR filter", "(a) no filter"), ("(b) SNR filter", "(c) control")] + [(k, "warm start") for k in labels]
    lines = [f"\nfinal evaluations, map by map (the same {base.eval_episodes} held-out maps and sampling seed for every model):"]
    for x, y in duels:
        if maps[x] and maps[y]:  # none in a run checkpointed before the maps were kept
            won, lost = sum(p and not q for p, q in zip(maps[x], maps[y])), sum(q and not p for p, q in zip(maps[x], maps[y]))
            lines.append(f"  {x} solves {won} maps that {y} fails and fails {lost} that it solves: sign test p = "
                         f"{rm.metrics.sign_test(won, lost):.2g}")
    norms, se, paired, n = bucket_norms(runs["(a) no filter"])
    lines += [f"\ngradient norms by reward-variance bucket, run (a), mean +- standard error over the {n} logged steps whose top bucket "
              "has reward spread; max/min of the means, and paired (buckets compared within each step, see demo.bucket_norms)"
              + ("; task: the norm the rewards' advantages would give, which --reg-only zeroes in the update" if base.reg_only else "") + ":"]
    lines += [f"  {name:8s} " + "  ".join(f"b{b}={v:.4f}+-{e:.4f}" for b, (v, e) in enumerate(zip(vals, se[name])))
              + (f"  max/min {max(vals) / min(vals):.2f}x" if min(vals) > 0 else "")
              + (f"  paired {paired[name]:.2f}x" if paired[name] else "") for name, vals in norms.items()]
    # what collapse looks like: the same maps, reasoning from each model; and does the answer read the reasoning?
    seeds = [10**6 + i for i in range(4)]
    samples = {"warm start": sample_reasonings(start, tok, base, seeds)} | {k: sample_reasonings(m, tok, base, seeds) for k, m in models.items()}
    env, text = rm.make_env(base), []
    for i, s in enumerate(seeds):
        text.append(f"--- map {s} ---\n{env.reset(s)}\nexpert: {env.expert()[0]}")
        text += [f"{k:>16}: {v[i][:150]}" for k, v in samples.items()]
    text.append("\nanswer follows a teacher-forced reasoning from another map (follow rate / own-map rate):")
    for k, m in [("warm start", start)] + list(models.items()):
        f, o = follows_reasoning(m, tok, base)
        text.append(f"{k:>16}: {f:.2f} / {o:.2f}")
    report = "\n".join(table + lines) + "\n\n" + "\n".join(text)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(report + "\n")
    png = plot(runs, os.path.join(out, "demo.png"), dict.fromkeys(runs, eval_start), base.eval_temperature)
    print("\n" + report)
    print(f"\ndemo finished in {time.time() - t0:.0f}s; written to {out}/" + (" (table.md, demo.png)" if png else " (table.md)"))
    if not png:  # said again here, where it is seen: the report above scrolled the first word away
        print(f"no figure: pip install matplotlib and rerun the same command (nothing retrains), or plot step against "
              f"eval_success, token_entropy, mi, retrieval, gn_*_b* from {out}/{{a_no_filter,b_snr_filter,c_control}}/log.jsonl")
