"""Whisper's log-mel spectrogram in torch, batched, on the model's device.

Matches transformers' WhisperFeatureExtractor for 30 s windows. For trimmed encoder
contexts each row keeps its own frame count; frames past it are zeroed so that the
encoder's convolutions see exactly what they would see for that row alone.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from engine.constants import FRAMES_PER_POSITION, HOP_LENGTH, N_FFT, SAMPLE_RATE

# torch.stft(center=True) below reflect-pads n_fft // 2 samples on each side of the signal it is given:
# the reason for --trim-margin-s's lower bound (engine/config.py MIN_TRIM_MARGIN_S).


class LogMel:
    def __init__(self, n_mels: int, device: torch.device) -> None:
        from transformers.audio_utils import mel_filter_bank

        filters = mel_filter_bank(
            num_frequency_bins=1 + N_FFT // 2,
            num_mel_filters=n_mels,
            min_frequency=0.0,
            max_frequency=8000.0,
            sampling_rate=SAMPLE_RATE,
            norm="slaney",
            mel_scale="slaney",
        )
        self.filters = torch.from_numpy(np.asarray(filters, dtype=np.float32)).T.to(device)  # [n_mels, 201]
        self.window = torch.hann_window(N_FFT, device=device)
        self.device = device

    @torch.inference_mode()
    def __call__(self, audios: list[np.ndarray], audio_ctx: list[int]) -> Tensor:
        """audios: float32 16 kHz; audio_ctx: encoder positions per row. Returns [B, n_mels, 2*max_ctx]."""
        frames = [FRAMES_PER_POSITION * c for c in audio_ctx]
        n_samples = max(frames) * HOP_LENGTH
        batch = torch.zeros(len(audios), n_samples, device=self.device)
        for i, (audio, f) in enumerate(zip(audios, frames, strict=True)):
            clip = torch.from_numpy(audio[: f * HOP_LENGTH])
            batch[i, : len(clip)] = clip.to(self.device)
        stft = torch.stft(batch, N_FFT, HOP_LENGTH, window=self.window, return_complex=True)
        power = stft[..., :-1].abs() ** 2
        log_spec = torch.clamp(self.filters @ power, min=1e-10).log10()  # [B, n_mels, frames]
        frame_index = torch.arange(log_spec.shape[-1], device=self.device)
        valid = frame_index[None, :] < torch.tensor(frames, device=self.device)[:, None]  # [B, F]
        row_max = log_spec.masked_fill(~valid[:, None, :], float("-inf")).amax(dim=(1, 2), keepdim=True)
        log_spec = (torch.maximum(log_spec, row_max - 8.0) + 4.0) / 4.0
        return log_spec.masked_fill(~valid[:, None, :], 0.0)
