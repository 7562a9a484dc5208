"""LTX-2's audio preprocessing (jaxcore/models/ltx2_mel.py) against the reference's ops.

ltx-core's ``AudioProcessor`` is ``torchaudio.transforms.MelSpectrogram`` + ``log(clamp)`` and
``torchaudio.functional.resample``; torchaudio is not installed here (no wheel for this torch),
so the reference below is those torchaudio functions' ops written out in torch (torchaudio
2.x's ``melscale_fbanks`` slaney/slaney, ``Spectrogram`` = ``torch.stft`` with a periodic
Hann window, ``center=True``, reflect padding, power 1; ``_get_sinc_resample_kernel`` +
``_apply_sinc_resample_kernel``), in float64 (so the comparison measures our code, not float32
rounding) and once in float32 as torchaudio runs it by default.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jaxcore.models import ltx2_mel

RELEASED = ltx2_mel.MelSettings(sample_rate=16000, hop_length=160, mel_bins=64, n_fft=1024)
TINY = ltx2_mel.MelSettings(sample_rate=16000, hop_length=160, mel_bins=16, n_fft=1024)


def _torch_hz_to_mel(freq: float) -> float:  # torchaudio.functional._hz_to_mel, slaney
    f_sp = 200.0 / 3
    mels = freq / f_sp
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    if freq >= min_log_hz:
        mels = min_log_mel + math.log(freq / min_log_hz) / logstep
    return mels


def _torch_mel_to_hz(mels: torch.Tensor) -> torch.Tensor:  # _mel_to_hz, slaney
    f_sp = 200.0 / 3
    freqs = f_sp * mels
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    log_t = mels >= min_log_mel
    freqs[log_t] = min_log_hz * torch.exp(logstep * (mels[log_t] - min_log_mel))
    return freqs


def _torch_fbanks(s: ltx2_mel.MelSettings, dtype) -> torch.Tensor:  # melscale_fbanks
    n_freqs = s.n_fft // 2 + 1
    all_freqs = torch.linspace(0, s.sample_rate // 2, n_freqs, dtype=dtype)
    m_pts = torch.linspace(
        _torch_hz_to_mel(0.0), _torch_hz_to_mel(s.sample_rate / 2.0), s.mel_bins + 2, dtype=dtype
    )
    f_pts = _torch_mel_to_hz(m_pts)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)
    down = (-1.0 * slopes[:, :-2]) / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    fb = torch.max(torch.zeros(1, dtype=dtype), torch.min(down, up))
    enorm = 2.0 / (f_pts[2 : s.mel_bins + 2] - f_pts[: s.mel_bins])
    return fb * enorm.unsqueeze(0)


def _torch_log_mel(waveform: np.ndarray, s: ltx2_mel.MelSettings, dtype) -> np.ndarray:
    """MelSpectrogram(...)(waveform) -> log(clamp(., 1e-5)) -> [C, time, mel] (ltx-core)."""
    x = torch.from_numpy(waveform).to(dtype)
    spec = torch.stft(
        x,
        s.n_fft,
        hop_length=s.hop_length,
        win_length=s.n_fft,
        window=torch.hann_window(s.n_fft, dtype=dtype),
        center=True,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    ).abs()  # [C, freqs, time], power 1
    mel = torch.matmul(spec.transpose(-1, -2), _torch_fbanks(s, dtype)).transpose(-1, -2)
    return torch.log(torch.clamp(mel, min=1e-5)).permute(0, 2, 1).numpy()


def _torch_resample(waveform: np.ndarray, orig: int, new: int, dtype) -> np.ndarray:
    """torchaudio.functional.resample's default path (sinc_interp_hann, width 6, 0.99)."""
    gcd = math.gcd(orig, new)
    orig, new = orig // gcd, new // gcd
    base = min(orig, new) * 0.99
    width = math.ceil(6 * orig / base)
    idx = torch.arange(-width, width + orig, dtype=dtype)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new + idx
    t = (t * base).clamp(-6, 6)
    window = torch.cos(t * math.pi / 6 / 2) ** 2
    t = t * math.pi
    kernels = torch.where(t == 0, torch.tensor(1.0, dtype=dtype), t.sin() / t)
    kernels = kernels * window * (base / orig)
    x = torch.from_numpy(waveform).to(dtype)
    length = x.shape[-1]
    padded = torch.nn.functional.pad(x, (width, width + orig))
    out = torch.nn.functional.conv1d(padded[:, None], kernels, stride=orig)
    out = out.transpose(1, 2).reshape(x.shape[0], -1)
    return out[..., : math.ceil(new * length / orig)].numpy()


def _sound(channels: int, samples: int, seed: int = 0) -> np.ndarray:
    """Two tones and a little noise: energy across the mel bands, some bins near the floor."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / 16000.0
    tones = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3100 * t)
    return (tones[None] + 0.05 * rng.standard_normal((channels, samples))).astype(np.float32)


@pytest.mark.parametrize("settings", [RELEASED, TINY], ids=["released", "tiny"])
def test_log_mel_equals_the_reference_ops(settings):
    wave = _sound(2, 6000)  # 9 frames at 24 fps: 38 spectrogram frames
    ours = ltx2_mel.log_mel_spectrogram(wave, settings)
    assert ours.shape == (2, 38, settings.mel_bins) and ours.dtype == np.float32
    exact = _torch_log_mel(wave.astype(np.float64), settings, torch.float64)
    error = np.abs(ours - exact).max()
    print(f"log-mel vs the float64 reference: {error:.2e} (values up to {np.abs(exact).max():.1f})")
    assert error < 1e-5
    as_run = _torch_log_mel(wave, settings, torch.float32)  # torchaudio's own float32
    assert np.abs(ours - as_run).max() < 1e-3


@pytest.mark.parametrize("rates", [(44100, 16000), (48000, 16000), (8000, 16000), (22050, 24000)])
def test_resample_equals_torchaudios_kernel(rates):
    wave = _sound(2, 4410)
    ours = ltx2_mel.resample(wave, *rates)
    ref = _torch_resample(wave.astype(np.float64), *rates, torch.float64)
    assert ours.shape == ref.shape == (2, math.ceil(4410 * rates[1] / rates[0]))
    assert np.abs(ours - ref).max() < 1e-6
    assert np.array_equal(ltx2_mel.resample(wave, 16000, 16000), wave)


def test_resampled_tone_is_the_tone_at_the_new_rate():
    """An independent check of the kernel: a 440 Hz tone from 48 kHz is the same tone at 16 kHz
    (away from the zero-padded ends)."""
    t = np.arange(4800) / 48000.0
    wave = np.sin(2 * np.pi * 440 * t)[None]
    out = ltx2_mel.resample(wave, 48000, 16000)
    want = np.sin(2 * np.pi * 440 * np.arange(out.shape[1]) / 16000.0)
    assert np.abs(out[0, 100:-100] - want[100:-100]).max() < 2e-3


def test_stereo_duration_and_chain():
    mono = _sound(1, 100)
    assert np.array_equal(ltx2_mel.to_stereo(mono), np.concatenate([mono, mono]))
    surround = _sound(6, 50)
    left = (surround[0] + 0.707 * (surround[2] + surround[4])) / 2.414
    np.testing.assert_allclose(ltx2_mel.to_stereo(surround)[0], left, rtol=1e-6, atol=1e-7)
    assert ltx2_mel.fit_duration(mono, 16000, 0.01).shape == (1, 160)
    padded = ltx2_mel.fit_duration(mono, 16000, 0.5)
    assert padded.shape == (1, 8000) and not padded[:, 100:].any()
    mel = ltx2_mel.clip_spectrogram(_sound(1, 20000), 44100, 9 / 24, TINY)
    # 0.375 s: int(0.375 * 44100) = 16537 samples, ceil(16537 * 160 / 441) = 6000 at 16 kHz
    assert mel.shape == (2, 38, 16)
