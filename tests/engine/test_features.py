"""Batched torch log-mel equals transformers' WhisperFeatureExtractor, row by row."""

from __future__ import annotations

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from engine.features import LogMel
from tests.support.engine import jfk_16k


def test_log_mel_matches_transformers_for_a_batch_of_different_lengths() -> None:
    audio = jfk_16k()
    clips = [audio, audio[:16000], audio[16000:40000]]
    ours = LogMel(80, torch.device("cpu"))(clips, [1500] * 3)
    reference = WhisperFeatureExtractor(feature_size=80)
    for row, clip in enumerate(clips):
        expected = reference(clip, sampling_rate=16000, return_tensors="pt").input_features[0]
        torch.testing.assert_close(ours[row], expected, atol=1e-5, rtol=0)


def test_trimmed_rows_are_identical_alone_and_in_a_batch() -> None:
    audio = jfk_16k()
    log_mel = LogMel(80, torch.device("cpu"))
    alone = log_mel([audio[:32000]], [150])
    batch = log_mel([audio, audio[:32000]], [600, 150])
    assert batch.shape == (2, 80, 1200)
    assert torch.equal(batch[1, :, :300], alone[0])
    assert torch.count_nonzero(batch[1, :, 300:]) == 0  # zeroed past the row's own frames


def test_silence_is_finite() -> None:
    out = LogMel(80, torch.device("cpu"))([np.zeros(8000, dtype=np.float32)], [1500])
    assert torch.isfinite(out).all()
