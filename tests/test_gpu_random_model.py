"""Random-weight Whisper at real sizes (`random:<size>`), what the GPU check measures with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import DecodeOptions, Engine, EngineConfig
from engine.model.weights import ModelLoadError, load, random_config


def test_large_v3_has_the_production_dimensions(tmp_path) -> None:
    config, tokenizer, generation, _ = random_config("random:large-v3", tmp_path)
    with torch.device("meta"):  # no 6 GB of weights: shapes only
        from transformers import WhisperForConditionalGeneration

        model = WhisperForConditionalGeneration(config)
    assert (config.num_mel_bins, config.d_model, config.encoder_layers, config.decoder_layers) == (
        128,
        1280,
        32,
        32,
    )
    assert (config.encoder_attention_heads, config.max_source_positions, config.max_target_positions) == (
        20,
        1500,
        448,
    )
    # large-v3's real vocabulary is 51866; ours is the multilingual tokenizer's 51865 (no <|yue|>).
    assert config.vocab_size == 51865 == len(tokenizer)
    params = sum(p.numel() for p in model.parameters())
    assert 1.50e9 < params < 1.56e9, params  # large-v3 is 1.55 B
    assert generation.eos_token_id in generation.suppress_tokens


def test_unknown_size_names_the_known_ones(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="large-v3"):
        load("random:huge", tmp_path)


def test_random_engine_decodes_exactly_the_tokens_asked_for(tmp_path) -> None:
    engine = Engine(EngineConfig(model="random:tiny", device="cpu", cache_dir=str(tmp_path), kv_slots=4))
    engine.start()
    try:
        assert engine.info.multilingual
        audio = np.random.default_rng(0).standard_normal(3 * 16000).astype(np.float32) * 0.05
        futures = [
            engine.submit(audio, DecodeOptions(language="en", max_new_tokens=n)).future for n in (3, 7, 11)
        ]
        lengths = [len(f.result(timeout=120).tokens) for f in futures]
    finally:
        engine.stop()
    assert lengths == [3, 7, 11]
