"""The native PLE decoder, readable top to bottom.

A decoder layer updates the hidden state ``x`` in residual steps (the seed's "state pipeline"):

    x = x + SelfAttention(norm(x))          tokens exchange information (KV-cached)
    x = x + CrossAttention(norm(x), enc)    optional: tokens read the encoder's output
    x = x + PLE(norm(x), position)          a per-position linear correction
    x = x + MLP(norm(x))                    a per-token non-linear projection

with the PLE sub-layer placed before the attention, before the MLP (the seed's default) or
after the MLP, and post-norm (``x = norm(x + f(x))``) as an alternative to pre-norm.

The forward pass is the exporter's contract: ``(input_ids, attention_mask, position_ids,
past_key_values) -> (logits, present_key_values)`` with BNSH caches ``[batch, n_kv_heads, seq,
head_dim]``; ``attention_mask`` covers past and current tokens (``[batch, past + seq]``) and
masks padding; ``position_ids`` come from the caller, so left-padded batches work.
"""

from __future__ import annotations

import math
import typing

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.plugins.native.config import MLPKind, NativeConfig, NormKind, NormPosition, PLEPlacement, PositionKind

__all__ = [
    "Norm",
    "PositionLinearEmbedding",
    "PLESubLayer",
    "Attention",
    "CrossAttention",
    "attend",
    "MLP",
    "DecoderLayer",
    "PLEDecoder",
    "KV",
]

KV = tuple[Tensor, Tensor]
LayerCache = tuple[Tensor, ...]  # (key, value), or (key, value, cross_key, cross_value) with cross-attention


class Norm(nn.Module):
    """LayerNorm or RMSNorm, split into ``normalize`` (no parameters) and an affine part."""

    def __init__(self, kind: NormKind, d: int, eps: float) -> None:
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if kind is NormKind.LAYERNORM else None

    def normalize(self, x: Tensor) -> Tensor:
        if self.kind is NormKind.LAYERNORM:
            return F.layer_norm(x, x.shape[-1:], None, None, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: Tensor) -> Tensor:
        y = self.normalize(x) * self.weight
        return y + self.bias if self.bias is not None else y


class PositionLinearEmbedding(nn.Module):
    """PLE: ``ple(x, p) = x * (1 + g(a_p)) + b_p`` with ``(a_p, b_p) = split(E[p] (@ W + c))``.

    Initialised as the identity (a = b = 0). The seed's snippet adds 1.0 to the scale half,
    which makes ``1 + a = 2``; its text asks for an identity at init, so a = 0.
    """

    def __init__(self, d: int, max_positions: int, bounded: bool, projection: bool) -> None:
        super().__init__()
        self.d, self.bounded = d, bounded
        self.table = nn.Embedding(max_positions, d if projection else 2 * d)
        self.proj = nn.Linear(d, 2 * d) if projection else None
        nn.init.zeros_(self.table.weight)
        if self.proj is not None:
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)

    def scale_shift(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``(1 + g(a_p), b_p)`` for the given positions, each ``[..., d]``."""
        emb = self.table(positions)
        if self.proj is not None:
            emb = self.proj(emb)
        a, b = emb.split(self.d, dim=-1)
        return 1.0 + (torch.tanh(a) if self.bounded else a), b

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        scale, shift = self.scale_shift(positions)
        return x * scale + shift


class PLESubLayer(nn.Module):
    """The residual PLE step: pre-norm ``x + ple(norm(x))`` or post-norm ``norm(x + ple(x))``."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.pre = cfg.norm_position is NormPosition.PRE
        self.norm = Norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ple = PositionLinearEmbedding(cfg.d_model, cfg.ple.max_positions, cfg.ple.bounded, cfg.ple.projection)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        out: Tensor = x + self.ple(self.norm(x), positions) if self.pre else self.norm(x + self.ple(x, positions))
        return out


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """Rotary position embedding (the Hugging Face "rotate half" convention)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        # positions [B, S] -> angles [B, 1, S, head_dim/2] -> cos/sin [B, 1, S, head_dim]
        inv_freq = typing.cast(Tensor, self.inv_freq)  # a buffer
        angles = positions.to(torch.float32)[:, None, :, None] * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Projections(nn.Module):
    """The query, key, value and output projections of a grouped-query attention."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * self.hd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.hd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.hd, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_heads * self.hd, cfg.d_model, bias=cfg.bias)


class Attention(Projections):
    """Causal grouped-query self-attention with a BNSH KV cache, written out (no SDPA) so
    that every score MatMul and Softmax is a named node the precision passes can find."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__(cfg)
        self.rotary = Rotary(self.hd, cfg.rope_theta) if cfg.position is PositionKind.ROPE else None

    def forward(self, x: Tensor, allowed: Tensor, positions: Tensor, past: KV | None) -> tuple[Tensor, KV]:
        B, S, _ = x.shape
        # [B, S, H*hd] -> [B, H, S, hd]
        q = self.q_proj(x).view(B, S, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions)
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # [B, n_kv, past + S, hd]
            v = torch.cat((past[1], v), dim=2)
        return self.o_proj(attend(q, k, v, allowed)), (k, v)


def attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None) -> Tensor:
    """Scaled dot-product attention of ``q`` [B, H, S, hd] over ``k``/``v`` [B, n_kv, T, hd]
    (each KV head serves H / n_kv query heads), keys masked where ``allowed`` is False;
    returns [B, S, H*hd]."""
    B, H, S, hd = q.shape
    if k.shape[1] != H:
        # [B, n_kv, T, hd] -> [B, H, T, hd]
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # [B, H, S, T]
    if allowed is not None:
        scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [B, H, S, hd]
    return out.transpose(1, 2).reshape(B, S, H * hd)  # [B, S, H*hd]


class CrossAttention(Projections):
    """Grouped-query attention from the decoder's tokens to the encoder's output: no causal
    mask (every token sees the whole source, as the seed insists), no rotary. Its keys and
    values depend only on the encoder states, so they are computed once (``project``) and
    then read at every step."""

    def project(self, encoder_states: Tensor) -> KV:
        """Cross keys and values [B, n_kv, E, hd] of encoder states [B, E, d]."""
        B, E, _ = encoder_states.shape
        k = self.k_proj(encoder_states).view(B, E, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(encoder_states).view(B, E, self.n_kv, self.hd).transpose(1, 2)
        return k, v

    def forward(self, x: Tensor, cross_kv: KV) -> Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.hd).transpose(1, 2)
        out: Tensor = self.o_proj(attend(q, cross_kv[0], cross_kv[1], None))
        return out


class MLP(nn.Module):
    """GELU (fc1 -> gelu -> fc2) or SwiGLU (silu(gate) * up -> down)."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp is MLPKind.SWIGLU
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias) if self.swiglu else None
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden = F.silu(self.gate(x)) * self.fc1(x) if self.gate is not None else F.gelu(self.fc1(x))
        out: Tensor = self.fc2(hidden)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.pre = cfg.norm_position is NormPosition.PRE
        self.attn_norm = Norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.cross_norm = Norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.cross_attention else None
        self.cross_attn = CrossAttention(cfg) if cfg.cross_attention else None
        self.mlp_norm = Norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.ple = PLESubLayer(cfg) if cfg.ple.enabled else None
        self.ple_placement = cfg.ple.placement

    def _ple(self, x: Tensor, positions: Tensor, where: PLEPlacement) -> Tensor:
        if self.ple is not None and self.ple_placement is where:
            x = self.ple(x, positions)
        return x

    def forward(
        self, x: Tensor, allowed: Tensor, positions: Tensor, past: LayerCache | None, encoder_states: Tensor | None
    ) -> tuple[Tensor, LayerCache]:
        x = self._ple(x, positions, PLEPlacement.BEFORE_ATTENTION)
        self_past = (past[0], past[1]) if past is not None else None
        if self.pre:
            h, present = self.attn(self.attn_norm(x), allowed, positions, self_past)
            x = x + h
        else:
            h, present = self.attn(x, allowed, positions, self_past)
            x = self.attn_norm(x + h)
        if self.cross_attn is not None and self.cross_norm is not None:
            if past is not None:
                cross_kv = (past[2], past[3])  # computed once, by the first call
            elif encoder_states is not None:
                cross_kv = self.cross_attn.project(encoder_states)
            else:
                raise ValueError("a cross-attention decoder needs encoder_hidden_states on its first call")
            if self.pre:
                x = x + self.cross_attn(self.cross_norm(x), cross_kv)
            else:
                x = self.cross_norm(x + self.cross_attn(x, cross_kv))
            present = (*present, *cross_kv)
        x = self._ple(x, positions, PLEPlacement.RESIDUAL)
        x = x + self.mlp(self.mlp_norm(x)) if self.pre else self.mlp_norm(x + self.mlp(x))
        x = self._ple(x, positions, PLEPlacement.AFTER_MLP)
        return x, present


def causal_padding_mask(attention_mask: Tensor, seq: int) -> Tensor:
    """``[B, 1, seq, total]`` bool: query i (at absolute index past + i) may see key j when
    ``j <= past + i`` and key j is not padding. Every query also sees itself, so the row of a
    padding query is never fully masked: a fully masked row would be a softmax over -inf (NaN
    in fp16, where the mask constant saturates), and the NaN would reach real tokens through
    the padding's keys and values (0 * NaN). Real queries see themselves anyway."""
    total = attention_mask.shape[1]
    past = total - seq
    q_idx = torch.arange(seq, device=attention_mask.device) + past
    k_idx = torch.arange(total, device=attention_mask.device)
    causal = k_idx[None, :] <= q_idx[:, None]  # [seq, total]
    itself = k_idx[None, :] == q_idx[:, None]  # [seq, total]
    return (causal[None, None, :, :] & attention_mask.bool()[:, None, None, :]) | itself[None, None, :, :]


class PLEDecoder(nn.Module):
    """The full model: embeddings, decoder layers, final norm, LM head."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_context, cfg.d_model) if cfg.position is PositionKind.LEARNED else None
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        # post-norm layers end in a norm already; pre-norm needs one before the head
        self.final_norm = Norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.norm_position is NormPosition.PRE else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        past_key_values: list[LayerCache] | None = None,
        last_logits_only: bool = False,
        encoder_hidden_states: Tensor | None = None,
    ) -> tuple[Tensor, list[LayerCache]]:
        seq = input_ids.shape[1]
        x = self.embed(input_ids)  # [B, S, d]
        if self.pos_embed is not None:
            x = x + self.pos_embed(position_ids)
        allowed = causal_padding_mask(attention_mask, seq)
        presents: list[LayerCache] = []
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values else None
            x, present = layer(x, allowed, position_ids, past, encoder_hidden_states)
            presents.append(present)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if last_logits_only:
            x = x[:, -1:, :]  # [B, 1, d]
        return self.lm_head(x), presents
