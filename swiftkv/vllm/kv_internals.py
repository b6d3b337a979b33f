"""Every use of vLLM internals below its public model API, kept in one place.

SwiftKV needs these things vLLM 0.32 offers only internally:
- writing K/V into a layer's paged cache from outside that layer's ``Attention.forward``
  (the KV of layers ``>= c`` is computed once from the cutoff state, for every token), and the
  same for a latent-attention (MLA) cache: latent and rotary key part (``write_mla_cache``);
- a latent-attention layer that reads another layer's MLA cache and never writes it
  (``MLACacheReader``): vLLM's ``MLAAttention`` has no KV sharing, and its runner counts a layer
  as a cache sharer (and a candidate for the prefill early exit) only if it is an ``Attention``;
- telling vLLM that a model type uses MLA (it decides by a list of model types), and keeping
  the plain CPU MLA backend on hosts with AMX (``prefer_reference_cpu_mla``);
- reading which rows of the batch need logits, which the model runner hands the KV-sharing
  layers when ``cache_config.kv_sharing_fast_prefill`` is on;
- switching that flag on for our architectures alone (``MODELS_CONFIG_MAP``);
- refusing prompt logprobs with that flag in the offline ``LLM`` too (vLLM checks only in
  ``AsyncLLM``; the offline engine crashes under the V1 runner and is silently wrong under V2);
- knowing whether breakable CUDA graphs are on (they replay the later layers on the wrong rows).
When a vLLM upgrade moves any of these, this module is the one to change.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager

import torch
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.layers.attention.mla_attention import (
    unified_mla_attention_with_output,
    unified_mla_kv_cache_update,
)
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.model_arch_config_convertor import (
    MODEL_ARCH_CONFIG_CONVERTORS,
    ModelArchConfigConvertorBase,
)
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata


def write_kv_cache(attn: Attention, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store ``key``/``value`` (``[tokens, kv_heads * head_dim]``, every scheduled token) in the paged
    KV cache of ``attn``, exactly as its own forward would (same slots, same FP8 scaling)."""
    key = key.view(-1, attn.num_kv_heads, attn.head_size)
    value = value.view(-1, attn.num_kv_heads, attn.head_size_v)
    if attn.use_direct_call:
        unified_kv_cache_update(key, value, attn.layer_name)
    else:  # the opaque custom op, as Attention.forward calls it on CPU and CUDA
        torch.ops.vllm.unified_kv_cache_update(key, value, _encode_layer_name(attn.layer_name))


def write_mla_cache(owner: MLAAttention, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Store ``latent`` (``[tokens, kv_lora_rank]``, normed) and ``k_pe`` (``[tokens, 1, rope_dim]``,
    rotary applied) of every scheduled token in the MLA cache of ``owner``, as its own forward would."""
    if owner.use_direct_call:
        unified_mla_kv_cache_update(latent, k_pe, owner.layer_name, owner.kv_cache_dtype, owner._k_scale)
    else:  # the opaque custom op, as MLAAttention.forward calls it on CPU
        torch.ops.vllm.unified_mla_kv_cache_update(
            latent, k_pe, _encode_layer_name(owner.layer_name), owner.kv_cache_dtype, owner._k_scale
        )


class MLACacheReader(MLAAttention):
    """An ``MLAAttention`` that attends to the MLA cache of ``kv_sharing_target_layer_name`` and
    never writes it (the runner's slot mapping for a sharer covers every scheduled token, not the
    rows a SwiftKV later layer runs on). Its backend is built as for any MLA layer (the MLA
    backends refuse a sharing target); the runner learns of the sharing from the attribute, read on
    ``Attention`` layers only, hence the registration as a virtual subclass below. Decode rows read
    the cache (absorbed ``W_UK``/``W_UV`` of the ``kv_b_proj`` given); prefill rows attend over the
    latent and ``k_pe`` passed in, as in ``MLAAttention``."""

    attn_type = AttentionType.DECODER  # read by the runner on every Attention layer

    def __init__(self, *, kv_sharing_target_layer_name: str, **mla_kwargs) -> None:
        super().__init__(**mla_kwargs)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(
        self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, output_shape: torch.Size
    ) -> torch.Tensor:
        output = torch.empty(output_shape, dtype=q.dtype, device=q.device)
        if self.use_direct_call:
            unified_mla_attention_with_output(q, latent, k_pe, output, self.layer_name)
        else:
            torch.ops.vllm.unified_mla_attention_with_output(
                q, latent, k_pe, output, _encode_layer_name(self.layer_name)
            )
        return output


Attention.register(MLACacheReader)


def register_mla_model_type(model_type: str) -> None:
    """Make vLLM treat ``model_type`` as latent attention (``ModelConfig.use_mla``: the MLA cache
    layout, head size ``kv_lora_rank + qk_rope_head_dim``, the platform's MLA settings) when the
    config has a ``kv_lora_rank``, as it does for ``deepseek_v2``."""

    class LatentAttentionConvertor(ModelArchConfigConvertorBase):
        def is_deepseek_mla(self) -> bool:
            return getattr(self.hf_text_config, "kv_lora_rank", None) is not None

    MODEL_ARCH_CONFIG_CONVERTORS[model_type] = LatentAttentionConvertor


def prefer_reference_cpu_mla(vllm_config: VllmConfig) -> None:
    """On CPUs with AMX, vLLM picks its AMX MLA backend, which frees ``kv_b_proj.weight`` once a layer
    has packed it: a ``kv_b_proj_swiftkv`` shared by a group's cache and readers would then be gone
    for the second one. Ask for the reference CPU MLA backend there (a config hook runs before the
    platform reads this)."""
    if torch.cpu._is_amx_tile_supported():
        vllm_config.attention_config.backend = AttentionBackendEnum.CPU_MLA


def logits_rows(kv_sharing_layer: Attention) -> tuple[torch.Tensor, int] | None:
    """The batch rows whose logits the runner will read, when fast prefill is armed for this step.

    Returns ``(indices_padded, num_indices)``: ``indices_padded`` may be longer than
    ``num_indices`` (CUDA-graph padding repeats the last row); the KV-sharing layers were given
    attention metadata for exactly these rows. ``None`` means every row must go through the later
    layers, with metadata for every row: profiling, warm-up and capture runs, the flag off, and
    under Model Runner V2 (vLLM's default on CUDA) also decode-only steps and FULL CUDA-graph steps,
    which V2 does not arm (the V1 runner, used on CPU, arms decode-only steps with every row).
    """
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None
    metadata = attn_metadata.get(kv_sharing_layer.layer_name)
    if not isinstance(metadata, KVSharingFastPrefillMetadata) or metadata.logits_indices_padded is None:
        return None
    return metadata.logits_indices_padded, metadata.num_logits_indices


def register_config_hook(architecture: str, hook: type[VerifyAndUpdateConfig]) -> None:
    """Run ``hook.verify_and_update_config(vllm_config)`` for ``architecture`` before the engine
    is built (vLLM calls it before the model runner reads the cache config)."""
    MODELS_CONFIG_MAP[architecture] = hook


def compile_unit(tag: str) -> AbstractContextManager[None]:
    """Give the ``support_torch_compile`` modules built inside their own compilation cache and
    graphs (two compiled units per model, as Gemma3n's YOCO split does)."""
    from vllm.compilation.backends import set_model_tag  # imported late, as vLLM's own models do

    return set_model_tag(tag)


PROMPT_LOGPROBS_REFUSED = (
    "prompt logprobs are not available from a SwiftKV checkpoint served with prefill skipping: its prompt "
    "tokens stop at the cutoff layer and have no logits. Serve it with prefill skipping off to get them "
    "(same outputs, base-model prefill cost): additional_config={'swiftkv': {'prefill_skipping': False}}, "
    """or on vLLM's command line --additional-config '{"swiftkv": {"prefill_skipping": false}}'."""
)


def _refuse_prompt_logprobs(vllm_config: VllmConfig, params, architectures: frozenset[str]) -> None:
    if (isinstance(params, SamplingParams) and params.prompt_logprobs is not None
            and vllm_config.cache_config.kv_sharing_fast_prefill
            and vllm_config.model_config.architecture in architectures):
        raise VLLMValidationError(PROMPT_LOGPROBS_REFUSED, parameter="prompt_logprobs")


def refuse_prompt_logprobs(architectures: frozenset[str]) -> None:
    """Refuse prompt-logprobs requests to our architectures under prefill skipping, with one message
    in both entry points: the offline engine's input validation (``LLM``, ``LLMEngine``) and
    ``AsyncLLM.add_request``, ahead of vLLM's own check there (which would tell users to turn off a
    flag they never set). Idempotent."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(InputProcessor._validate_params, "_swiftkv", False):
        return
    validate, add_request = InputProcessor._validate_params, AsyncLLM.add_request

    @functools.wraps(validate)
    def _validate_params(self, params, *args, **kwargs):
        _refuse_prompt_logprobs(self.vllm_config, params, architectures)
        return validate(self, params, *args, **kwargs)

    @functools.wraps(add_request)
    async def _add_request(self, request_id, prompt, params, *args, **kwargs):
        _refuse_prompt_logprobs(self.vllm_config, params, architectures)
        return await add_request(self, request_id, prompt, params, *args, **kwargs)

    _validate_params._swiftkv = True
    InputProcessor._validate_params = _validate_params
    AsyncLLM.add_request = _add_request


def check_no_breakable_cudagraphs(vllm_config: VllmConfig) -> None:
    """Refuse breakable CUDA graphs with prefill skipping: they record the whole forward once per
    batch size with every row and replay only attention eagerly, so on a mixed step the later
    layers would run on the first rows instead of the logits rows (wrong logits, V1 and V2 alike).
    Checked when the model is built: vLLM switches them on after our config hook has run."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    if (vllm_config.cache_config.kv_sharing_fast_prefill and is_breakable_cudagraph_enabled()
            and vllm_config.compilation_config.cudagraph_mode.has_piecewise_cudagraphs()):
        raise ValueError(
            "SwiftKV prefill skipping gives wrong logits with breakable CUDA graphs: set "
            "VLLM_USE_BREAKABLE_CUDAGRAPH=0, or serve with additional_config={'swiftkv': {'prefill_skipping': False}}"
        )
