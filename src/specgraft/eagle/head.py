"""The EAGLE-3 draft head: one Llama-style decoder layer over fused target features.

Parameter names follow the official checkpoints (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), so a state dict loads as is (see :mod:`specgraft.eagle.checkpoint`)::

    target features  f_t = [h_low | h_mid | h_high]_t      [T, 3H]   (fc only on these)
    token embedding  e_{t+1} = embed(x_{t+1})              [T, H]    (the target's, frozen)
    x   = cat(input_layernorm(e), hidden_norm(fc(f)))      [T, 2H]   q/k/v take 2H
    h   = fc(f) + o_proj(attn(x))                          residual is the feature
    h   = h + mlp(post_attention_layernorm(h))             -> fed back as the next feature (no fc)
    logits = lm_head(norm(h))                              [T, Vd]   predicts x_{t+2}; target id = d + d2t[d]

The pair (feature of position t, token t+1) sits at position t. Attention is written out (not SDPA) so
that the same code serves drafting (a KV cache plus a visibility mask) and training-time test (TTT),
where keys of earlier unroll steps join along the diagonal.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
import torch.nn.functional as F


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    target_layers: tuple[int, ...] = field(default_factory=tuple)  # hidden_states indices (low, mid, high)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of ``x: [B, heads, T, d]`` at ``positions: [B, T]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.float().unsqueeze(-1) * inv  # [B, T, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos().unsqueeze(1), torch.cat([ang, ang], -1).sin().unsqueeze(1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """``x: [B, T, 2H]`` -> q ``[B, nh, T, d]``, k, v ``[B, nkv, T, d]`` (rotary applied)."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``[B, nh, Tq, d] x [B, nkv, Tk, d] -> [B, nh, Tq, Tk]`` (grouped-query heads share k)."""
        g = self.c.num_attention_heads // self.c.num_key_value_heads
        B, nh, Tq, d = q.shape
        s = torch.matmul(q.reshape(B, -1, g * Tq, d), k.transpose(-1, -2)) * d ** -0.5
        return s.view(B, nh, Tq, -1)

    def weighted(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[B, nh, Tq, Tk] x [B, nkv, Tk, d] -> [B, Tq, nh*d]`` (before ``o_proj``)."""
        g = self.c.num_attention_heads // self.c.num_key_value_heads
        B, nh, Tq, Tk = p.shape
        out = torch.matmul(p.reshape(B, -1, g * Tq, Tk), v).view(B, nh, Tq, -1)
        return out.transpose(1, 2).reshape(B, Tq, -1)


class MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)

    def inputs(self, feat: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feat)], -1)

    def finish(self, feat: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = feat + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    def __init__(self, c: HeadConfig, embed_tokens: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        if embed_tokens is not None:
            self.embed_tokens.weight.data.copy_(embed_tokens)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Draft vocabulary = target ids ``draft_to_target`` (sorted); stores the offset map and the mask."""
        ids = draft_to_target.long()
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its layers compute in (read off a norm: prepacked linear layers have no ``weight``)."""
        return self.norm.weight.dtype

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def step(self, feat: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             past: tuple[torch.Tensor, torch.Tensor] | None, bias: torch.Tensor | None):
        """One pass over new pairs, attending to ``past`` keys (drafting).

        ``feat: [B, T, H]`` (already fused), ``tokens/positions: [B, T]``, ``past``: keys/values
        ``[B, nkv, S, d]``; ``bias: [B, 1, T, S + T]`` additive mask (None = causal over the new pairs, all of
        ``past`` visible). Returns ``(h [B, T, H], (k, v) of the new pairs)``.
        """
        attn = self.midlayer.self_attn
        x = self.midlayer.inputs(feat, self.embed_tokens(tokens))
        q, k, v = attn.qkv(x, positions)
        return self.midlayer.finish(feat, attn.o_proj(self.attend(q, k, v, past, bias))), (k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               past: tuple[torch.Tensor, torch.Tensor] | None, bias: torch.Tensor | None) -> torch.Tensor:
        """Attention of new queries ``q [B, nh, T, d]`` over ``past`` and the new keys ``k, v``; returns
        ``[B, T, nh*d]`` before ``o_proj``. ``bias`` as in :meth:`step`."""
        attn = self.midlayer.self_attn
        T, S = q.shape[2], 0 if past is None else past[0].shape[2]
        if bias is None:
            bias = causal_bias(T, S, q)
        # Scores against the cached keys and the new ones are joined, not the keys themselves: no copy of
        # the cache per call (the drafter's cache is a view of a buffer written by position).
        scores = attn.scores(q, k) if past is None else torch.cat([attn.scores(q, past[0]), attn.scores(q, k)], -1)
        p = torch.softmax((scores + bias).float(), -1).to(q.dtype)
        mixed = attn.weighted(p[..., S:], v)
        if past is not None:
            mixed = mixed + attn.weighted(p[..., :S].contiguous(), past[1])
        return mixed


def causal_bias(t: int, s: int, like: torch.Tensor) -> torch.Tensor:
    """``[t, s + t]`` additive mask (``like``'s dtype and device): all ``s`` cached columns visible, causal over
    the ``t`` new ones."""
    bias = torch.zeros(t, s + t, dtype=like.dtype, device=like.device)
    bias[:, s:] = torch.full((t, t), float("-inf"), device=like.device).triu(1)
    return bias


def parameter_count(head: Eagle3Head) -> int:
    """Trainable parameters (the frozen target embedding excluded)."""
    return sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens"))
