"""MFCCs in plain torch (torchaudio is not available): STFT -> mel filterbank -> log -> DCT-II.

Default: 16 kHz, 40 ms Hann window, 20 ms hop, 1 s clips -> 50 frames x 16 coefficients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MfccConfig:
    sample_rate: int = 16000  # Hz
    clip_samples: int = 16000  # clips are cut / zero-padded to this length
    win_length: int = 640  # 40 ms Hann window
    hop_length: int = 320  # 20 ms hop
    n_fft: int = 1024
    n_mels: int = 40
    n_mfcc: int = 16
    f_min: float = 20.0
    f_max: float = 4000.0
    frames: int = 50  # output frames (the clip is padded on the right to give exactly this many)


def _hz_to_mel(f):
    return 2595.0 * math.log10(1.0 + f / 700.0)


def mel_filterbank(cfg: MfccConfig) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular HTK-mel filters."""
    n_freq = cfg.n_fft // 2 + 1
    freqs = torch.linspace(0, cfg.sample_rate / 2, n_freq, dtype=torch.float64)
    mels = torch.linspace(_hz_to_mel(cfg.f_min), _hz_to_mel(cfg.f_max), cfg.n_mels + 2, dtype=torch.float64)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    lo, ce, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (freqs[None] - lo) / (ce - lo)
    down = (hi - freqs[None]) / (hi - ce)
    return torch.clamp(torch.minimum(up, down), min=0.0).float()


def dct_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """Orthonormal DCT-II as an [n_in, n_out] matrix (x @ D)."""
    n = torch.arange(n_in, dtype=torch.float64)
    k = torch.arange(n_out, dtype=torch.float64)
    d = torch.cos(math.pi / n_in * (n[:, None] + 0.5) * k[None]) * math.sqrt(2.0 / n_in)
    d[:, 0] /= math.sqrt(2.0)
    return d.float()


def mfcc(wave: torch.Tensor, cfg: MfccConfig = MfccConfig()) -> torch.Tensor:
    """``wave`` [N, samples] float in [-1, 1] -> [N, frames, n_mfcc]."""
    if wave.dim() == 1:
        wave = wave[None]
    need = cfg.n_fft + (cfg.frames - 1) * cfg.hop_length  # stft frames use n_fft samples
    x = wave[:, : cfg.clip_samples].float()
    x = torch.nn.functional.pad(x, (0, need - x.shape[1])) if x.shape[1] < need else x[:, :need]
    window = torch.hann_window(cfg.win_length, dtype=x.dtype)
    spec = torch.stft(
        x,
        cfg.n_fft,
        hop_length=cfg.hop_length,
        win_length=cfg.win_length,
        window=window,
        center=False,
        return_complex=True,
    )  # [N, freq, frames]
    power = spec.abs() ** 2
    mel = torch.einsum("mf,nft->ntm", mel_filterbank(cfg), power)
    logmel = torch.log(mel + 1e-6)
    return logmel @ dct_matrix(cfg.n_mels, cfg.n_mfcc)
