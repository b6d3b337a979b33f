"""The SwiftKV decoder for vLLM, one class for Llama, Mistral, Qwen2 and Qwen3, built from vLLM's parallel
layers so that it shards under tensor parallelism exactly like the base model.

With ``config.swiftkv`` (cutoff ``c``, AcrossKV group size ``g``), per engine step:
  1. every scheduled token runs the embedding and layers ``0..c-1`` (``SwiftKVPrefill``); the
     state ``h`` entering layer ``c`` is normed once (``norm_swiftkv``) and one fused projection
     gives the K/V of every AcrossKV group, written into the group's cache;
  2. only the rows whose logits the runner reads (each request's last scheduled token) run layers
     ``c..L-1`` and the final norm (``SwiftKVDecode``); each of those layers attends to its group's
     cache with queries from ``q_proj_swiftkv``.
The group caches belong to weightless ``Attention`` layers (one per group, registered before the
first later layer); layers ``>= c`` own no KV cache (``kv_sharing_target_layer_name``), so vLLM
allocates KV for ``c + (L - c) / g`` layers. With ``swiftkv: false`` every layer runs on every
token with its own q/k/v: the plain base model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.utils import maybe_prefix

from swiftkv.config import layer_types
from swiftkv.vllm.kv_internals import check_no_breakable_cudagraphs, compile_unit, logits_rows, write_kv_cache
from swiftkv.vllm.layout import SwiftKVLayout
from swiftkv.vllm.weights import load_swiftkv_weights


def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    return config.sliding_window if layer_types(config)[layer_idx] == "sliding_attention" else None


def per_head_norm(norm: nn.Module | None, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x`` (``[tokens, heads * head_dim]``) with ``norm`` applied to each head; unchanged without one."""
    if norm is None:
        return x
    return norm(x.view(*x.shape[:-1], -1, head_dim)).view(x.shape)


class SwiftKVAttention(nn.Module):
    """Self-attention of one layer. Layers with their own KV use a fused ``qkv_proj``; layers after
    the cutoff only project queries (``q_proj_swiftkv``) and read their group's cache."""

    def __init__(
        self, vllm_config: VllmConfig, layout: SwiftKVLayout, layer_idx: int, prefix: str, kv_source: str | None
    ) -> None:
        super().__init__()
        config, quant_config = vllm_config.model_config.hf_config, vllm_config.quant_config
        heads = layout.heads
        self.q_size, self.kv_size = heads.q_size, heads.kv_size
        self.kv_shared = kv_source is not None
        if self.kv_shared:
            self.q_proj_swiftkv = ColumnParallelLinear(
                config.hidden_size,
                heads.total_num_heads * heads.head_dim,
                bias=layout.qkv_bias,
                quant_config=quant_config,
                prefix=f"{prefix}.q_proj_swiftkv",
            )
        else:
            self.qkv_proj = QKVParallelLinear(
                config.hidden_size,
                heads.head_dim,
                heads.total_num_heads,
                heads.total_num_kv_heads,
                bias=layout.qkv_bias,
                quant_config=quant_config,
                prefix=f"{prefix}.qkv_proj",
            )
        self.o_proj = RowParallelLinear(
            heads.total_num_heads * heads.head_dim,
            config.hidden_size,
            bias=layout.o_proj_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        if layout.qk_norm:  # Qwen3: each head RMS-normed before rotary; later layers use their SwiftKV copies
            suffix = "_swiftkv" if self.kv_shared else ""
            setattr(self, f"q_norm{suffix}", RMSNorm(heads.head_dim, eps=config.rms_norm_eps))
            if not self.kv_shared:
                self.k_norm = RMSNorm(heads.head_dim, eps=config.rms_norm_eps)
            elif layer_idx in layout.leaders:  # read by the prefill unit, which writes the group's keys
                self.k_norm_swiftkv = RMSNorm(heads.head_dim, eps=config.rms_norm_eps)
        self.head_dim = heads.head_dim
        self.rotary_emb = layout.rotary_emb()
        self.attn = Attention(
            heads.num_heads,
            heads.head_dim,
            heads.head_dim**-0.5,
            num_kv_heads=heads.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=_sliding_window(config, layer_idx),
            kv_sharing_target_layer_name=kv_source,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.kv_shared:  # K/V are already in the group's cache
            q, _ = self.q_proj_swiftkv(hidden_states)
            q = per_head_norm(getattr(self, "q_norm_swiftkv", None), q, self.head_dim)
            q, _ = self.rotary_emb(positions, q, None)
            out = self.attn(q, None, None)
        else:
            qkv, _ = self.qkv_proj(hidden_states)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = per_head_norm(getattr(self, "q_norm", None), q, self.head_dim)
            k = per_head_norm(getattr(self, "k_norm", None), k, self.head_dim)
            q, k = self.rotary_emb(positions, q, k)
            out = self.attn(q, k, v)
        out, _ = self.o_proj(out)
        return out


class SwiftKVDecoderLayer(nn.Module):
    def __init__(
        self, vllm_config: VllmConfig, layout: SwiftKVLayout, layer_idx: int, prefix: str, kv_source: str | None
    ) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = SwiftKVAttention(vllm_config, layout, layer_idx, f"{prefix}.self_attn", kv_source)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            quant_config=vllm_config.quant_config,
            bias=layout.mlp_bias,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def run_layers(layers: Sequence[nn.Module], positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """The hidden state after ``layers`` (residual added back, not normed)."""
    residual = None
    for layer in layers:
        hidden_states, residual = layer(positions, hidden_states, residual)
    return hidden_states + residual


# The token dimension of the compiled units' inputs varies from step to step.
TOKEN_ARGS = {"input_ids": 0, "positions": 0, "inputs_embeds": 0}


def is_swiftkv(vllm_config: VllmConfig) -> bool:
    return bool(vllm_config.model_config.hf_config.swiftkv)


def run_on_logits_rows(
    decode: nn.Module,
    kv_sharing_layer: nn.Module,
    hidden: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
) -> torch.Tensor:
    """``hidden`` (every scheduled token's cutoff state) with the rows whose logits the runner reads
    replaced by ``decode``'s output on them. ``decode`` takes the rows of each of ``inputs`` (the
    first is the positions), always read from the static ``buffers`` (CUDA graphs replay fixed
    addresses), as Gemma3n's YOCO split does."""
    rows = logits_rows(kv_sharing_layer)
    num_tokens = hidden.shape[0]
    if rows is None or rows[1] == num_tokens:
        # Every row goes on, in order: warm-up, profiling and CUDA-graph capture runs, and
        # decode-only steps (each token is its request's logits row; see logits_rows for when
        # each model runner arms fast prefill).
        for buffer, value in zip(buffers, inputs, strict=True):
            buffer[:num_tokens].copy_(value)
        return decode(*(buffer[:num_tokens] for buffer in buffers))
    indices, num_rows = rows
    padded = indices.shape[0]
    for buffer, value in zip(buffers, inputs, strict=True):
        buffer[:padded].copy_(value[indices])
    # Cloned before the decode unit runs: under piecewise CUDA graphs the prefill unit's output
    # is a weak reference into the graph pool, which the decode unit's graphs may reuse.
    hidden = hidden.clone()
    out = decode(*(buffer[:padded] for buffer in buffers))
    # Only the logits rows are read; the others keep their cutoff state.
    hidden[indices[:num_rows]] = out[:num_rows]
    return hidden


@support_torch_compile(dynamic_arg_dims=TOKEN_ARGS, enable_if=is_swiftkv)
class SwiftKVPrefill(nn.Module):
    """Runs on every scheduled token: embedding, layers ``0..c-1``, and the K/V (rotary applied) of
    every AcrossKV group from the normed cutoff state."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: SwiftKVModel) -> None:
        super().__init__()
        self.embed_tokens = model.embed_tokens
        self.layers = model.layers[: model.layout.num_kv_layers]
        self.norm_swiftkv = model.norm_swiftkv
        self.kv_proj_swiftkv = model.kv_proj_swiftkv
        self.rotary_emb = model.layout.rotary_emb()
        self.kv_size = model.layout.heads.kv_size * model.layout.num_groups
        self.head_dim = model.layout.heads.head_dim
        # Qwen3: each group's keys through its leader's k_norm_swiftkv (a plain list: the modules stay the leaders').
        leaders = model.layout.leaders if model.layout.qk_norm else []
        self.k_norms = [model.layers[j].self_attn.k_norm_swiftkv for j in leaders]

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = run_layers(self.layers, positions, hidden)
        kv, _ = self.kv_proj_swiftkv(self.norm_swiftkv(hidden))
        key, value = kv.split([self.kv_size, self.kv_size], dim=-1)  # [k_0..k_G-1], [v_0..v_G-1]
        if self.k_norms:
            keys = key.chunk(len(self.k_norms), -1)
            key = torch.cat([per_head_norm(n, k, self.head_dim) for n, k in zip(self.k_norms, keys, strict=True)], -1)
        key, _ = self.rotary_emb(positions, key, None)  # every group's keys in one call
        return hidden, key, value


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden_states": 0}, enable_if=is_swiftkv)
class SwiftKVDecode(nn.Module):
    """Runs on the logits rows only: layers ``c..L-1`` and the final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: SwiftKVModel) -> None:
        super().__init__()
        self.layers = model.layers[model.layout.num_kv_layers :]
        self.norm = model.norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(run_layers(self.layers, positions, hidden_states))


@support_torch_compile(dynamic_arg_dims=TOKEN_ARGS, enable_if=lambda vllm_config: not is_swiftkv(vllm_config))
class SwiftKVModel(nn.Module):
    """The decoder: owns every weight; with SwiftKV on, runs them as the two units above with the
    group caches written in between (compiled as one unit only for the plain base model)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.layout = layout = SwiftKVLayout.from_config(config, get_tensor_model_parallel_world_size())
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config
        )
        c = layout.num_kv_layers
        layers = [SwiftKVDecoderLayer(vllm_config, layout, j, f"{prefix}.layers.{j}", None) for j in range(c)]
        if config.swiftkv:
            heads = layout.heads
            self.norm_swiftkv = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.kv_proj_swiftkv = MergedColumnParallelLinear(
                config.hidden_size,
                [heads.total_num_kv_heads * heads.head_dim] * (2 * layout.num_groups),
                bias=layout.qkv_bias,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.kv_proj_swiftkv",
            )
            # One weightless cache owner per group, registered before every layer that reads it
            # (vLLM finds the prefill-skippable layers as the trailing run of cache readers).
            # Each name holds exactly one integer, the leader's index: vLLM orders caches by it.
            self.group_caches = nn.ModuleList(
                Attention(
                    heads.num_heads,
                    heads.head_dim,
                    heads.head_dim**-0.5,
                    num_kv_heads=heads.num_kv_heads,
                    cache_config=vllm_config.cache_config,
                    # As the layers that read this cache: an FP8 KV cache is written and read with
                    # the same scales.
                    quant_config=vllm_config.quant_config,
                    per_layer_sliding_window=_sliding_window(config, leader),
                    prefix=f"{prefix}.layers.{leader}.self_attn.swiftkv_cache",
                )
                for leader in layout.leaders
            )
            layers += [
                SwiftKVDecoderLayer(
                    vllm_config,
                    layout,
                    j,
                    f"{prefix}.layers.{j}",
                    self.group_caches[layout.group_of(j)].layer_name,
                )
                for j in range(c, config.num_hidden_layers)
            ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.swiftkv:
            check_no_breakable_cudagraphs(vllm_config)
            with compile_unit("swiftkv_prefill"):
                self.prefill = SwiftKVPrefill(vllm_config=vllm_config, prefix=f"{prefix}.prefill", model=self)
            with compile_unit("swiftkv_decode"):
                self.decode = SwiftKVDecode(vllm_config=vllm_config, prefix=f"{prefix}.decode", model=self)
            # Static inputs of the decode unit, so that its CUDA graphs see fixed addresses.
            max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
            self.register_buffer("_rows_positions", torch.zeros(max_tokens, dtype=torch.int64), persistent=False)
            self.register_buffer(
                "_rows_hidden",
                torch.zeros(max_tokens, config.hidden_size, dtype=vllm_config.model_config.dtype),
                persistent=False,
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.config.swiftkv:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            return self.norm(run_layers(self.layers, positions, hidden))

        hidden, key, value = self.prefill(input_ids, positions, inputs_embeds)
        num_groups = len(self.group_caches)
        for cache, k, v in zip(self.group_caches, key.chunk(num_groups, -1), value.chunk(num_groups, -1), strict=True):
            write_kv_cache(cache, k, v)

        return run_on_logits_rows(
            self.decode, self.layers[-1].self_attn.attn, hidden, (positions, hidden),
            (self._rows_positions, self._rows_hidden),
        )


class SwiftKVForCausalLM(nn.Module):
    """``*SwiftKVForCausalLM``: the SwiftKV decoder and vLLM's (tied or separate) LM head."""

    model_cls: type[nn.Module] = SwiftKVModel  # the decoder

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = self.model_cls(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_swiftkv_weights(self, weights, self.model.layout)


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLM):
    pass


class MistralSwiftKVForCausalLM(SwiftKVForCausalLM):
    pass


class Qwen2SwiftKVForCausalLM(SwiftKVForCausalLM):
    pass


class Qwen3SwiftKVForCausalLM(SwiftKVForCausalLM):
    pass
