"""The three SwiftKV config fields, shared by every model family.

The names and meanings match the published SwiftKV checkpoints (``config.json`` of e.g. the
Llama-3.1-8B SwiftKV instruct model), so checkpoints move both ways.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SwiftKVFields:
    """Mixed into each family's config class (transformers 5 configs are strict dataclasses)."""

    swiftkv: bool = False
    """Whether the student path is on. ``False`` makes the model exactly its base model (the teacher)."""

    num_key_value_layers: int | None = None
    """The cutoff ``c``: layers ``0..c-1`` keep their own KV; later layers take K/V from the state
    entering layer ``c``. ``None`` means half the layers (50% SwiftKV)."""

    key_value_group_size: int = 1
    """AcrossKV group size ``g`` (1 = off): layers ``c..L-1`` form contiguous groups of ``g`` that
    share the KV of the group's first layer. ``(L - c)`` must be divisible by ``g``."""

    key_value_shift_layers: list[int] | None = None
    """Token shift, a variant beyond the published layout (docs/distillation.md, "Token shift"):
    the group leaders whose SwiftKV K/V also read the normed cutoff state of the
    ``key_value_shift_tokens`` tokens before each token (extra ``k/v_shift_swiftkv`` projections).
    It serves layers whose keys read a previous-token head that sits after the cutoff. ``None``: off."""

    key_value_shift_tokens: int = 0
    """How many tokens before each token those layers read (``1`` or ``2`` in practice; 0 = off)."""

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        # transformers reads the saved 4.x ``rope_scaling`` (see with_legacy_rope_fields) back into
        # ``rope_parameters``, older ``type`` key included: drop that duplicate of ``rope_type``.
        params = getattr(self, "rope_parameters", None)
        if isinstance(params, dict) and params.get("type") == params.get("rope_type"):
            params.pop("type", None)
        self.validate_swiftkv()

    def to_dict(self) -> dict:
        """The config as saved, with RoPE also in the form transformers 4.x reads (see
        :func:`with_legacy_rope_fields`), and the token-shift fields only when there is one."""
        fields = with_legacy_rope_fields(super().to_dict())
        if not fields.get("key_value_shift_layers"):  # without a token shift: exactly the published layout
            fields.pop("key_value_shift_layers", None)
            fields.pop("key_value_shift_tokens", None)
        return fields

    def validate_swiftkv(self) -> None:
        """Fill the cutoff default and check the SwiftKV fields against the layer count."""
        num_layers = self.num_hidden_layers
        if self.num_key_value_layers is None:
            self.num_key_value_layers = default_cutoff(num_layers)
        check_swiftkv_shape(num_layers, self.num_key_value_layers, self.key_value_group_size)
        check_token_shift(self)


@dataclass(frozen=True)
class TokenShift:
    """The token-shift fields of a conversion (``swiftkv convert``, the distillation's ``token_shift``)."""

    layers: tuple[int, ...] = ()
    """Group leaders whose SwiftKV K/V also read the tokens before (config ``key_value_shift_layers``)."""

    tokens: int = 0
    """Tokens before each token they read (config ``key_value_shift_tokens``)."""

    def config_fields(self) -> dict:
        return {"key_value_shift_layers": list(self.layers) or None, "key_value_shift_tokens": self.tokens}


NO_SHIFT = TokenShift()
"""The token shift off: every conversion's default."""


def shift_layers(config) -> list[int]:
    """The layers whose SwiftKV K/V read the tokens before (the token shift); empty when off."""
    return list(getattr(config, "key_value_shift_layers", None) or [])


def check_token_shift(config) -> None:
    """Raise ``ValueError`` naming the problem if the token-shift fields do not fit the layout."""
    layers, tokens = shift_layers(config), getattr(config, "key_value_shift_tokens", 0)
    if bool(layers) != (tokens > 0):
        raise ValueError(f"key_value_shift_layers={layers} and key_value_shift_tokens={tokens}: give both "
                         "(layers and a count >= 1) or neither")
    c, g = config.num_key_value_layers, config.key_value_group_size
    leaders = range(c, config.num_hidden_layers, g)
    stray = [j for j in layers if j not in leaders]
    if stray or len(set(layers)) != len(layers):
        raise ValueError(f"key_value_shift_layers={layers}: each must be named once and be a layer that computes "
                         f"SwiftKV K/V ({list(leaders)} at num_key_value_layers={c}, key_value_group_size={g})")


DEFAULT_SIMSCORE_THRESHOLD = 0.5
"""SimScore level from which a cutoff is recommended: where the curve passes about 0.5 near half
depth, 50% SwiftKV tends to work (SPEC.md)."""


def layer_types(config) -> list[str]:
    """Per-layer attention kind: Qwen2 lists them; Mistral's window (if any) covers all layers.
    A config fact read by the HF model, the vLLM model and the cost model alike."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * config.num_hidden_layers


def with_legacy_rope_fields(fields: dict) -> dict:
    """``fields`` (a config dict) plus RoPE as transformers 4.x reads it: top-level ``rope_theta`` and
    ``rope_scaling`` (``None`` for plain RoPE), whose kind is also under the older key ``type``:
    DeepSeek-V2's remote code (and the reference SwiftKV classes built on it) reads only that one.

    transformers 5 keeps RoPE in ``rope_parameters`` (theta included) and reads either form; 4.x
    reads only the top-level keys and, without them, silently uses theta 10000 with no scaling (a
    converted Llama-3.1 or Qwen2.5 would then give wrong logits there). Per-layer-type RoPE (a
    nested ``rope_parameters``) has no 4.x form and is left as it is."""
    params = fields.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        return fields
    scaling = {key: value for key, value in params.items() if key != "rope_theta"}
    plain = scaling.get("rope_type", "default") == "default"
    if not plain:
        scaling["type"] = scaling["rope_type"]
    return {**fields, "rope_theta": params["rope_theta"], "rope_scaling": None if plain else scaling}


DEFAULT_SKIPPED_SHARE = 0.5
"""The paper's 50% SwiftKV: the share of layers prompt tokens skip when no cutoff is given."""


def default_cutoff(num_layers: int) -> int:
    """The cutoff when none is given, for every entry point (config, ``swiftkv convert``, jobs):
    50% SwiftKV by the rule of :func:`cutoff_from_fraction` (``ceil(L / 2)`` for odd ``L``)."""
    return cutoff_from_fraction(num_layers, DEFAULT_SKIPPED_SHARE)


def check_swiftkv_shape(num_layers: int, num_key_value_layers: int, key_value_group_size: int) -> None:
    """Raise ``ValueError`` naming the problem if ``(L, c, g)`` is not a valid SwiftKV layout."""
    c, g = num_key_value_layers, key_value_group_size
    if not 1 <= c < num_layers:
        raise ValueError(
            f"num_key_value_layers={c} is out of range: it must be between 1 and {num_layers - 1} "
            f"for a model with {num_layers} layers (layer 0 always keeps its own KV, and at least "
            "one layer must follow the cutoff)."
        )
    if g < 1 or (num_layers - c) % g != 0:
        raise ValueError(
            f"key_value_group_size={g} must be >= 1 and divide the {num_layers - c} layers after the "
            f"cutoff (num_hidden_layers={num_layers}, num_key_value_layers={c})."
        )


def cutoff_from_fraction(num_layers: int, fraction: float) -> int:
    """The cutoff for the paper's "F SwiftKV", F being the share of layers that prompt tokens skip:
    ``c = ceil(L (1 - F))`` (never skipping more than F), kept within ``1..L-1``.
    ``0.5`` gives ``c = L/2``; ``0.25`` gives ``c = 3L/4``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"--cutoff must be a fraction strictly between 0 and 1 (0.5 = 50% SwiftKV), got {fraction}")
    return min(max(math.ceil(num_layers * (1 - fraction) - 1e-9), 1), num_layers - 1)


def attention_head_dim(config) -> int:
    """Width of one attention head: ``head_dim`` when the config sets it, else ``hidden / heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def qkv_has_bias(config) -> bool:
    """Whether q/k/v (and their SwiftKV copies) carry biases: Qwen2 always, Llama and Mistral when
    ``attention_bias`` is set. Shared by the cost model and the vLLM model."""
    return config.model_type.removesuffix("_swiftkv") == "qwen2" or bool(getattr(config, "attention_bias", False))


def has_qk_norm(config) -> bool:
    """Whether each query and key head goes through an RMSNorm before rotary (Qwen3's ``q_norm``/``k_norm``).
    Shared by the cost model and the vLLM model."""
    return config.model_type.removesuffix("_swiftkv") == "qwen3"


def is_latent_attention(config) -> bool:
    """DeepSeek-V2's multi-head latent attention (the cache holds a latent, not per-head K/V): a
    config fact beside ``has_qk_norm``, read by the cost model."""
    return config.model_type.removesuffix("_swiftkv") == "deepseek_v2"


def is_moe_layer(config, layer: int) -> bool:
    """Whether ``layer`` of a mixture-of-experts model (DeepSeek-V2) runs experts rather than a dense
    MLP: vLLM's rule (``moe_layer_freq`` included; transformers ignores it, and the published
    DeepSeek-V2 configs set it to 1, where the two agree). Shared by the cost model and the vLLM model."""
    return (getattr(config, "n_routed_experts", None) is not None and layer >= config.first_k_dense_replace
            and layer % getattr(config, "moe_layer_freq", 1) == 0)
