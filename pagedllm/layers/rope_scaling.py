"""What each rope type rotates by: its inverse frequencies and cos/sin scale, as transformers computes them
(modeling_rope_utils: ``_compute_*_parameters`` and ``dynamic_rope_update``), and how many positions it serves.

The rotary table (layers/rotary.py) holds one row per position, so every type is a function of the position
alone. ``linear``, ``llama3`` and ``yarn`` use one set of frequencies for all positions. transformers recomputes
``dynamic`` and ``longrope`` in each forward from its sequence length ``max(position) + 1``; here row ``p`` uses the
frequencies of ``seq_len = p + 1``, the ones transformers uses for the token at ``p`` when it generates one token at
a time with a KV cache (a key keeps the rotation it got when it was cached, in both). That equals transformers'
``generate`` token for token whenever the prompt fits the original length (``max_position_embeddings`` for
dynamic, ``original_max_position_embeddings`` for longrope). A longer prompt is rotated per position here, where
transformers rotates the whole prompt with the frequencies of its full length. Phi-3's generate is the exception:
when its sequence first outgrows the original length it drops its KV cache and encodes the whole sequence again
with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation), so there the two agree only while sequences
fit the original length. (vLLM takes longrope's long factors at every position when max_model_len exceeds the
original length, else the short ones.)
"""

import math

import torch


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """A copy of ``config``'s rope parameters, standardised as transformers' ``standardize_rope_params`` does:
    ``rope_type`` (from the legacy ``type`` too), ``rope_theta``, ``partial_rotary_factor``, and for the types
    that read it ``original_max_position_embeddings`` (a value beside the rope parameters wins, as Phi-3 keeps
    it there; else max_position_embeddings). transformers >= 5 keeps them in ``config.rope_parameters``, older
    configs in ``config.rope_scaling`` with ``rope_theta`` beside. "su" is longrope's old name (Phi-3's config
    also renames its "yarn" to longrope, which a config transformers built has already done). ``layer_type``: the
    parameters of that kind of layer, where the config keeps one set per kind (Gemma 3's "sliding_attention" and
    "full_attention")."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        beside = getattr(config, "original_max_position_embeddings", None)
        if beside is not None:
            params["original_max_position_embeddings"] = beside
        params.setdefault("original_max_position_embeddings", max_position_embeddings(config))
    return params


def parameter_sets(config) -> list[dict]:
    """Each of the config's rope parameter sets, standardised (rope_parameters): one, or one per kind of layer where
    the config keeps them so (Gemma 3)."""
    raw = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    return [rope_parameters(config, layer_type)
            for layer_type in [key for key, value in raw.items() if isinstance(value, dict)] or [None]]


def check_rope_types(config) -> None:
    """A ValueError naming the config's rope type where one of its rope parameter sets (Gemma 3 keeps one per kind
    of layer) has a type not served, before any weight is read."""
    for params in parameter_sets(config):
        _check_rope_type(params["rope_type"])


def _check_rope_type(rope_type: str) -> None:
    if rope_type not in _INV_FREQ:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(sorted(_INV_FREQ))}")


def max_position_embeddings(config) -> int:
    """The context the model was trained for (2048 when the config does not say)."""
    return getattr(config, "max_position_embeddings", None) or 2048


def positions_served(config) -> int:
    """The longest context the model serves: see ``scaled_max_position``."""
    return scaled_max_position(rope_parameters(config), max_position_embeddings(config))


def default_max_model_len(config) -> int:
    """The context served when max_model_len is not given: the positions served, but for a longrope model (Phi-3's
    long-context ones) its original context, as vLLM's default. Past that length transformers rotates a whole prompt
    by the long factors, which the table's rows before it do not hold (see the module's docstring): a longer context
    is served when asked for."""
    longrope = [params["original_max_position_embeddings"] for params in parameter_sets(config)
                if params["rope_type"] == "longrope"]
    return min([positions_served(config), *longrope])


def scaled_max_position(params: dict, max_position: int) -> int:
    """The positions a model with these rope parameters serves, as vLLM derives its max_model_len: linear and
    dynamic scaling stretch ``max_position`` (max_position_embeddings) by their factor; llama3, yarn and longrope
    configs already give the extended context as max_position_embeddings (transformers' convention for yarn: its
    factor is max_position_embeddings / original_max_position_embeddings, a config where they disagree keeps
    max_position_embeddings, as vLLM 0.32 does). Never fewer than ``max_position``, which transformers' own model
    serves."""
    scaled = max_position
    if params["rope_type"] in ("linear", "dynamic"):
        scaled = max_position * params["factor"]
    return max(max_position, int(scaled))


def inv_freq_and_scale(params: dict, rotary_dim: int, max_position: int, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, float]:
    """For ``params["rope_type"]``: the inverse frequencies (float32 ``[rotary_dim / 2]`` for all positions, or
    ``[len(positions), rotary_dim / 2]``, one row per position of ``positions``) and the factor that multiplies
    cos and sin (transformers' attention_scaling). ``max_position``: the config's max_position_embeddings."""
    rope_type = params["rope_type"]
    _check_rope_type(rope_type)
    inv_freq, scale = _INV_FREQ[rope_type](params, rotary_dim, max_position, positions)
    if "freq_factors" in params:  # a GGUF's rope_freqs (models/gguf_config.py): each frequency divided, as llama.cpp
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    return inv_freq, scale


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def _default(params, dim, max_position, positions):
    return _default_inv_freq(params["rope_theta"], dim), 1.0


def _linear(params, dim, max_position, positions):
    """Positions divided by ``factor``, as the frequencies are."""
    return _default_inv_freq(params["rope_theta"], dim) / params["factor"], 1.0


def _llama3(params, dim, max_position, positions):
    """Llama 3.1: slow down low frequencies, blend the middle band."""
    inv_freq = _default_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_factor(params: dict, max_position: int) -> float:
    """yarn's ``factor``; a config that gives None means the ratio of the extended to the original context."""
    factor = params["factor"]
    return max_position / params["original_max_position_embeddings"] if factor is None else factor


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params, dim, max_position, positions):
    """YaRN: interpolate (divide by ``factor``) the low frequencies, keep the high ones, ramp between the
    dimensions where the original context turns ``beta_slow`` and ``beta_fast`` times; scale cos/sin by
    ``attention_factor`` (from ``factor`` and, given both, ``mscale`` / ``mscale_all_dim``)."""
    base = params["rope_theta"]
    factor = _yarn_factor(params, max_position)
    original = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


def _dynamic(params, dim, max_position, positions):
    """Dynamic NTK: the default frequencies up to ``max_position``; past it the base grows with the sequence
    length, row ``p`` taking ``seq_len = p + 1``. In float32 as transformers computes it from its one-element
    seq_len tensor, whose power torch takes in float64 and rounds (a vectorised float32 power differs in the
    last bit)."""
    factor = params["factor"]
    seq_len = positions + 1
    ratio = (factor * seq_len.to(torch.float32) / max_position) - (factor - 1)
    base = params["rope_theta"] * (ratio.double() ** (dim / (dim - 2))).float()
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    grown = 1.0 / (base.unsqueeze(-1) ** exponents)
    default = _default_inv_freq(params["rope_theta"], dim)
    return torch.where((seq_len > max_position).unsqueeze(-1), grown, default), 1.0


def _longrope(params, dim, max_position, positions):
    """LongRoPE (Phi-3): the frequencies divided per dimension by ``short_factor``, or by ``long_factor`` for the
    rows ``p`` with ``p + 1 > original_max_position_embeddings``; cos/sin scaled by ``attention_factor`` at every
    position (by default from ``factor``, itself by default max_position_embeddings / original)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    short, long = (1.0 / (torch.tensor(params[key], dtype=torch.float32) * shape)
                   for key in ("short_factor", "long_factor"))
    return torch.where((positions + 1 > original).unsqueeze(-1), long, short), attention_factor


_INV_FREQ = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "dynamic": _dynamic,
    "longrope": _longrope,
}
