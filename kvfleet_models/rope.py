"""RoPE frequencies of a config, scaled as its family says (``RopeScaling``): the one place
both the torch model and the numpy reference take them from, so that the reference's parity
with transformers covers the torch model's frequencies too."""

from __future__ import annotations

import math

import numpy as np

from kvfleet_models.config import FREQ_FACTORS, LlamaConfig


def _yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_frequencies(cfg: LlamaConfig, local: bool = False) -> tuple[np.ndarray, float]:
    """(inv_freq [D/2] float64, the factor cos and sin are multiplied by): pair i of a head
    turns by ``position * inv_freq[i]``. The factor is 1 except for yarn and longrope.
    ``local``: the table of Gemma's local layers (``cfg.local_rope``): their own base, unscaled."""
    d, theta, s = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    if local:
        theta, s = cfg.local_rope_theta, None
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if s is None or s.kind == "dynamic":  # dynamic changes nothing up to max_position
        return inv_freq, 1.0
    if s.kind == "linear":
        return inv_freq / s.factor, 1.0
    if s.kind == "longrope":
        assert s.attention_factor is not None  # resolved by the loader, checked by RopeScaling
        return inv_freq / np.asarray(s.short_factor, dtype=np.float64), s.attention_factor
    if s.kind == FREQ_FACTORS:
        return inv_freq / np.asarray(s.freq_factors, dtype=np.float64), 1.0
    original = s.original_max_position or cfg.max_position
    if s.kind == "llama3":
        low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, blended, scaled), 1.0

    # yarn (transformers' _compute_yarn_parameters)
    def correction_dim(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: divide it by the factor
    inv_freq = inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation
    attention = s.attention_factor if s.attention_factor is not None else _yarn_mscale(s.factor)
    return inv_freq, float(attention)
