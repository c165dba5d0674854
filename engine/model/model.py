"""Whisper as the engine needs it: a batched encoder over variable-length audio, and a
decoder that runs over a slot KV cache so sequences can join and leave at any step.

The weights come from transformers' WhisperForConditionalGeneration (see weights.py);
the layers here are plain torch so that the cache layout, masks and positions are ours.
Every row of a batch is computed independently of the others (masks, per-row positions),
which is what makes "batched == alone" hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.kv_cache import KVCache


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


class Heads(nn.Module):
    """What self- and cross-attention share: splitting into heads, attending, the output projection."""

    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.out = nn.Linear(n_state, n_state)

    def split(self, x: Tensor) -> Tensor:  # [B, T, D] -> [B, H, T, D/H]
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, -1).transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, h, t, d = y.shape
        return self.out(y.transpose(1, 2).reshape(b, t, h * d))

    def attend_each(self, q: Tensor, k: Tensor, v: Tensor, lengths: list[int] | None) -> Tensor:
        """Row b attends over its first lengths[b] positions only (None: every row over all), in a
        call of its own: the very call it gets alone. A mask over the longest row's keys would sum
        over another length, which rounds differently; int8 per-row activations turn such last-bit
        differences into changed tokens. Positions past a row's length come out as zeros."""
        if lengths is None:
            return self.attend(q, k, v, None)
        y = q.new_zeros(q.shape)
        for row, n in enumerate(lengths):
            y[row, :, :n] = F.scaled_dot_product_attention(
                q[row : row + 1, :, :n], k[row : row + 1, :, :n], v[row : row + 1, :, :n]
            )[0]
        b, h, t, d = y.shape
        return self.out(y.transpose(1, 2).reshape(b, t, h * d))


class SelfAttention(Heads):
    """Q, K and V from one fused Linear: one matmul instead of three (as SGLang's Whisper)."""

    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__(n_state, n_head)
        # Whisper's k_proj has no bias: the K third of this bias is zero (from_hf).
        self.qkv = nn.Linear(n_state, 3 * n_state)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, D] -> q, k, v, each [B, H, T, D/H]."""
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]


class CrossAttention(Heads):
    """Queries from the text; K and V of the audio features from one fused Linear, once per utterance."""

    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__(n_state, n_head)
        self.query = nn.Linear(n_state, n_state)
        self.kv = nn.Linear(n_state, 2 * n_state)  # the K half of the bias is zero, as for SelfAttention

    def project_kv(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """features [B, T, D] -> k, v, each [B, H, T, D/H]."""
        b, t, _ = features.shape
        kv = self.kv(features).view(b, t, 2, self.n_head, -1).permute(2, 0, 3, 1, 4)
        return kv[0], kv[1]


class EncoderBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, n_ffn: int) -> None:
        super().__init__()
        self.attn = SelfAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.mlp = nn.Sequential(nn.Linear(n_state, n_ffn), nn.GELU(), nn.Linear(n_ffn, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(self, x: Tensor, lengths: list[int] | None) -> Tensor:
        x = x + self.attn.attend_each(*self.attn.project(self.attn_ln(x)), lengths)
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

    def forward(self, mel: Tensor, audio_ctx: list[int] | None = None) -> Tensor:
        """mel: [B, n_mels, 2*T] with frames past each row's 2*audio_ctx zeroed.
        audio_ctx: the encoder positions each row uses (host ints), or None when every row uses all T.
        Returns [B, T, D]; positions past a row's audio_ctx are padding, never read as keys."""
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.positional_embedding[: x.shape[1]]
        for block in self.layers():
            x = block(x, audio_ctx)
        return self.ln_post(x)


class DecoderBlock(nn.Module):
    """One decoder layer, for every decoder path (as openai/whisper's ResidualAttentionBlock): prefill,
    the decode step and word alignment differ only in where the self-attention K/V go and what the
    layer hands back."""

    def __init__(self, n_state: int, n_head: int, n_ffn: int) -> None:
        super().__init__()
        self.attn = SelfAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.cross_attn = CrossAttention(n_state, n_head)
        self.cross_attn_ln = nn.LayerNorm(n_state)
        self.mlp = nn.Sequential(nn.Linear(n_state, n_ffn), nn.GELU(), nn.Linear(n_ffn, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(
        self,
        x: Tensor,
        self_mask: Tensor,
        cross_k: Tensor,
        cross_v: Tensor,
        cross_mask: Tensor,
        cache: tuple[Tensor, Tensor] | None = None,
        at: Tensor | None = None,
        qk_heads: Sequence[int] = (),
    ) -> tuple[Tensor, list[Tensor]]:
        """x [B, T, D] against the audio's cross_k/cross_v [B, H, C, D/H]. Self-attention K/V:
          cache None       attend over this call's own K/V, store nothing (alignment);
          cache, at None   write this call's K/V into `cache` (views [B, H, T, D/H] of the rows' first
                           T positions) and attend over them (prefill);
          cache and at     scatter this call's K/V into `cache` (views [B, H, K, D/H]) at `at` (positions,
                           expanded to [B, H, 1, D/H]) and attend over the whole cache (decode step).
        Returns the layer's output and, for each head in qk_heads, its cross-attention logits
        q.k/sqrt(d) [B, T, C] in float32 (word alignment)."""
        a = self.attn
        q, k, v = a.project(self.attn_ln(x))
        if cache is not None:
            cache_k, cache_v = cache
            if at is None:
                cache_k.copy_(k)
                cache_v.copy_(v)
            else:
                cache_k.scatter_(2, at, k)
                cache_v.scatter_(2, at, v)
                k, v = cache_k, cache_v
        x = x + a.attend(q, k, v, self_mask)
        c = self.cross_attn
        q = c.split(c.query(self.cross_attn_ln(x)))
        qk = []
        if qk_heads:
            scale = math.sqrt(q.shape[-1])
            qk = [(q[:, h].float() @ cross_k[:, h].float().transpose(-1, -2)) / scale for h in qk_heads]
        x = x + c.attend(q, cross_k, cross_v, cross_mask)
        return x + self.mlp(self.mlp_ln(x)), qk


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
    def write_cross_kv(
        self, audio_features: Tensor, rows: Tensor, cache: KVCache, source: Tensor | None = None
    ) -> None:
        """Cross-attention K/V of audio_features [B, T, D] into cache `rows`: row i takes utterance
        source[i] (None: utterance i). K/V are projected once per utterance, however many rows (beams)
        take them."""
        t = audio_features.shape[1]
        for layer, block in enumerate(self.decoder.layers()):
            k, v = block.cross_attn.project_kv(audio_features)
            if source is not None:
                k, v = k.index_select(0, source), v.index_select(0, source)
            cache.cross_k[layer][rows, :, :t] = k
            cache.cross_v[layer][rows, :, :t] = v

    # --- decoder over the slot cache: three paths through the same blocks ---
    @torch.inference_mode()
    def prefill(self, tokens: Tensor, rows: slice, cache: KVCache, n_cross: int) -> Tensor:
        """Run prompts tokens [B, T] (from position 0; padding after each) for cache rows `rows`,
        attending to the first n_cross cross-attention keys (the rows' longest audio context, known
        on the host). Writes self-attention K/V at positions 0..T-1; returns hidden states [B, T, D]
        (the caller picks positions and calls decoder.logits)."""
        dec = self.decoder
        t = tokens.shape[1]
        x = dec.token_embedding(tokens) + dec.positional_embedding[:t]
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None, None]
        cross_mask = _cross_mask(cache.cross_len[rows], n_cross)
        for layer, block in enumerate(dec.layers()):
            x, _ = block(
                x,
                causal,
                cache.cross_k[layer][rows, :, :n_cross],
                cache.cross_v[layer][rows, :, :n_cross],
                cross_mask,
                (cache.self_k[layer][rows, :, :t], cache.self_v[layer][rows, :, :t]),
            )
        return x

    def decode_step(
        self,
        tokens: Tensor,
        positions: Tensor,
        cross_len: Tensor,
        self_k: list[Tensor],
        self_v: list[Tensor],
        cross_k: list[Tensor],
        cross_v: list[Tensor],
    ) -> Tensor:
        """One decode step, static: tokens, positions, cross_len [B]; self_k/self_v [B, H, K, D/H] and
        cross_k/cross_v [B, H, C, D/H] per layer (views of the cache). Row b's token goes to position
        positions[b] (< K); it attends to keys 0..positions[b] and to its first cross_len[b] audio
        positions (<= C). Writes the step's K/V into self_k/self_v; returns logits [B, V].

        Shapes come only from the arguments (B, K, C), nothing is read back to the host and nothing
        depends on values: this is the function `torch.compile(fullgraph=True)` compiles and a CUDA
        graph captures per shape bucket. Rows past the live ones (bucket padding) must carry a valid
        position and cross_len >= 1, so that they compute finite values in their free cache rows."""
        dec = self.decoder
        b = tokens.shape[0]
        n_keys, n_cross = self_k[0].shape[2], cross_k[0].shape[2]
        x = (dec.token_embedding(tokens) + dec.positional_embedding[positions])[:, None]  # [B, 1, D]
        keys = torch.arange(n_keys, device=tokens.device)
        self_mask = (keys[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, K]
        cross_mask = _cross_mask(cross_len, n_cross)
        heads, head_dim = self_k[0].shape[1], self_k[0].shape[3]
        at = positions.view(b, 1, 1, 1).expand(b, heads, 1, head_dim)
        for layer, block in enumerate(dec.layers()):
            x, _ = block(
                x, self_mask, cross_k[layer], cross_v[layer], cross_mask, (self_k[layer], self_v[layer]), at
            )
        return dec.logits(x[:, 0])

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
            wanted = [head for head_layer, head in heads if head_layer == layer]
            x, qk = block(
                x,
                causal,
                cache.cross_k[layer][rows, :, :n_cross],
                cache.cross_v[layer][rows, :, :n_cross],
                cross_mask,
                qk_heads=wanted,
            )
            picked.update({(layer, head): scores for head, scores in zip(wanted, qk, strict=True)})
        return torch.stack([picked[lh] for lh in heads], dim=1), dec.logits(x)

    # --- keyterm respelling: one window's text and its alternatives, teacher-forced over its audio ---
    @torch.inference_mode()
    def sequence_logits(self, tokens: Tensor, row: int, cache: KVCache, logits_from: int = 0) -> Tensor:
        """Run whole sequences tokens [B, T] (from position 0; padding after each) against the one
        cross-attention K/V of cache `row`; returns the output logits [B, T - logits_from, V] (positions
        from logits_from). Every query attends over the same audio, so cross-attention runs as one
        sequence of B*T queries over the row's K/V instead of B copies of it."""
        dec = self.decoder
        b, t = tokens.shape
        x = dec.token_embedding(tokens) + dec.positional_embedding[:t]
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None, None]
        n_cross = int(cache.cross_len[row])
        for layer, block in enumerate(dec.layers()):
            a = block.attn
            q, k, v = a.project(block.attn_ln(x))
            x = x + a.attend(q, k, v, causal)
            c = block.cross_attn
            q = c.split(c.query(block.cross_attn_ln(x)))
            heads, width = q.shape[1], q.shape[3]
            folded = q.transpose(0, 1).reshape(1, heads, b * t, width)
            keys = cache.cross_k[layer][row : row + 1, :, :n_cross]
            values = cache.cross_v[layer][row : row + 1, :, :n_cross]
            x = x + c.attend(folded, keys, values, None).view(b, t, -1)
            x = x + block.mlp(block.mlp_ln(x))
        return dec.logits(x[:, logits_from:])


def from_transformers(hf_model: Any) -> Whisper:
    """Build our Whisper from a transformers WhisperForConditionalGeneration's weights."""
    return from_hf(hf_model.config.to_dict(), hf_model.state_dict())


def from_hf(cfg: Mapping[str, Any], src: Mapping[str, Tensor]) -> Whisper:
    """Build our Whisper from a Hugging Face Whisper checkpoint: its config.json and its state dict."""
    dims = Dims(
        n_mels=cfg["num_mel_bins"],
        n_audio_ctx=cfg["max_source_positions"],
        n_audio_state=cfg["d_model"],
        n_audio_head=cfg["encoder_attention_heads"],
        n_audio_layer=cfg["encoder_layers"],
        n_audio_ffn=cfg["encoder_ffn_dim"],
        n_vocab=cfg["vocab_size"],
        n_text_ctx=cfg["max_target_positions"],
        n_text_state=cfg["d_model"],
        n_text_head=cfg["decoder_attention_heads"],
        n_text_layer=cfg["decoder_layers"],
        n_text_ffn=cfg["decoder_ffn_dim"],
    )
    model = Whisper(dims)
    out: dict[str, Tensor] = {}

    def fused(names: list[str], srcp: str) -> tuple[Tensor, Tensor]:
        """Weights of projections `names` stacked by output rows, as one Linear; Whisper's k_proj has
        no bias, so its part of the fused bias is zero (adding 0.0 is exact: outputs are unchanged)."""
        weights = [src[f"{srcp}.{n}_proj.weight"] for n in names]
        biases = [
            src.get(f"{srcp}.{n}_proj.bias", torch.zeros(w.shape[0], dtype=w.dtype))
            for n, w in zip(names, weights, strict=True)
        ]
        return torch.cat(weights), torch.cat(biases)

    def attn(dst: str, srcp: str) -> None:
        out[f"{dst}.qkv.weight"], out[f"{dst}.qkv.bias"] = fused(["q", "k", "v"], srcp)
        out[f"{dst}.out.weight"] = src[f"{srcp}.out_proj.weight"]
        out[f"{dst}.out.bias"] = src[f"{srcp}.out_proj.bias"]

    def cross_attn(dst: str, srcp: str) -> None:
        out[f"{dst}.query.weight"] = src[f"{srcp}.q_proj.weight"]
        out[f"{dst}.query.bias"] = src[f"{srcp}.q_proj.bias"]
        out[f"{dst}.kv.weight"], out[f"{dst}.kv.bias"] = fused(["k", "v"], srcp)
        out[f"{dst}.out.weight"] = src[f"{srcp}.out_proj.weight"]
        out[f"{dst}.out.bias"] = src[f"{srcp}.out_proj.bias"]

    def ln(dst: str, srcp: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = src[f"{srcp}.weight"], src[f"{srcp}.bias"]

    def mlp(dst: str, srcp: str) -> None:
        ln(f"{dst}.0", f"{srcp}.fc1")
        ln(f"{dst}.2", f"{srcp}.fc2")
        ln(f"{dst}_ln", f"{srcp}.final_layer_norm")

    def self_attn(dst: str, srcp: str) -> None:
        # a block's self-attention and its norm, the same in encoder and decoder blocks
        attn(f"{dst}.attn", f"{srcp}.self_attn")
        ln(f"{dst}.attn_ln", f"{srcp}.self_attn_layer_norm")

    e, d = "model.encoder", "model.decoder"
    for i in (1, 2):
        ln(f"encoder.conv{i}", f"{e}.conv{i}")
    out["encoder.positional_embedding"] = src[f"{e}.embed_positions.weight"]
    ln("encoder.ln_post", f"{e}.layer_norm")
    for n in range(dims.n_audio_layer):
        self_attn(f"encoder.blocks.{n}", f"{e}.layers.{n}")
        mlp(f"encoder.blocks.{n}.mlp", f"{e}.layers.{n}")
    out["decoder.token_embedding.weight"] = src[f"{d}.embed_tokens.weight"]
    out["decoder.positional_embedding"] = src[f"{d}.embed_positions.weight"]
    ln("decoder.ln", f"{d}.layer_norm")
    for n in range(dims.n_text_layer):
        self_attn(f"decoder.blocks.{n}", f"{d}.layers.{n}")
        cross_attn(f"decoder.blocks.{n}.cross_attn", f"{d}.layers.{n}.encoder_attn")
        ln(f"decoder.blocks.{n}.cross_attn_ln", f"{d}.layers.{n}.encoder_attn_layer_norm")
        mlp(f"decoder.blocks.{n}.mlp", f"{d}.layers.{n}")
    model.load_state_dict(out, strict=True)
    return model.eval()


def _cross_mask(cross_len: Tensor, n_cross: int) -> Tensor:
    """[B, 1, 1, n_cross]: each row's first cross_len audio positions (at least one, so that a padding
    row of a static batch, whose free slot may hold 0, still has a finite softmax)."""
    keys = torch.arange(n_cross, device=cross_len.device)
    return (keys[None, :] < cross_len.clamp(min=1)[:, None])[:, None, None, :]
