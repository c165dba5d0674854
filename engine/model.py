"""Whisper as the scheduler needs it: a batched encoder over variable-length audio, and a
decoder that runs over a slot KV cache so sequences can join and leave at any step.

The weights come from transformers' WhisperForConditionalGeneration (see weights.py);
the layers here are plain torch so that the cache layout, masks and positions are ours.
Every row of a batch is computed independently of the others (masks, per-row positions),
which is what makes "batched == alone" hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kv_cache import KVCache


@dataclass(frozen=True)
class Dims:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_audio_ffn: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int
    n_text_ffn: int


class Attention(nn.Module):
    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def split(self, x: Tensor) -> Tensor:  # [B, T, D] -> [B, H, T, D/H]
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, -1).transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, h, t, d = y.shape
        return self.out(y.transpose(1, 2).reshape(b, t, h * d))


class EncoderBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, n_ffn: int) -> None:
        super().__init__()
        self.attn = Attention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.mlp = nn.Sequential(nn.Linear(n_state, n_ffn), nn.GELU(), nn.Linear(n_ffn, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        h = self.attn_ln(x)
        a = self.attn
        x = x + a.attend(a.split(a.query(h)), a.split(a.key(h)), a.split(a.value(h)), mask)
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, dims: Dims) -> None:
        super().__init__()
        d = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = nn.Parameter(torch.empty(dims.n_audio_ctx, d))
        self.blocks = nn.ModuleList(
            EncoderBlock(d, dims.n_audio_head, dims.n_audio_ffn) for _ in range(dims.n_audio_layer)
        )
        self.ln_post = nn.LayerNorm(d)

    def layers(self) -> Iterator[EncoderBlock]:
        return (cast(EncoderBlock, b) for b in self.blocks)

    def forward(self, mel: Tensor, audio_ctx: Tensor | None = None) -> Tensor:
        """mel: [B, n_mels, 2*T] with frames past each row's 2*audio_ctx zeroed.
        audio_ctx: [B] encoder positions each row uses (None: all T). Returns [B, T, D]."""
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.positional_embedding[: x.shape[1]]
        mask = None
        if audio_ctx is not None and bool((audio_ctx != x.shape[1]).any()):
            keys = torch.arange(x.shape[1], device=x.device)
            mask = (keys[None, :] < audio_ctx[:, None])[:, None, None, :]  # [B, 1, 1, T]
        for block in self.layers():
            x = block(x, mask)
        return self.ln_post(x)


class DecoderBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, n_ffn: int) -> None:
        super().__init__()
        self.attn = Attention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.cross_attn = Attention(n_state, n_head)
        self.cross_attn_ln = nn.LayerNorm(n_state)
        self.mlp = nn.Sequential(nn.Linear(n_state, n_ffn), nn.GELU(), nn.Linear(n_ffn, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)


class TextDecoder(nn.Module):
    def __init__(self, dims: Dims) -> None:
        super().__init__()
        d = dims.n_text_state
        self.token_embedding = nn.Embedding(dims.n_vocab, d)
        self.positional_embedding = nn.Parameter(torch.empty(dims.n_text_ctx, d))
        self.blocks = nn.ModuleList(
            DecoderBlock(d, dims.n_text_head, dims.n_text_ffn) for _ in range(dims.n_text_layer)
        )
        self.ln = nn.LayerNorm(d)
        # Tied to token_embedding by default; a separate Linear lets int8 quantization reach it.
        self.proj: nn.Linear | None = None

    def layers(self) -> Iterator[DecoderBlock]:
        return (cast(DecoderBlock, b) for b in self.blocks)

    def logits(self, h: Tensor) -> Tensor:
        h = self.ln(h)
        if self.proj is not None:
            return self.proj(h).float()
        return (h @ self.token_embedding.weight.T).float()


class Whisper(nn.Module):
    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)

    # --- cross-attention K/V: computed once per utterance, right after its encoder pass ---
    @torch.inference_mode()
    def write_cross_kv(self, audio_features: Tensor, rows: Tensor, cache: KVCache) -> None:
        t = audio_features.shape[1]
        for layer, block in enumerate(self.decoder.layers()):
            a = block.cross_attn
            cache.cross_k[layer][rows, :, :t] = a.split(a.key(audio_features))
            cache.cross_v[layer][rows, :, :t] = a.split(a.value(audio_features))

    # --- decoder over the slot cache ---
    @torch.inference_mode()
    def decode(self, tokens: Tensor, start: Tensor, rows: slice, cache: KVCache) -> Tensor:
        """Run tokens [B, T] for cache rows `rows` (contiguous), row b's tokens at positions
        start[b] .. start[b]+T-1. Writes self-attention K/V into the cache; returns hidden
        states [B, T, D] (the caller picks positions and calls decoder.logits)."""
        dec = self.decoder
        b, t = tokens.shape
        offsets = torch.arange(t, device=tokens.device)
        positions = start[:, None] + offsets[None, :]  # [B, T]
        x = dec.token_embedding(tokens) + dec.positional_embedding[positions]
        n_keys = int(start.max()) + t
        keys = torch.arange(n_keys, device=tokens.device)
        self_mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, K]: causal, per row
        cross_len = cache.cross_len[rows]
        n_cross = int(cross_len.max())
        cross_mask = None
        if bool((cross_len != n_cross).any()):
            ck = torch.arange(n_cross, device=tokens.device)
            cross_mask = (ck[None, :] < cross_len[:, None])[:, None, None, :]
        batch_index = torch.arange(b, device=tokens.device)[:, None]
        for layer, block in enumerate(dec.layers()):
            a = block.attn
            h = block.attn_ln(x)
            q, k, v = a.split(a.query(h)), a.split(a.key(h)), a.split(a.value(h))
            k_cache, v_cache = cache.self_k[layer][rows], cache.self_v[layer][rows]
            # Scatter this step's K/V at each row's own positions.
            k_cache.transpose(1, 2)[batch_index, positions] = k.transpose(1, 2)
            v_cache.transpose(1, 2)[batch_index, positions] = v.transpose(1, 2)
            x = x + a.attend(q, k_cache[:, :, :n_keys], v_cache[:, :, :n_keys], self_mask)
            c = block.cross_attn
            q = c.split(c.query(block.cross_attn_ln(x)))
            x = x + c.attend(
                q,
                cache.cross_k[layer][rows, :, :n_cross],
                cache.cross_v[layer][rows, :, :n_cross],
                cross_mask,
            )
            x = x + block.mlp(block.mlp_ln(x))
        return x

    # --- word timings: the alignment heads' cross-attention over whole finished sequences ---
    @torch.inference_mode()
    def alignment_attention(
        self, tokens: Tensor, rows: Tensor, cache: KVCache, heads: list[tuple[int, int]]
    ) -> tuple[Tensor, Tensor]:
        """Run whole sequences tokens [B, T] (from position 0; padding after each) against the
        cross-attention K/V of cache `rows` (any rows; their self-attention cache is not touched).
        Returns the cross-attention logits q.k/sqrt(d) of `heads` (layer, head) [B, len(heads), T, keys]
        and the output logits [B, T, V]."""
        dec = self.decoder
        t = tokens.shape[1]
        x = dec.token_embedding(tokens) + dec.positional_embedding[:t]
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None, None]
        cross_len = cache.cross_len[rows]
        n_cross = int(cross_len.max())
        ck = torch.arange(n_cross, device=tokens.device)
        cross_mask = (ck[None, :] < cross_len[:, None])[:, None, None, :]
        picked: dict[tuple[int, int], Tensor] = {}
        for layer, block in enumerate(dec.layers()):
            a = block.attn
            h = block.attn_ln(x)
            x = x + a.attend(a.split(a.query(h)), a.split(a.key(h)), a.split(a.value(h)), causal)
            c = block.cross_attn
            q = c.split(c.query(block.cross_attn_ln(x)))
            k = cache.cross_k[layer][rows, :, :n_cross]
            v = cache.cross_v[layer][rows, :, :n_cross]
            for lh in heads:
                if lh[0] == layer:  # explicit weights only for the alignment heads
                    qk = q[:, lh[1]].float() @ k[:, lh[1]].float().transpose(-1, -2)
                    picked[lh] = qk / math.sqrt(q.shape[-1])
            x = x + c.attend(q, k, v, cross_mask)
            x = x + block.mlp(block.mlp_ln(x))
        return torch.stack([picked[lh] for lh in heads], dim=1), dec.logits(x)


def from_transformers(hf_model: Any) -> Whisper:
    """Build our Whisper from a transformers WhisperForConditionalGeneration's weights."""
    cfg = hf_model.config
    dims = Dims(
        n_mels=cfg.num_mel_bins,
        n_audio_ctx=cfg.max_source_positions,
        n_audio_state=cfg.d_model,
        n_audio_head=cfg.encoder_attention_heads,
        n_audio_layer=cfg.encoder_layers,
        n_audio_ffn=cfg.encoder_ffn_dim,
        n_vocab=cfg.vocab_size,
        n_text_ctx=cfg.max_target_positions,
        n_text_state=cfg.d_model,
        n_text_head=cfg.decoder_attention_heads,
        n_text_layer=cfg.decoder_layers,
        n_text_ffn=cfg.decoder_ffn_dim,
    )
    model = Whisper(dims)
    src = hf_model.state_dict()
    out: dict[str, Tensor] = {}

    def attn(dst: str, srcp: str) -> None:
        out[f"{dst}.query.weight"] = src[f"{srcp}.q_proj.weight"]
        out[f"{dst}.query.bias"] = src[f"{srcp}.q_proj.bias"]
        out[f"{dst}.key.weight"] = src[f"{srcp}.k_proj.weight"]
        out[f"{dst}.value.weight"] = src[f"{srcp}.v_proj.weight"]
        out[f"{dst}.value.bias"] = src[f"{srcp}.v_proj.bias"]
        out[f"{dst}.out.weight"] = src[f"{srcp}.out_proj.weight"]
        out[f"{dst}.out.bias"] = src[f"{srcp}.out_proj.bias"]

    def ln(dst: str, srcp: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = src[f"{srcp}.weight"], src[f"{srcp}.bias"]

    def mlp(dst: str, srcp: str) -> None:
        ln(f"{dst}.0", f"{srcp}.fc1")
        ln(f"{dst}.2", f"{srcp}.fc2")
        ln(f"{dst}_ln", f"{srcp}.final_layer_norm")

    e, d = "model.encoder", "model.decoder"
    for i in (1, 2):
        ln(f"encoder.conv{i}", f"{e}.conv{i}")
    out["encoder.positional_embedding"] = src[f"{e}.embed_positions.weight"]
    ln("encoder.ln_post", f"{e}.layer_norm")
    for n in range(cfg.encoder_layers):
        attn(f"encoder.blocks.{n}.attn", f"{e}.layers.{n}.self_attn")
        ln(f"encoder.blocks.{n}.attn_ln", f"{e}.layers.{n}.self_attn_layer_norm")
        mlp(f"encoder.blocks.{n}.mlp", f"{e}.layers.{n}")
    out["decoder.token_embedding.weight"] = src[f"{d}.embed_tokens.weight"]
    out["decoder.positional_embedding"] = src[f"{d}.embed_positions.weight"]
    ln("decoder.ln", f"{d}.layer_norm")
    for n in range(cfg.decoder_layers):
        attn(f"decoder.blocks.{n}.attn", f"{d}.layers.{n}.self_attn")
        ln(f"decoder.blocks.{n}.attn_ln", f"{d}.layers.{n}.self_attn_layer_norm")
        attn(f"decoder.blocks.{n}.cross_attn", f"{d}.layers.{n}.encoder_attn")
        ln(f"decoder.blocks.{n}.cross_attn_ln", f"{d}.layers.{n}.encoder_attn_layer_norm")
        mlp(f"decoder.blocks.{n}.mlp", f"{d}.layers.{n}")
    model.load_state_dict(out, strict=True)
    return model.eval()
