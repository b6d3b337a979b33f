"""Analytic cost model of SwiftKV from a model config alone: prefill FLOPs per prompt token, KV-cache
bytes per token, and the trainable-parameter count of the distillation.

Conventions (they reproduce the paper's Llama-3.1-70B table, see the README):

- A linear layer costs ``2 * in * out`` FLOPs per token (one multiply and one add); biases, norms,
  rotary and softmax are ignored (under 0.1% here).
- ``vocab`` follows the paper: the embedding and the LM head are each counted as an ``h x V`` matmul
  for every token (``4 h V``). Real prefill computes logits for the last token only and looks the
  embedding up, so :func:`predicted_prefill_ratio` leaves this term out.
- ``attention`` is the ``Q K^T`` and ``A V`` matmuls of a causal prefill of ``seq_len`` tokens,
  averaged over its tokens: token ``i`` attends to ``min(i, window)`` keys, each costing
  ``4 * num_heads * head_dim`` FLOPs. The paper's 160 GF for Llama-3.1-70B is this at 120K
  (122,880) tokens; a 128K prompt gives 172 GF.
- A SwiftKV prompt token runs layers ``0..c-1`` in full, then one K/V projection per AcrossKV
  group leader from the state entering layer ``c``; the last token's full pass is not counted.
- A mixture-of-experts MLP counts what one token runs: the router, the shared experts and
  ``num_experts_per_tok`` routed experts (the active ones), not every expert.
- DeepSeek-V2's latent attention: the K/V part is the latent projection (``kv_a_proj_with_mqa``)
  plus the expansion of the token's latent into every head's key and value (``kv_b_proj``), as the
  Hugging Face model and vLLM's prefill compute it; attention costs ``2 * heads * (qk_head_dim +
  v_head_dim)`` per key; the cache holds ``kv_lora_rank + qk_rope_head_dim`` elements per token
  and layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from swiftkv.config import (
    attention_head_dim,
    check_swiftkv_shape,
    has_qk_norm,
    is_latent_attention,
    is_moe_layer,
    layer_types,
    qkv_has_bias,
    shift_layers,
)

# Bytes per stored K or V element for --kv-cache-dtype.
KV_CACHE_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# The reference the KV reductions are quoted against (as in the paper): the base model's 16-bit cache.
BASE_KV_CACHE_DTYPE = "bf16"


def load_config(spec: str | Path):
    """A transformers config from a ``config.json`` path, a model folder, a hub id (offline: cached)
    or ``bundled`` / ``bundled-swiftkv``, as every other command's model argument."""
    from transformers import AutoConfig

    from swiftkv.model_source import BUNDLED, BUNDLED_SWIFTKV, resolve_model

    if str(spec) in (BUNDLED, BUNDLED_SWIFTKV):
        spec = resolve_model(spec)
    if str(spec).endswith(".json") and not Path(spec).is_file():
        raise FileNotFoundError(f"config file {spec} does not exist")
    try:
        config = AutoConfig.from_pretrained(spec)
    except OSError as err:
        raise FileNotFoundError(f"{spec}: not a config file, a model folder or a cached hub id ({err})") from err
    except ValueError as err:  # e.g. no or unknown model_type
        raise ValueError(f"{spec}: not a usable model config ({err})") from err
    check_family(config.model_type, spec)
    return config


def check_family(model_type: str, source: object) -> None:
    from swiftkv.modeling import FAMILIES

    supported = (*FAMILIES, *(config_cls.model_type for config_cls, _ in FAMILIES.values()))
    if model_type not in supported:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(supported)})")


@dataclass(frozen=True)
class Part:
    """One part of a layer: the matmul weights a token runs through, and its other parameters
    (biases, norm weights), whose FLOPs the model ignores."""

    weights: int
    extra: int = 0

    @property
    def params(self) -> int:
        return self.weights + self.extra


@dataclass(frozen=True)
class ModelShape:
    """The sizes the cost model needs, per layer part, read from a Llama/Mistral/Qwen2/Qwen3/DeepSeek-V2
    (or SwiftKV) config. The query and key/value parts are exactly what SwiftKV copies (the query part
    of every layer after the cutoff, the key/value part of every AcrossKV group leader)."""

    num_layers: int
    hidden: int
    vocab: int
    tied_embeddings: bool
    query: Part
    """The query path of one layer (Qwen3: with its per-head norm; DeepSeek-V2: q_proj, or q_a/q_b)."""
    key_value: Part
    """The key/value path of one layer (DeepSeek-V2: the latent projection, its norm and its expansion)."""
    output: Part
    """The attention output projection."""
    mlps: tuple[Part, ...]
    """Per layer, the MLP as one token runs it: for a mixture of experts the router, the shared
    experts and ``num_experts_per_tok`` routed experts (the active ones)."""
    mlp_params: tuple[int, ...]
    """Per layer, every parameter of the MLP (all experts)."""
    attention_per_key: int
    """FLOPs of ``Q K^T`` and ``A V`` over all heads, per attended key."""
    kv_cache_width: int
    """Elements one layer's cache holds per token: K and V, or DeepSeek-V2's latent and rotary key part."""
    attention_windows: tuple[int | None, ...]
    """Per layer: the sliding window, or ``None`` for full attention."""

    @classmethod
    def from_config(cls, config) -> ModelShape:
        check_family(config.model_type, "config")
        attention = _latent_attention(config) if is_latent_attention(config) else _dense_attention(config)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        dense_mlp = Part(3 * config.hidden_size * config.intermediate_size,
                         (2 * config.intermediate_size + config.hidden_size) * mlp_bias)
        mlps = [_moe(config) if is_moe_layer(config, i) else (dense_mlp, dense_mlp.params)
                for i in range(config.num_hidden_layers)]
        window = getattr(config, "sliding_window", None)
        return cls(
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            tied_embeddings=bool(config.tie_word_embeddings),
            **attention,
            mlps=tuple(active for active, _ in mlps),
            mlp_params=tuple(total for _, total in mlps),
            attention_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types(config)),
        )



def _dense_attention(config) -> dict:
    hidden, bias, norm = config.hidden_size, qkv_has_bias(config), has_qk_norm(config)
    head_dim = attention_head_dim(config)
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return dict(
        query=Part(hidden * q_size, q_size * bias + head_dim * norm),
        key_value=Part(2 * hidden * kv_size, 2 * kv_size * bias + head_dim * norm),
        output=Part(q_size * hidden, hidden * bool(getattr(config, "attention_bias", False))),
        attention_per_key=4 * q_size,
        kv_cache_width=2 * kv_size,
    )


def _latent_attention(config) -> dict:
    hidden, heads, bias = config.hidden_size, config.num_attention_heads, bool(config.attention_bias)
    qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    latent, rope = config.kv_lora_rank, config.qk_rope_head_dim
    if config.q_lora_rank is None:
        query = Part(hidden * heads * qk_head)
    else:  # q_a_proj (bias as attention_bias), q_a_layernorm, q_b_proj
        rank = config.q_lora_rank
        query = Part(hidden * rank + rank * heads * qk_head, rank * bias + rank)
    expansion = latent * heads * (config.qk_nope_head_dim + config.v_head_dim)
    return dict(
        query=query,
        key_value=Part(hidden * (latent + rope) + expansion, (latent + rope) * bias + latent),
        output=Part(heads * config.v_head_dim * hidden, hidden * bias),
        attention_per_key=2 * heads * (qk_head + config.v_head_dim),
        kv_cache_width=latent + rope,
    )


def _moe(config) -> tuple[Part, int]:
    """(what one token runs, all parameters) of a mixture-of-experts layer."""
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    router = config.hidden_size * config.n_routed_experts
    active = Part(router + (config.num_experts_per_tok + config.n_shared_experts) * expert)
    return active, router + (config.n_routed_experts + config.n_shared_experts) * expert


def swiftkv_layout(config, num_key_value_layers: int | None, key_value_group_size: int | None) -> tuple[int, int]:
    """``(c, g)``: the given values, else the config's own SwiftKV fields; validated."""
    c = num_key_value_layers if num_key_value_layers is not None else getattr(config, "num_key_value_layers", None)
    g = key_value_group_size if key_value_group_size is not None else getattr(config, "key_value_group_size", 1)
    if c is None:
        raise ValueError("no cutoff: give num_key_value_layers (or a cutoff fraction), or a SwiftKV config")
    check_swiftkv_shape(config.num_hidden_layers, c, g)
    return c, g


def mean_attended_keys(seq_len: int, window: int | None) -> float:
    """Mean number of keys a token attends to in a causal prefill of ``seq_len`` tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    w = seq_len if window is None else min(window, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs per prompt token, by part."""

    vocab: float
    kv_proj: float
    qo_proj: float
    mlp: float
    attention: float

    @property
    def total(self) -> float:
        return self.vocab + self.kv_proj + self.qo_proj + self.mlp + self.attention

    def gflops(self) -> dict[str, float]:
        return {**{k: v / 1e9 for k, v in asdict(self).items()}, "total": self.total / 1e9}


def _prefill_flops(shape: ModelShape, seq_len: int, full_layers: int, kv_layers: int) -> PrefillFlops:
    """Prompt tokens run ``full_layers`` layers in full; K/V projections run ``kv_layers`` times."""
    return PrefillFlops(
        vocab=4 * shape.hidden * shape.vocab,
        kv_proj=kv_layers * 2 * shape.key_value.weights,
        qo_proj=full_layers * 2 * (shape.query.weights + shape.output.weights),
        mlp=sum(2 * mlp.weights for mlp in shape.mlps[:full_layers]),
        attention=sum(shape.attention_per_key * mean_attended_keys(seq_len, w)
                      for w in shape.attention_windows[:full_layers]),
    )


def prefill_flops(
    config, seq_len: int, num_key_value_layers: int | None = None, key_value_group_size: int = 1
) -> PrefillFlops:
    """Per-prompt-token FLOPs of the base model (``num_key_value_layers=None``) or of SwiftKV."""
    shape = ModelShape.from_config(config)
    if num_key_value_layers is None:
        return _prefill_flops(shape, seq_len, shape.num_layers, shape.num_layers)
    c, g = swiftkv_layout(config, num_key_value_layers, key_value_group_size)
    return _prefill_flops(shape, seq_len, c, c + (shape.num_layers - c) // g + shift_kv_projections(config))


def shift_kv_projections(config) -> int:
    """A token shift's extra K/V work, in K/V projections: each shift layer projects the states of
    ``key_value_shift_tokens`` tokens before (0 for a config without it)."""
    return len(shift_layers(config)) * getattr(config, "key_value_shift_tokens", 0)


def predicted_prefill_ratio(config, seq_len: int, num_key_value_layers: int, key_value_group_size: int = 1) -> float:
    """Predicted SwiftKV / base prefill time for prompts of ``seq_len`` tokens, assuming time follows
    FLOPs. The vocab term is left out: serving computes logits for the last token only."""
    base = prefill_flops(config, seq_len)
    swift = prefill_flops(config, seq_len, num_key_value_layers, key_value_group_size)
    return (swift.total - swift.vocab) / (base.total - base.vocab)


def kv_cache_bytes_per_token(config, num_kv_layers: int | None = None, dtype: str = BASE_KV_CACHE_DTYPE) -> int:
    """Bytes of K and V stored per token over ``num_kv_layers`` caches (default: every layer)."""
    if dtype not in KV_CACHE_DTYPE_BYTES:
        raise ValueError(f"unknown KV-cache dtype {dtype!r} (known: {', '.join(KV_CACHE_DTYPE_BYTES)})")
    shape = ModelShape.from_config(config)
    layers = shape.num_layers if num_kv_layers is None else num_kv_layers
    return layers * shape.kv_cache_width * KV_CACHE_DTYPE_BYTES[dtype]


def swiftkv_kv_layers(config, num_key_value_layers: int, key_value_group_size: int = 1) -> int:
    """Layers that own a KV cache under SwiftKV: ``c + (L - c) / g``."""
    c, g = swiftkv_layout(config, num_key_value_layers, key_value_group_size)
    return c + (config.num_hidden_layers - c) // g


def base_param_count(config) -> int:
    """Parameters of the base model (tied embeddings counted once; every expert)."""
    s = ModelShape.from_config(config)
    attention = s.query.params + s.key_value.params + s.output.params
    layers = s.num_layers * (attention + 2 * s.hidden) + sum(s.mlp_params)  # + two RMSNorms per layer
    embeddings = s.vocab * s.hidden * (1 if s.tied_embeddings else 2)
    return layers + embeddings + s.hidden  # + final norm


def swiftkv_param_count(config, num_key_value_layers: int, key_value_group_size: int = 1) -> tuple[int, int]:
    """``(trainable, total)`` parameters of the SwiftKV model: the trainable ones are ``norm_swiftkv``,
    the query part of every layer after the cutoff and the key/value part of each group leader
    (``q/k/v_proj_swiftkv`` with biases where the family has them, Qwen3's ``q/k_norm_swiftkv``,
    DeepSeek-V2's latent-attention modules); the total adds them to the base model's."""
    s = ModelShape.from_config(config)
    c, g = swiftkv_layout(config, num_key_value_layers, key_value_group_size)
    later = s.num_layers - c
    trainable = s.hidden + later * s.query.params + later // g * s.key_value.params
    trainable += shift_kv_projections(config) * s.key_value.weights  # the shift projections have no bias
    return trainable, base_param_count(config) + trainable


def flops_report(
    config,
    seq_len: int,
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    kv_cache_dtype: str = BASE_KV_CACHE_DTYPE,
) -> dict:
    """Everything ``swiftkv flops`` prints, as JSON-ready numbers."""
    c, g = swiftkv_layout(config, num_key_value_layers, key_value_group_size)
    base, swift = prefill_flops(config, seq_len), prefill_flops(config, seq_len, c, g)
    kv_base = kv_cache_bytes_per_token(config)
    kv_swift = kv_cache_bytes_per_token(config, swiftkv_kv_layers(config, c, g), kv_cache_dtype)
    trainable, total = swiftkv_param_count(config, c, g)
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "seq_len": seq_len,
        "num_key_value_layers": c,
        "key_value_group_size": g,
        "prefill_gflops_per_token": {"base": base.gflops(), "swiftkv": swift.gflops()},
        "prefill_flops_reduction": 1 - swift.total / base.total,
        "predicted_prefill_ratio": predicted_prefill_ratio(config, seq_len, c, g),
        "kv_cache_bytes_per_token": {
            "base": kv_base,
            "base_dtype": BASE_KV_CACHE_DTYPE,
            "swiftkv": kv_swift,
            "swiftkv_dtype": kv_cache_dtype,
        },
        "kv_cache_reduction": 1 - kv_swift / kv_base,
        "params": {"trainable": trainable, "total": total, "trainable_share": trainable / total},
    }
