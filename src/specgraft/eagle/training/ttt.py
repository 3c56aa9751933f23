"""Training-time test (TTT): the head unrolled ``steps`` times over a whole sequence in one pass.

Pair ``t`` = (feature of position t, token t+1) predicts token t+2. Step 0 reads the target's fused
features; step ``i`` reads the head's own step ``i-1`` output of the *previous* position, exactly as
drafting feeds a node's output to its child. A step-``i`` query at position ``t`` stands for a node ``i``
levels below a root at ``t - i``, so it sees the step-0 keys up to ``t - i`` plus one key of each earlier
step on the diagonal (step ``j`` at position ``t - i + j``)::

    step 2, position t:     step-0 keys  k0[0 .. t-2]     (the committed prefix)
                            step-1 key   k1[t-1]          (its parent)
                            step-2 key   k2[t]            (itself)

Labels are the target's own next-token distribution (top-K, restricted to the draft vocabulary); the
loss is masked to assistant tokens whose target argmax lies in the draft vocabulary and weighted 0.8^i.
"""

from __future__ import annotations

import torch

from ..head import Eagle3Head


def _shift(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """``x`` moved ``by`` places towards higher positions along ``dim``, zero-filled (out[t] = x[t - by])."""
    if by == 0:
        return x
    n = x.shape[dim]
    pad = torch.zeros_like(x.narrow(dim, 0, min(by, n)))
    return torch.cat([pad, x.narrow(dim, 0, n - by)], dim) if by < n else torch.zeros_like(x)


def unroll(head: Eagle3Head, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``feats: [n, 3H]`` (pair features), ``tokens: [n]`` (pair tokens) -> head outputs ``[n, H]`` per step."""
    attn, layer = head.midlayer.self_attn, head.midlayer
    n = tokens.shape[0]
    pos = torch.arange(n, device=tokens.device).unsqueeze(0)
    emb = head.embed_tokens(tokens).unsqueeze(0)
    feat = head.fc(feats).unsqueeze(0)  # [1, n, H]
    t = torch.arange(n, device=tokens.device)
    keys, vals, outs = [], [], []
    for i in range(steps):
        q, k, v = attn.qkv(layer.inputs(feat, emb), pos)
        keys.append(k)
        vals.append(v)
        s0 = attn.scores(q, keys[0])  # [1, nh, n, n]
        s0 = s0.masked_fill(t.unsqueeze(0) > (t - i).unsqueeze(1), float("-inf"))
        diag, dvals = [], []
        for j in range(1, i + 1):  # step j's key at position t - i + j
            kj, vj = _shift(keys[j], i - j, 2), _shift(vals[j], i - j, 2)
            g = attn.c.num_attention_heads // attn.c.num_key_value_heads
            kj_h = kj.repeat_interleave(g, 1)  # [1, nh, n, d]
            sj = (q * kj_h).sum(-1, keepdim=True) * q.shape[-1] ** -0.5
            sj = sj.masked_fill((t < i - j).view(1, 1, n, 1), float("-inf"))
            diag.append(sj)
            dvals.append(vj.repeat_interleave(g, 1))
        p = torch.softmax(torch.cat([s0, *diag], -1).float(), -1).to(q.dtype)
        mixed = torch.matmul(p[..., :n], vals[0].repeat_interleave(attn.c.num_attention_heads // attn.c.num_key_value_heads, 1))
        for j, vj in enumerate(dvals):
            mixed = mixed + p[..., n + j : n + j + 1] * vj
        h = layer.finish(feat, attn.o_proj(mixed.transpose(1, 2).reshape(1, n, -1)))
        outs.append(h[0])
        feat = _shift(h, 1, 1)  # step i+1 at position t reads this step's output at t - 1
    return outs


def ttt_loss(head: Eagle3Head, conv: dict, steps: int, t2d_index: torch.Tensor, decay: float = 0.8):
    """Loss and per-step (correct, counted, loss sum) for one conversation.

    ``conv``: ``feats [T, 3H]``, ``ids [T]``, ``topk_ids/topk_p [T, K]`` (labels at position s predict token
    s+1; zero where not needed). ``t2d_index [V]``: draft id of each target id, -1 if absent.
    """
    ids = conv["ids"].long()
    T = ids.shape[0]
    if T < 3:
        return None, []
    n = T - 1
    outs = unroll(head, conv["feats"][:n], ids[1:], steps)
    lab_ids = t2d_index[conv["topk_ids"][1:T].long()]  # [n, K] draft ids (pair t -> labels at position t+1)
    lab_p = conv["topk_p"][1:T].float() * (lab_ids >= 0)
    top1 = lab_ids[:, 0]
    base_valid = (conv["topk_p"][1:T, 0] > 0) & (top1 >= 0)
    total, per_step = 0.0, []
    positions = torch.arange(n)
    for i, h in enumerate(outs):
        valid = base_valid & (positions >= i)
        if not valid.any():
            per_step.append((0, 0, 0.0))
            continue
        logq = torch.log_softmax(head.logits(h[valid]).float(), -1)
        p = lab_p[valid]
        p = p / p.sum(-1, keepdim=True)
        loss = -(p * logq.gather(-1, lab_ids[valid].clamp(min=0))).sum(-1)
        total = total + decay ** i * loss.mean()
        correct = int((logq.argmax(-1) == top1[valid]).sum())
        per_step.append((correct, int(valid.sum()), float(loss.detach().sum())))
    return total, per_step
