"""Whisper's fixed framing, defined once. Every model size shares it; the engine and (through the
engine package) the service use these names instead of bare numbers."""

from __future__ import annotations

SAMPLE_RATE = 16000  # Hz: what the feature extractor and the model expect
N_FFT = 400  # samples per STFT frame (25 ms)
HOP_LENGTH = 160  # samples between frames (10 ms): 100 mel frames per second
CHUNK_SECONDS = 30  # Whisper hears at most 30 s at once
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples in one window
FRAMES_PER_POSITION = 2  # conv2 has stride 2: one encoder position = 2 mel frames = 20 ms
POSITIONS_PER_SECOND = SAMPLE_RATE // (HOP_LENGTH * FRAMES_PER_POSITION)  # 50
