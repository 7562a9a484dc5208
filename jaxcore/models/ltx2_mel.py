"""LTX-2's audio preprocessing: a waveform -> the log-mel spectrogram its audio VAE encodes.

Reference: the LTX-2 repository (github.com/Lightricks/LTX-2), ``ltx_core.model.audio_vae.ops.
AudioProcessor`` and ``ltx-trainer``'s ``scripts/process_videos.py`` (``_extract_audio``,
``_encode_audio``); diffusers 0.42 has no LTX-2 audio encoding path. What they compute:

- the clip's waveform trimmed, or zero-padded at the end, to the video's duration
  (``int(num_frames / fps * sample_rate)`` samples at the source rate: :func:`fit_duration`);
- stereo, as the audio VAE takes two channels: mono duplicated, 5.1 / 7.1 down-mixed with the
  trainer's normalised weights, any other layout averaged to mono then duplicated
  (:func:`to_stereo`);
- resampled to the audio VAE's ``sample_rate`` as ``torchaudio.functional.resample`` does by
  default (windowed-sinc, Hann window, ``lowpass_filter_width`` 6, ``rolloff`` 0.99:
  :func:`resample`);
- ``torchaudio.transforms.MelSpectrogram(n_fft, win_length=n_fft, hop_length, f_min=0,
  f_max=sample_rate / 2, n_mels, Hann window, center=True, reflect padding, power=1,
  mel_scale="slaney", norm="slaney")``, then ``log(clamp(mel, 1e-5))``, laid out
  ``[channels, time, mel]`` (:func:`log_mel_spectrogram`).

The audio VAE's diffusers config holds ``sample_rate``, ``mel_hop_length`` and ``mel_bins`` but
no FFT size: :data:`DEFAULT_N_FFT` is ltx-core's (``AudioEncoderConfigurator``'s
``stft.filter_length`` default, 1024, the released checkpoints' value).

Everything here is NumPy in float64 (the STFT of a short clip is cheap on the host), returned
as float32.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

DEFAULT_N_FFT = 1024  # ltx-core's stft filter_length default (the released LTX-2 audio VAE)
LOG_FLOOR = 1e-5  # AudioProcessor.waveform_to_mel: log(clamp(mel, min=1e-5))
# torchaudio.functional.resample's defaults (sinc_interp_hann)
LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99
# ltx-trainer's surround down-mixes (process_videos._encode_audio): weights summing to 1 per
# side; channel orders 5.1 = L R C LFE Ls Rs, 7.1 = L R C LFE Ls Rs Lb Rb
_SURROUND_MAIN = {6: 1.0 / 2.414, 8: 1.0 / 3.121}
_SURROUND_OTHER = {6: 0.707 / 2.414, 8: 0.707 / 3.121}
# the slaney mel scale (torchaudio's _hz_to_mel / _mel_to_hz with mel_scale="slaney")
_SLANEY_HZ_PER_MEL = 200.0 / 3
_SLANEY_MIN_LOG_HZ = 1000.0
_SLANEY_LOGSTEP = math.log(6.4) / 27.0


@dataclasses.dataclass(frozen=True)
class MelSettings:
    """The spectrogram an LTX-2 audio VAE encodes: its ``sample_rate``, ``mel_hop_length`` and
    ``mel_bins`` (config.json) and the FFT size (window = FFT size, as ltx-core)."""

    sample_rate: int
    hop_length: int
    mel_bins: int
    n_fft: int = DEFAULT_N_FFT

    def __post_init__(self):
        for key in ("sample_rate", "hop_length", "mel_bins", "n_fft"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)!r}")

    @classmethod
    def of_audio_vae(cls, config, n_fft: int = DEFAULT_N_FFT) -> MelSettings:
        """The settings of an :class:`jaxcore.models.ltx2_audio_vae.LTX2AudioVAEConfig`."""
        if config.mel_bins is None:
            raise ValueError("the audio VAE's mel_bins is None: its spectrogram size is unknown")
        return cls(config.sample_rate, config.mel_hop_length, config.mel_bins, n_fft)

    def frames(self, samples: int) -> int:
        """Spectrogram frames of ``samples`` samples (centred STFT: ``1 + samples // hop``)."""
        return 1 + samples // self.hop_length


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, np.float64)
    linear = hz / _SLANEY_HZ_PER_MEL
    min_log_mel = _SLANEY_MIN_LOG_HZ / _SLANEY_HZ_PER_MEL
    logarithmic = min_log_mel + np.log(np.maximum(hz, 1e-12) / _SLANEY_MIN_LOG_HZ) / _SLANEY_LOGSTEP
    return np.where(hz >= _SLANEY_MIN_LOG_HZ, logarithmic, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, np.float64)
    min_log_mel = _SLANEY_MIN_LOG_HZ / _SLANEY_HZ_PER_MEL
    linear = mel * _SLANEY_HZ_PER_MEL
    logarithmic = _SLANEY_MIN_LOG_HZ * np.exp(_SLANEY_LOGSTEP * (mel - min_log_mel))
    return np.where(mel >= min_log_mel, logarithmic, linear)


def mel_filterbank(settings: MelSettings) -> np.ndarray:
    """``[n_fft // 2 + 1, mel_bins]`` float64: torchaudio's ``melscale_fbanks`` from 0 Hz to
    Nyquist, slaney scale, each triangle scaled by ``2 / (its band's width in Hz)`` (slaney
    norm). The FFT bins run to ``sample_rate // 2`` (torchaudio's integer division)."""
    n_freqs = settings.n_fft // 2 + 1
    bin_hz = np.linspace(0.0, settings.sample_rate // 2, n_freqs)
    top = _hz_to_mel(settings.sample_rate / 2.0)
    edges_hz = _mel_to_hz(np.linspace(_hz_to_mel(0.0), top, settings.mel_bins + 2))
    widths = np.diff(edges_hz)
    to_edge = edges_hz[None, :] - bin_hz[:, None]  # [freqs, mel_bins + 2]
    rising = -to_edge[:, :-2] / widths[:-1]
    falling = to_edge[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(rising, falling))
    return bank * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]


def _stft_magnitude(waveform: np.ndarray, settings: MelSettings) -> np.ndarray:
    """``|STFT|`` ``[C, frames, n_fft // 2 + 1]`` float64: reflect-padded by ``n_fft // 2``
    each side (``center=True``), periodic Hann window, unnormalised, one-sided."""
    n_fft, hop = settings.n_fft, settings.hop_length
    half = n_fft // 2
    if waveform.shape[-1] <= half:
        raise ValueError(
            f"waveform of {waveform.shape[-1]} samples: a centred STFT with n_fft={n_fft} "
            f"reflects {half} samples, it needs more than that"
        )
    padded = np.pad(waveform, ((0, 0), (half, half)), mode="reflect")
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft, axis=-1)[:, ::hop]
    return np.abs(np.fft.rfft(frames * window, axis=-1))


def log_mel_spectrogram(waveform: np.ndarray, settings: MelSettings) -> np.ndarray:
    """A waveform ``[channels, samples]`` at ``settings.sample_rate`` -> the log-mel
    spectrogram ``[channels, 1 + samples // hop, mel_bins]`` float32 the audio VAE encodes
    (ltx-core's ``AudioProcessor.waveform_to_mel`` without its resampling)."""
    waveform = np.asarray(waveform, np.float64)
    if waveform.ndim != 2:
        raise ValueError(f"waveform must be [channels, samples], got shape {waveform.shape}")
    magnitude = _stft_magnitude(waveform, settings)
    mel = magnitude @ mel_filterbank(settings)
    return np.log(np.maximum(mel, LOG_FLOOR)).astype(np.float32)


def _sinc_kernel(orig: int, new: int) -> tuple[np.ndarray, int]:
    """torchaudio's ``_get_sinc_resample_kernel`` (sinc_interp_hann) for rates already divided
    by their gcd: (``[new, 2 width + orig]`` float64, ``width``)."""
    base = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / base)
    taps = np.arange(-width, width + orig, dtype=np.float64)[None, :] / orig
    t = (np.arange(0, -new, -1, dtype=np.float64)[:, None] / new + taps) * base
    t = np.clip(t, -LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = np.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t = t * math.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        sinc = np.where(t == 0, 1.0, np.sin(t) / t)
    return sinc * window * (base / orig), width


def resample(waveform: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """``[channels, samples]`` at ``orig_rate`` -> ``[channels, ceil(samples new / orig)]`` at
    ``new_rate`` float32, as ``torchaudio.functional.resample(waveform, orig, new)`` with its
    defaults (ltx-core's ``AudioProcessor.resample_audio``); equal rates return the input."""
    waveform = np.asarray(waveform, np.float64)
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sample rates must be > 0, got {orig_rate} -> {new_rate}")
    if orig_rate == new_rate:
        return waveform.astype(np.float32)
    gcd = math.gcd(int(orig_rate), int(new_rate))
    orig, new = int(orig_rate) // gcd, int(new_rate) // gcd
    kernel, width = _sinc_kernel(orig, new)
    length = waveform.shape[-1]
    padded = np.pad(waveform, ((0, 0), (width, width + orig)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel.shape[1], axis=-1)[:, ::orig]
    out = (windows @ kernel.T).reshape(waveform.shape[0], -1)  # [C, steps * new]
    return out[:, : math.ceil(new * length / orig)].astype(np.float32)


def to_stereo(waveform: np.ndarray) -> np.ndarray:
    """``[channels, samples]`` -> ``[2, samples]`` as ltx-trainer feeds the audio VAE: mono
    duplicated, stereo kept, 5.1 / 7.1 down-mixed (centre and surrounds at 0.707 of the front
    side, normalised), any other layout averaged then duplicated."""
    waveform = np.asarray(waveform, np.float64)
    channels = waveform.shape[0]
    if channels == 2:
        return waveform
    if channels in _SURROUND_MAIN:
        main, other = _SURROUND_MAIN[channels], _SURROUND_OTHER[channels]
        back = (waveform[6], waveform[7]) if channels == 8 else (0.0, 0.0)
        left = main * waveform[0] + other * (waveform[2] + waveform[4] + back[0])
        right = main * waveform[1] + other * (waveform[2] + waveform[5] + back[1])
        return np.stack([left, right])
    mono = waveform.mean(axis=0, keepdims=True)
    return np.concatenate([mono, mono])


def fit_duration(waveform: np.ndarray, sample_rate: int, seconds: float) -> np.ndarray:
    """The first ``int(seconds * sample_rate)`` samples of ``[channels, samples]``, zeros
    appended where the sound is shorter (ltx-trainer's ``_extract_audio``)."""
    target = int(seconds * sample_rate)
    waveform = np.asarray(waveform)[:, :target]
    missing = target - waveform.shape[-1]
    if missing > 0:
        waveform = np.pad(waveform, ((0, 0), (0, missing)))
    return waveform


def clip_spectrogram(
    waveform: np.ndarray, sample_rate: int, seconds: float, settings: MelSettings
) -> np.ndarray:
    """A clip's sound ``[channels, samples]`` at ``sample_rate`` -> the audio VAE's input
    ``[2, time, mel_bins]`` float32: fitted to ``seconds`` (the video's duration), stereo,
    resampled to the VAE's rate, log-mel (the module docstring's chain, ltx-trainer's order)."""
    fitted = fit_duration(waveform, sample_rate, seconds)
    stereo = to_stereo(fitted)
    return log_mel_spectrogram(resample(stereo, sample_rate, settings.sample_rate), settings)
