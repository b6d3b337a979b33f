"""The SwiftKV rewiring of a decoder-only model, written once for every family.

``SwiftKVModelMixin`` goes before a family's ``*Model`` class and ``SwiftKVForCausalLMMixin``
before its ``*ForCausalLM`` class; the per-family files only name the classes to combine.

Student forward (``config.swiftkv`` true), for layers ``0..L-1`` and cutoff ``c``:
  1. layers ``0..c-1`` run as usual on every token;
  2. ``x = norm_swiftkv(h)``, with ``h`` the state entering layer ``c``; every AcrossKV group
     leader computes K/V from ``x`` (rotary at each token's position) and writes them to the
     cache; every layer of the group attends to its leader's K/V;
  3. layers ``c..L-1`` compute queries with ``q_proj_swiftkv`` from their own input.
Prefill skipping: when a cache is in use and the caller keeps only the last position's logits
(``logits_to_keep=1``, as ``generate`` does), only the last token of each sequence runs step 3.
Every prompt token's lasting output (its KV) is already written by then, so the logits are
those of the full student forward. Without a cache (training), every token runs every layer.

Distillation runs the model in two parts (``swiftkv_layers``): layers ``0..c-1`` are frozen and the
same in teacher and student, so their output (the state entering layer ``c``) is computed once,
and the teacher and the student each run layers ``c..L-1`` from it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from swiftkv.config import layer_types, shift_layers
from swiftkv.modeling.attention import is_group_leader
from swiftkv.modeling.token_shift import shifted_for_cache


def _last_position(rope):
    """The rotary embedding of the last position: a ``(cos, sin)`` pair, or DeepSeek's one complex tensor."""
    return tuple(part[:, -1:] for part in rope) if isinstance(rope, tuple) else rope[:, -1:]


def _last_query_row(mask):
    """Keep the last query row of a 4-D mask; ``None`` and 2-D padding masks need no change."""
    return mask[..., -1:, :] if isinstance(mask, torch.Tensor) and mask.dim() == 4 else mask


class SwiftKVModelMixin:
    """Adds ``norm_swiftkv`` and the SwiftKV attention of layers ``>= c`` to a family's model."""

    attention_cls: type[nn.Module]  # the family's SwiftKV attention, set by the family file
    output_cls: type[BaseModelOutputWithPast] = BaseModelOutputWithPast  # the family's model output

    def __init__(self, config) -> None:
        super().__init__(config)
        c = config.num_key_value_layers
        for j in range(c, config.num_hidden_layers):
            self.layers[j].self_attn = self.attention_cls(config, j)
        norm = self.layers[c].input_layernorm
        self.norm_swiftkv = type(norm)(config.hidden_size, eps=config.rms_norm_eps)

    def _causal_masks(self, inputs_embeds, attention_mask, past_key_values, position_ids) -> dict:
        if isinstance(attention_mask, dict):  # already prepared per layer type (e.g. by generate)
            return attention_mask
        kwargs = dict(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in layer_types(self.config):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        swiftkv_skip_prefill: bool = False,
        swiftkv_layers: Literal["all", "to_cutoff", "from_cutoff"] = "all",
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """``swiftkv_layers``: ``"to_cutoff"`` runs the embedding and layers ``0..c-1`` and returns
        the state entering layer ``c`` (not normed); ``"from_cutoff"`` takes that state as
        ``inputs_embeds`` and runs layers ``c..L-1`` (teacher or student) and the final norm. Both
        parts are for training: no cache."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if swiftkv_layers != "all" and (use_cache or past_key_values is not None):
            raise ValueError(f"swiftkv_layers={swiftkv_layers!r} runs without a KV cache (training only)")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)

        # Masks are built before any cache update: their size is past + new tokens.
        masks = self._causal_masks(inputs_embeds, attention_mask, past_key_values, position_ids)
        kinds = layer_types(self.config)
        hidden = inputs_embeds
        rope = self.rotary_emb(hidden, position_ids=position_ids)
        c = self.config.num_key_value_layers
        first, last = {"all": (0, self.config.num_hidden_layers), "to_cutoff": (0, c),
                       "from_cutoff": (c, self.config.num_hidden_layers)}[swiftkv_layers]
        swiftkv_from = c if self.config.swiftkv else last  # the layers that take the SwiftKV K/V

        def run_layer(i: int, hidden: torch.Tensor, **extra) -> torch.Tensor:
            return self.layers[i](
                hidden,
                attention_mask=masks[kinds[i]],
                position_embeddings=rope,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **extra,
                **kwargs,
            )

        for i in range(first, min(swiftkv_from, last)):
            hidden = run_layer(i, hidden)
        if swiftkv_layers == "to_cutoff":
            return self.output_cls(last_hidden_state=hidden)

        if swiftkv_from < last:
            skip = swiftkv_skip_prefill and past_key_values is not None and hidden.shape[1] > 1
            if skip and self.config._attn_implementation == "flex_attention":
                # Skipping keeps the last query row of each mask; a flex-attention BlockMask has no rows to cut.
                raise ValueError(
                    "SwiftKV prefill skipping does not support attn_implementation='flex_attention': load the "
                    "model with attn_implementation='sdpa' or 'eager'"
                )
            key_values = self._swiftkv_key_values(hidden, rope, position_ids, past_key_values)
            if skip:
                # Prefill skipping: only the last token of each sequence goes on.
                hidden = hidden[:, -1:]
                rope = _last_position(rope)
                position_ids = position_ids[..., -1:]
                masks = {kind: _last_query_row(mask) for kind, mask in masks.items()}
            for i in range(swiftkv_from, last):
                hidden = run_layer(i, hidden, swiftkv_kv=key_values[i])

        return self.output_cls(
            last_hidden_state=self.norm(hidden),
            past_key_values=past_key_values if use_cache else None,
        )

    def _swiftkv_key_values(
        self, cutoff_state: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], position_ids: torch.Tensor,
        past_key_values,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """K/V (past + new tokens) that each layer ``>= c`` attends to, keyed by layer index.

        Only group leaders compute and cache K/V (DeepSeek-V2: the latent, expanded by the leader
        after the cache); the other layers of a group read the leader's (their cache entries stay
        empty). Token-shift layers also read the tokens before (``token_shift.py``)."""
        config = self.config
        c, g = config.num_key_value_layers, config.key_value_group_size
        normed = self.norm_swiftkv(cutoff_state)
        shifted_layers = shift_layers(config)
        if shifted_layers:
            shifted = shifted_for_cache(normed, position_ids, config.key_value_shift_tokens, past_key_values)
        key_values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for j in range(c, config.num_hidden_layers):
            if is_group_leader(j, c, g):
                leader = self.layers[j].self_attn
                entry = leader.swiftkv_cache_entry(normed, rope, *([shifted] if j in shifted_layers else []))
                if past_key_values is not None:
                    entry = past_key_values.update(*entry, j)
                leader_kv = leader.swiftkv_expand(*entry)
            key_values[j] = leader_kv
        return key_values


class SwiftKVForCausalLMMixin:
    """Adds the teacher/student switch and prefill skipping to a family's ``*ForCausalLM``."""

    model_cls: type[nn.Module]  # the family's SwiftKV model, set by the family file

    def __init__(self, config) -> None:
        # The family's *ForCausalLM.__init__, with our inner model (the base model is never built).
        PreTrainedModel.__init__(self, config)
        self.model = self.model_cls(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, refusing a checkpoint that lacks SwiftKV weights
        (transformers would silently give them a random init)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = sorted(k for k in info["missing_keys"] if "_swiftkv" in k)
        if missing:
            source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            raise ValueError(
                f"checkpoint {source} has no SwiftKV weights for {len(missing)} tensors (e.g. {missing[0]}): "
                "to start from a base checkpoint, run `swiftkv convert` first"
            )
        return (model, info) if want_info else model

    def swiftkv(self, enabled: bool = True):
        """Switch between the student (``True``) and exactly the base model, the teacher (``False``)."""
        self.config.swiftkv = bool(enabled)
        return self

    def swiftkv_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The weights SwiftKV adds (``norm_swiftkv``, ``q/k/v_proj_swiftkv``, a token shift's
        ``k/v_shift_swiftkv``): the ones distillation trains."""
        return [(name, p) for name, p in self.named_parameters() if "_swiftkv" in name]

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``, refusing beam search with a token shift: it reorders the
        cache's K/V between steps but not the recent cutoff states the shift keeps beside them."""
        if shift_layers(self.config):
            settings = kwargs.get("generation_config") or self.generation_config
            if (kwargs.get("num_beams") or settings.num_beams or 1) > 1:
                raise ValueError("beam search is not supported with a token shift (key_value_shift_layers); "
                                 "use greedy decoding or sampling")
        return super().generate(*args, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        # The SwiftKV K/V reach layers >= c as keyword tensors; reentrant checkpointing would drop
        # their gradients (and so train no k/v_proj_swiftkv), so it is refused.
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        if kwargs["use_reentrant"]:
            raise ValueError("SwiftKV models need non-reentrant gradient checkpointing (use_reentrant=False)")
        super().gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        # The parameters are spelt out because ``generate`` hands ``position_ids`` (from the
        # attention mask, so left padding does not shift them) only to a forward that declares them.
        skip = isinstance(logits_to_keep, int) and logits_to_keep == 1
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            swiftkv_skip_prefill=skip,
            **kwargs,
        )
