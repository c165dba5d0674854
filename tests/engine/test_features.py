"""Batched torch log-mel equals transformers' WhisperFeatureExtractor, row by row."""

from __future__ import annotations

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from engine.model.features import LogMel
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


def test_reflect_padding_sets_the_trim_margin_bound() -> None:
    """A trimmed row ends where its padding ends. torch.stft(center=True) reflects the last n_fft // 2
    samples of the signal past its end: alone, the row's last frames see that reflection; in a batch
    with a longer row, zeros. With at least MIN_TRIM_MARGIN_S of zeros after the audio they agree; with
    none (audio up to the row's end), they do not."""
    from engine.config import MIN_TRIM_MARGIN_S
    from engine.constants import N_FFT, SAMPLE_RATE

    assert round(MIN_TRIM_MARGIN_S * SAMPLE_RATE) == N_FFT // 2
    rng = np.random.default_rng(0)
    log_mel = LogMel(80, torch.device("cpu"))
    ctx = 100  # 2 s of encoder positions = 32000 samples
    longer = (rng.standard_normal(16000 * 5) * 0.1).astype(np.float32)
    for padding, equal in [(0, False), (N_FFT // 2, True), (N_FFT // 2 + 1, True), (16000, True)]:
        clip = (rng.standard_normal(32000 - padding) * 0.1).astype(np.float32)
        alone = log_mel([clip], [ctx])
        batch = log_mel([longer, clip], [250, ctx])
        assert torch.equal(batch[1, :, : 2 * ctx], alone[0]) == equal, padding
