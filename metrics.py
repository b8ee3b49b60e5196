"""Mutual-information proxies for template collapse (RAGEN-2, section 2).

Pure tensor code: torch only, no I/O, no training. Notation: M prompts x_j, N reasonings z_i, and
L[i, j] = log p(z_i | x_j) (sum or per-token mean over the reasoning tokens). Row i's own prompt is col[i].
"""
import copy
import inspect
import math

import torch
import torch.nn.functional as F

_ROWS = 4096  # logits rows turned into float32 log-probs at a time (bounds memory for large vocabularies)


def entropy(logp):
    """H = -sum_v p_v log p_v with p = exp(logp); a -inf log-prob (p = 0) contributes 0, not NaN."""
    logp = logp.clamp_min(torch.finfo(logp.dtype).min)
    return -(logp.exp() * logp).sum(-1)


def token_entropy(logits, mask):
    """Mean next-token entropy over masked positions, at temperature 1 (the tests' reference; the logged
    `token_entropy` is cross_score's, at the sampling temperature).

    H_t = -sum_v softmax(l_t)_v * log_softmax(l_t)_v, from the full softmax in float32;
    result = sum_t mask_t H_t / sum_t mask_t. logits [B,T,V], mask [B,T] bool or 0/1.
    Unmasked positions are never read (garbage there is harmless). Differentiable w.r.t. logits.
    An all-zero mask gives 0.0 (a constant, no gradient) rather than NaN.
    """
    rows = logits[mask.bool()].float()  # [K, V]
    if rows.shape[0] == 0:
        return torch.zeros((), device=logits.device)
    return entropy(F.log_softmax(rows, dim=-1)).mean()


def seq_rep(seqs, n=4):
    """Repetition within a sequence, seq-rep-n (Welleck et al., 2019, "Neural text generation with unlikelihood
    training"): 1 - |distinct n-grams| / |n-grams| of each token list, averaged over the lists. 0: no n-gram occurs
    twice in one list; -> 1: a list that repeats one token or one short pattern ("! ! ! ! ..."). A list of fewer
    than n + 1 tokens cannot repeat an n-gram and counts 0; no lists at all give 0.0."""
    reps = []
    for s in seqs:
        grams = [tuple(s[i:i + n]) for i in range(len(s) - n + 1)]  # the len(s) - n + 1 n-grams of s, in order
        reps.append(1 - len(set(grams)) / len(grams) if grams else 0.0)
    return sum(reps) / len(reps) if reps else 0.0


def _model_device(model):
    for t in list(model.parameters())[:1] + list(model.buffers())[:1]:
        return t.device
    return torch.device("cpu")


def _pad(seqs, pad_id):
    """Right-pad token-id lists: (ids [B, T] filled with pad_id, attention_mask [B, T] of 0/1); T >= 1."""
    ids = torch.full((len(seqs), max(1, *map(len, seqs))), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], att[b, :len(s)] = torch.tensor(s, dtype=torch.long), 1
    return ids, att


def _span_logp(logits, spans, ent, temperature=1.0):
    """spans[b] = (start, z, own): logits[b, start + k] / temperature predicts token z[k]. Returns sum_k log p(z[k])
    per row b ([B] float32, CPU); for rows with own set, adds their next-token entropies to ent = [sum, count].
    Only the rows that predict a token go through the float32 log_softmax, _ROWS at a time."""
    dev = logits.device
    b_idx = torch.tensor([b for b, (_, z, _) in enumerate(spans) for _ in z], device=dev)
    pos = torch.tensor([s + k for s, z, _ in spans for k in range(len(z))], device=dev)
    tgt = torch.tensor([t for _, z, _ in spans for t in z], device=dev)
    own_m = torch.tensor([o for _, z, o in spans for _ in z], device=dev)
    pair_sum = torch.zeros(len(spans), device=dev)
    for s in range(0, len(tgt), _ROWS):
        sl = slice(s, s + _ROWS)
        logp = F.log_softmax(logits[b_idx[sl], pos[sl]].float() / temperature, dim=-1)  # [K, V]
        pair_sum.index_add_(0, b_idx[sl], logp.gather(1, tgt[sl, None]).squeeze(1))
        if own_m[sl].any():
            ent[0] += entropy(logp[own_m[sl]]).sum().double().cpu()
            ent[1] += int(own_m[sl].sum())
    return pair_sum.cpu()


def cross_score(model, prompts, reasons, pad_id, matched=None, batch_size=256, temperature=1.0):
    """Teacher-force every reasoning under every prompt, scored by the policy as it samples (logits / temperature).

    L_sum[i, j]  = sum_k log p(z_i,k | x_j, z_i,<k)      (float32 log-softmax of the model's logits / temperature)
    L_mean[i, j] = L_sum[i, j] / |z_i|
    entropy      = mean over the reasoning tokens of the matched pairs (i, matched[i]) of the full-softmax
                   next-token entropy (token-weighted, as token_entropy); None if matched is None or those
                   pairs hold no tokens.
    prompts: M token-id lists (each ends with the prefilled <think> tokens; must be non-empty);
    reasons: N token-id lists (reasoning only, no tags). An empty reasoning is never run through the model:
    its row is L_sum = L_mean = 0 and it adds nothing to the entropy.
    Prefix sharing (when the forward takes past_key_values, position_ids and use_cache, as HF causal LMs do):
    prompts are long and reasonings short, so each prompt x_j is run once (all in one left-padded batch,
    use_cache=True); its KV cache is repeated over chunks of batch_size (reasoning, prompt) pairs (sorted by
    length, right-padded with pad_id), which are run with past_key_values=, an attention_mask over prompt +
    reasoning and position_ids |x_j| + k.
    The prompt's last logits predict z_i,0. This costs M prompt passes + N*M short passes instead of N*M full ones,
    M counting identical prompts once (--mi-any-turn's contexts: a first turn's is its group's).
    Otherwise (plain path) the pairs [x_j ; z_i] are sorted by length and run whole in chunks of batch_size,
    right-padded with an attention_mask (default arange position ids are then right), calling
    model(input_ids=, attention_mask=); if the forward takes `logits_to_keep` only the trailing positions
    that predict reasoning tokens are projected to the vocabulary.
    Runs under inference_mode and in eval mode (the model's mode is restored after). Only rows that predict
    reasoning tokens go through log_softmax. Returns L_sum, L_mean as [N, M] float32 CPU tensors.
    """
    M, N = len(prompts), len(reasons)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("cross_score: every prompt needs at least one token")
    if matched is not None and len(matched) != N:
        raise ValueError("cross_score: matched needs one column per reasoning")
    uniq = {u: k for k, u in enumerate(dict.fromkeys(map(tuple, prompts)))}
    if len(uniq) < M:  # identical prompts score alike: each distinct one is scored once, its column then copied
        col = [uniq[tuple(p)] for p in prompts]
        out = cross_score(model, [list(u) for u in uniq], reasons, pad_id, matched and [col[m] for m in matched],
                          batch_size, temperature)
        return dict(out, L_sum=out["L_sum"][:, col], L_mean=out["L_mean"][:, col])
    dev = _model_device(model)
    params = inspect.signature(model.forward).parameters
    keep_ok = "logits_to_keep" in params
    L_sum = torch.zeros(N, M)
    ent = [torch.zeros((), dtype=torch.float64), 0]
    own = lambda i, j: matched is not None and matched[i] == j  # noqa: E731
    rows = sorted((i for i in range(N) if reasons[i]), key=lambda i: len(reasons[i]))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if {"past_key_values", "position_ids", "use_cache"} <= params.keys():  # prefix sharing
                P, Pm = (t.flip(1).to(dev) for t in _pad([p[::-1] for p in prompts], pad_id))  # left-padded
                lp = Pm.sum(1)
                pre = model(input_ids=P, attention_mask=Pm, position_ids=(Pm.cumsum(1) - 1).clamp_min(0),
                            use_cache=True, **({"logits_to_keep": 1} if keep_ok else {}))
                pairs = sorted(((i, j) for i in rows for j in range(M)), key=lambda ij: len(reasons[ij[0]]))
                for c in range(0, len(pairs), batch_size):
                    chunk = pairs[c:c + batch_size]
                    r, js = (list(t) for t in zip(*chunk))
                    ids, att = _pad([reasons[i][:-1] for i in r], pad_id)  # a last token predicts nothing
                    cache = copy.deepcopy(pre.past_key_values)  # the forward appends to it in place
                    cache.batch_select_indices(torch.tensor(js, device=dev))
                    logits = model(input_ids=ids.to(dev), past_key_values=cache, use_cache=True,
                                   attention_mask=torch.cat([Pm[js], att.to(dev)], 1),
                                   position_ids=lp[js, None] + torch.arange(ids.shape[1], device=dev)).logits
                    logits = torch.cat([pre.logits[js, -1:], logits], 1)  # k predicts z_k
                    L_sum[r, js] = _span_logp(logits, [(0, reasons[i], own(i, j)) for i, j in chunk], ent, temperature)
            else:
                pairs = sorted(((i, j) for i in rows for j in range(M)),
                               key=lambda ij: (len(prompts[ij[1]]), len(reasons[ij[0]])))
                for c in range(0, len(pairs), batch_size):
                    chunk = pairs[c:c + batch_size]
                    ids, att = _pad([prompts[j] + reasons[i] for i, j in chunk], pad_id)
                    T = ids.shape[1]
                    kw = {"logits_to_keep": T - min(len(prompts[j]) for _, j in chunk) + 1} if keep_ok else {}
                    logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev), **kw).logits
                    off = T - logits.shape[1]  # positions dropped in front by logits_to_keep
                    # position |x_j| + k - 1 predicts reasoning token k
                    spans = [(len(prompts[j]) - 1 - off, reasons[i], own(i, j)) for i, j in chunk]
                    r, cl = zip(*chunk)
                    L_sum[list(r), list(cl)] = _span_logp(logits, spans, ent, temperature)
    finally:
        model.train(was_training)
    lens = torch.tensor([max(len(z), 1) for z in reasons], dtype=torch.float32)
    entropy = float(ent[0] / ent[1]) if ent[1] else None
    return dict(L_sum=L_sum, L_mean=L_sum / lens[:, None], entropy=entropy)


def mi_metrics(L, col, keys, tie_tol=1e-6):
    """MI proxies from a cross-score matrix L [N, M] (either flavour), computed in float64.

    matched_i  = L[i, col_i];   marginal_i = logsumexp_j L[i, j] - log M
    mi         = mean(matched) - mean(marginal)                      (<= log M)
    h_cond     = -mean(matched);  h_marg = -mean(marginal)
    mi_zscore  = mean((matched - marginal) / (std(marginal) + 1e-3)), std over the batch, population (ddof 0)
    retrieval_acc = mean_i of (#tied row maxima whose key == keys[col_i]) / (#tied row maxima); a value
        counts as tied when within tie_tol * max(1, |row max|) of the row max, so an input-ignoring policy
        (constant rows, up to float noise) scores exactly chance
    retrieval_chance = mean_i (#columns j with keys[j] == keys[col_i]) / M
    Columns with equal keys (identical prompt text) count as the same prompt for retrieval.
    Also returns the per-row tensors "matched", "marginal" (detached, float64) for ZScoreEMA.
    """
    L = L.detach().double()
    N, M = L.shape
    col = torch.as_tensor(col, dtype=torch.long, device=L.device)
    matched = L[torch.arange(N, device=L.device), col]
    marginal = torch.logsumexp(L, dim=1) - math.log(M)
    kid = {k: n for n, k in enumerate(dict.fromkeys(keys))}
    kid = torch.tensor([kid[k] for k in keys], device=L.device)
    same = kid[None, :] == kid[col][:, None]  # [N, M]: column j shows row i's own prompt text
    top = L.max(dim=1, keepdim=True).values
    tied = L >= top - tie_tol * top.abs().clamp_min(1.0)
    gap = matched - marginal
    return dict(
        mi=float(gap.mean()),
        retrieval_acc=float(((tied & same).sum(1).double() / tied.sum(1)).mean()),
        retrieval_chance=float(same.double().mean(1).mean()),
        h_cond=float(-matched.mean()),
        h_marg=float(-marginal.mean()),
        mi_zscore=float((gap / (marginal.std(correction=0) + 1e-3)).mean()),
        matched=matched, marginal=marginal,
    )


class ZScoreEMA:
    """MI z-score with an EMA of the batch std of marginal across readings (the loop reads every --diag-every steps).

    s_1 = std(marginal_1); s_t = decay * s_{t-1} + (1 - decay) * std(marginal_t)   (population std)
    update() returns mean((matched - marginal) / (s_t + eps)). An empty batch, or one with a non-finite entry,
    returns NaN and leaves the state unchanged (one bad reading would otherwise make every later one NaN).
    """

    def __init__(self, decay=0.9, eps=1e-3):
        self.decay, self.eps, self.std = decay, eps, None

    def update(self, matched, marginal):
        matched, marginal = torch.as_tensor(matched).double(), torch.as_tensor(marginal).double()
        if marginal.numel() == 0 or not (torch.isfinite(matched).all() and torch.isfinite(marginal).all()):
            return float("nan")
        new = float(marginal.std(correction=0))
        self.std = new if self.std is None else self.decay * self.std + (1 - self.decay) * new
        return float(((matched - marginal) / (self.std + self.eps)).mean())

    def state_dict(self):
        return {"std": self.std, "decay": self.decay, "eps": self.eps}

    def load_state_dict(self, state):
        self.std, self.decay, self.eps = state["std"], state["decay"], state["eps"]


def variance_buckets(scores, n_buckets):
    """Split group indices 0..P-1 into n_buckets equal-count quantile buckets by score (e.g. reward variance).

    Indices are sorted ascending by score (stable: ties keep index order); bucket b gets the next
    P // n_buckets indices, the first P % n_buckets buckets one extra (buckets may be empty if P < n_buckets).
    Bucket 0 holds the lowest scores.
    """
    s = torch.as_tensor(scores, dtype=torch.float64).tolist()
    order = sorted(range(len(s)), key=s.__getitem__)
    q, r = divmod(len(order), n_buckets)
    out, start = [], 0
    for b in range(n_buckets):
        n = q + (b < r)
        out.append(order[start:start + n])
        start += n
    return out


def grad_norms(terms, params):
    """{name: ||d term / d params||_2} for each scalar term, each by its own backward pass (no optimizer step, the
    .grad fields untouched). A term that does not depend on the parameters (e.g. a KL of coefficient 0) gives 0."""
    out = {}
    for name, term in terms.items():
        grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True) if term.requires_grad else []
        out[name] = math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))
    return out


def sign_test(gained, lost):
    """Two-sided exact sign test (McNemar's test on the discordant pairs) for a paired before/after comparison:
    on the same items, `gained` went from fail to success and `lost` from success to fail. Under "no change" each
    discordant item is either with probability 1/2: p = min(1, 2 * P[Binomial(gained + lost, 1/2) <= min(gained, lost)])."""
    n, k = gained + lost, min(gained, lost)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
