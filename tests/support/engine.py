"""Engines for tests: the real bundled tiny.en, and a small random-weight Whisper that
shares tiny.en's tokenizer (fast, for scheduling logic only — never for accuracy)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from engine.model import weights

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
JFK_FLAC = SHARED / "data" / "jfk.flac"
JFK_TEXT = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."


@functools.cache
def jfk_16k() -> np.ndarray:
    audio, rate = sf.read(JFK_FLAC, dtype="float32")
    return soxr.resample(audio.mean(axis=1), rate, 16000).astype(np.float32)


def random_whisper_folder(root: Path) -> Path:
    """A Hugging Face Whisper folder with small random weights and tiny.en's tokenizer."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    out = root / "random-whisper"
    if (out / "config.json").exists():
        return out
    real = weights.load("tiny.en")
    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=real.config["vocab_size"],
        num_mel_bins=80,
        d_model=64,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=real.config["decoder_start_token_id"],
    )
    WhisperForConditionalGeneration(config).save_pretrained(out)
    for name in (
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
    ):
        src = real.hf_folder / name
        if src.exists():
            shutil.copy(src, out / name)
    for src in real.hf_folder.glob("*.json"):
        if not (out / src.name).exists():
            shutil.copy(src, out / src.name)
    return out
