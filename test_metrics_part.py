"""Closed-form and brute-force checks for metrics.py (fast, CPU)."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from metrics import ZScoreEMA, cross_score, mi_metrics, token_entropy, variance_buckets


# ---------------------------------------------------------------- token_entropy
def test_token_entropy_uniform_and_peaked():
    V = 7
    assert token_entropy(torch.zeros(2, 3, V), torch.ones(2, 3)).item() == pytest.approx(math.log(V), abs=1e-6)
    peaked = torch.full((2, 3, V), -1e4)
    peaked[..., 2] = 1e4
    assert token_entropy(peaked, torch.ones(2, 3, dtype=torch.bool)).item() == pytest.approx(0.0, abs=1e-6)


def test_token_entropy_mask_respected():
    logits = torch.zeros(1, 3, 4)
    logits[0, 1] = torch.tensor([float("nan"), float("inf"), 5.0, -3.0])  # garbage at a masked-out slot
    mask = torch.tensor([[1, 0, 1]])
    assert token_entropy(logits, mask).item() == pytest.approx(math.log(4), abs=1e-6)
    assert token_entropy(logits, torch.zeros(1, 3)).item() == 0.0  # empty mask: 0, not NaN


def test_token_entropy_hand_computed():
    # token 1: p = (1/2, 1/2) -> log 2; token 2: logits (log 3, 0) -> p = (3/4, 1/4)
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert token_entropy(logits, torch.ones(1, 2)).item() == pytest.approx((math.log(2) + h2) / 2, abs=1e-6)


def test_token_entropy_neg_inf_logits_and_grad():
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]], requires_grad=True)
    h = token_entropy(logits, torch.ones(1, 1))
    assert h.item() == pytest.approx(math.log(2), abs=1e-6)
    h.backward()
    assert torch.isfinite(logits.grad).all()


# ---------------------------------------------------------------- mi_metrics
def test_mi_constant_rows_is_chance():
    L = torch.full((6, 4), -3.7)
    L[2] = -1.25  # rows may differ from each other; each row is constant across prompts
    r = mi_metrics(L, torch.tensor([0, 1, 2, 3, 0, 1]), ["a", "b", "c", "d"])
    assert abs(r["mi"]) < 1e-6 and abs(r["mi_zscore"]) < 1e-6
    assert r["retrieval_acc"] == r["retrieval_chance"] == 0.25


def test_mi_deterministic_is_log_m():
    M, col = 5, torch.tensor([0, 1, 2, 3, 4, 2, 0])
    L = torch.full((7, M), -1e4)
    L[torch.arange(7), col] = 0.0
    r = mi_metrics(L, col, list(range(M)))
    assert r["mi"] == pytest.approx(math.log(M), abs=1e-6)
    assert r["retrieval_acc"] == 1.0 and r["retrieval_chance"] == pytest.approx(1 / M)
    assert r["h_cond"] == 0.0 and r["h_marg"] == pytest.approx(math.log(M))


def test_mi_duplicate_keys():
    # columns 0 and 1 show the same text; 4 columns, keys x x y z
    keys = ["x", "x", "y", "z"]
    col = torch.tensor([0, 1, 2, 3])
    r = mi_metrics(torch.zeros(4, 4), col, keys)
    assert r["retrieval_chance"] == pytest.approx((2 + 2 + 1 + 1) / 4 / 4)
    assert r["retrieval_acc"] == pytest.approx(r["retrieval_chance"])
    # row 0 peaks at column 1 (same text as its own column 0): full credit
    L = torch.full((4, 4), -5.0)
    L[0, 1], L[1, 1], L[2, 2], L[3, 3] = 0.0, 0.0, 0.0, 0.0
    assert mi_metrics(L, col, keys)["retrieval_acc"] == 1.0


def test_mi_hand_computed_2x2():
    L = torch.tensor([[-1.0, -2.0], [-4.0, -3.0]])
    r = mi_metrics(L, torch.tensor([0, 0]), ["p", "q"])
    matched = torch.tensor([-1.0, -4.0], dtype=torch.float64)
    marginal = torch.tensor([math.log(math.exp(-1) + math.exp(-2)) - math.log(2),
                             math.log(math.exp(-4) + math.exp(-3)) - math.log(2)], dtype=torch.float64)
    assert r["mi"] == pytest.approx(float(matched.mean() - marginal.mean()), abs=1e-9)
    assert r["h_cond"] == pytest.approx(2.5) and r["h_marg"] == pytest.approx(float(-marginal.mean()), abs=1e-9)
    std = math.sqrt(((marginal - marginal.mean()) ** 2).mean().item())  # population std
    assert r["mi_zscore"] == pytest.approx(float(((matched - marginal) / (std + 1e-3)).mean()), abs=1e-9)
    assert r["retrieval_acc"] == 0.5 and r["retrieval_chance"] == 0.5  # row 0 right, row 1 wrong
    assert torch.allclose(r["matched"], matched) and torch.allclose(r["marginal"], marginal)


def test_mi_partial_tie_credit():
    L = torch.tensor([[0.0, 0.0, 0.0, -1.0]])  # three tied maxima, one of them is the own column
    assert mi_metrics(L, torch.tensor([1]), list("abcd"))["retrieval_acc"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------- ZScoreEMA
def test_zscore_ema():
    m1, g1 = torch.tensor([-1.0, -2.0, -4.0]), torch.tensor([-2.0, -2.5, -4.5])
    m2, g2 = torch.tensor([-1.0, -1.0]), torch.tensor([-3.0, -1.5])
    ema = ZScoreEMA()
    assert ema.update(m1, g1) == pytest.approx(mi_metrics_plain(m1, g1), abs=1e-9)
    s1, s2 = g1.double().std(correction=0).item(), 0.75  # population std of (-3, -1.5)
    s = 0.9 * s1 + 0.1 * s2
    z2 = ((2.0 / (s + 1e-3)) + (0.5 / (s + 1e-3))) / 2
    state = ema.state_dict()
    assert ema.update(m2, g2) == pytest.approx(z2, abs=1e-9)
    resumed = ZScoreEMA()
    resumed.load_state_dict(state)
    assert resumed.update(m2, g2) == pytest.approx(z2, abs=1e-9)


def mi_metrics_plain(matched, marginal):
    m, g = matched.double(), marginal.double()
    return float(((m - g) / (g.std(correction=0) + 1e-3)).mean())


def test_zscore_matches_mi_metrics_first_step():
    L = torch.tensor([[-1.0, -2.0, -0.5], [-4.0, -3.0, -3.5], [-2.0, -2.0, -1.0]])
    r = mi_metrics(L, torch.tensor([0, 1, 2]), [0, 1, 2])
    assert ZScoreEMA().update(r["matched"], r["marginal"]) == pytest.approx(r["mi_zscore"], abs=1e-12)


# ---------------------------------------------------------------- variance_buckets
def test_variance_buckets():
    assert variance_buckets([0.5, 0.0, 0.2, 0.0, 0.9], 2) == [[1, 3, 2], [0, 4]]
    assert variance_buckets(torch.tensor([3.0, 1.0, 2.0]), 3) == [[1], [2], [0]]
    assert variance_buckets([1.0], 3) == [[0], [], []]


# ---------------------------------------------------------------- cross_score
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


class PlainCall(torch.nn.Module):
    """Wrapper whose forward only takes (input_ids, attention_mask): exercises the no-logits_to_keep path."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.inner(input_ids=input_ids, attention_mask=attention_mask).logits)


def brute_force(model, prompts, reasons, matched):
    N, M = len(reasons), len(prompts)
    L = torch.zeros(N, M)
    ents = []
    with torch.no_grad():
        for i, z in enumerate(reasons):
            for j, x in enumerate(prompts):
                if not z:
                    continue
                logp = F.log_softmax(model(input_ids=torch.tensor([x + z])).logits[0].float(), -1)
                rows = logp[len(x) - 1:len(x) + len(z) - 1]
                L[i, j] = rows.gather(1, torch.tensor(z)[:, None]).sum()
                if matched[i] == j:
                    ents += (-(rows.exp() * rows).sum(-1)).tolist()
    return L, sum(ents) / len(ents)


def test_cross_score_matches_brute_force():
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(2, 32, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(n) + [1] for n in (5, 2, 9)]
    reasons = [rand(4), rand(1), [], rand(7)]
    matched = [0, 1, 2, 2]
    L_ref, ent_ref = brute_force(model, prompts, reasons, matched)
    lens = torch.tensor([4.0, 1.0, 1.0, 7.0])[:, None]
    for m, bs in ((model, 256), (model, 3), (PlainCall(model), 2), (model, 1)):
        out = cross_score(m, prompts, reasons, pad_id=0, matched=matched, batch_size=bs)
        assert torch.allclose(out["L_sum"], L_ref, atol=1e-5), bs
        assert torch.allclose(out["L_mean"], L_ref / lens, atol=1e-5)
        assert out["entropy"] == pytest.approx(ent_ref, abs=1e-5)
    assert (out["L_sum"][2] == 0).all() and (out["L_mean"][2] == 0).all()  # empty reasoning row
    assert cross_score(model, prompts, reasons, pad_id=0)["entropy"] is None
    assert cross_score(model, prompts, [[]], pad_id=0, matched=[0])["entropy"] is None  # all empty


def test_cross_score_prefix_path_matches_plain_path():
    model = tiny_llama()
    g = torch.Generator().manual_seed(4)
    rand = lambda n: torch.randint(1, 32, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(n) + [1] for n in (11, 0, 6, 17)]  # ragged, one of a single token
    reasons = [rand(n) for n in (5, 1, 0, 9, 2, 13, 1, 7, 3, 4)]
    matched = [0, 1, 2, 3, 0, 1, 2, 3, 0, 3]
    prefix_calls = []
    model.register_forward_pre_hook(lambda m, a, kw: prefix_calls.append("past_key_values" in kw), with_kwargs=True)
    new = cross_score(model, prompts, reasons, pad_id=0, matched=matched, batch_size=3)
    # per prompt: one prompt pass + ceil(9 non-empty reasonings / 3) = 3 reasoning chunks
    assert prefix_calls == [False] + [True] * 12
    ref = cross_score(PlainCall(model), prompts, reasons, pad_id=0, matched=matched, batch_size=5)
    assert torch.allclose(new["L_sum"], ref["L_sum"], atol=1e-5)
    assert torch.allclose(new["L_mean"], ref["L_mean"], atol=1e-5)
    assert new["entropy"] == pytest.approx(ref["entropy"], abs=1e-5)
    assert (new["L_sum"][2] == 0).all()


def test_cross_score_restores_train_mode():
    model = tiny_llama().train()
    cross_score(model, [[3, 1]], [[4, 5]], pad_id=0)
    assert model.training


class Bigram(torch.nn.Module):
    """Next-token logits depend only on the current token: ignores everything before <think>."""

    def __init__(self, V):
        super().__init__()
        self.W = torch.nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(2)))

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.W[input_ids])


class CopyFirst(torch.nn.Module):
    """Every next token is (almost surely) the sequence's first token: z is a function of x."""

    def forward(self, input_ids, attention_mask):
        V = 16
        logits = 30.0 * F.one_hot(input_ids[:, :1], V).float()
        return SimpleNamespace(logits=logits.expand(-1, input_ids.shape[1], -1))


def test_cross_score_end_to_end_closed_forms():
    M, think = 4, 1
    prompts = [[2 + j] + [9] * j + [think] for j in range(M)]  # distinct first tokens, ragged lengths
    col = torch.tensor([0, 1, 2, 3, 1, 2])
    g = torch.Generator().manual_seed(3)
    noise = [torch.randint(0, 16, (3 + i % 2,), generator=g).tolist() for i in range(len(col))]
    for flavour in ("L_sum", "L_mean"):
        r = mi_metrics(cross_score(Bigram(16), prompts, noise, 0, batch_size=5)[flavour], col, list(range(M)))
        assert abs(r["mi"]) < 1e-6 and abs(r["mi_zscore"]) < 1e-3
        assert r["retrieval_acc"] == pytest.approx(r["retrieval_chance"]) and r["retrieval_chance"] == 0.25
    copies = [[2 + int(c)] * 3 for c in col]
    for flavour in ("L_sum", "L_mean"):
        r = mi_metrics(cross_score(CopyFirst(), prompts, copies, 0, batch_size=5)[flavour], col, list(range(M)))
        assert r["mi"] == pytest.approx(math.log(M), abs=1e-4) and r["retrieval_acc"] == 1.0
