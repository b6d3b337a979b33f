"""Serving DeepSeek-V2 SwiftKV checkpoints (latent attention, mixture of experts) with vLLM's CPU MLA
backend, against the Hugging Face student (the oracle): greedy tokens and their logprobs, prefill
skipping, the base model and the KV capacity of the MLA cache, for tiny random checkpoints (random
SwiftKV weights, so a miswiring shows). float32, so outputs agree to about 1e-6.

vLLM turns chunked prefill and prefix caching off for MLA on CPU, so those checks of
test_vllm_serving.py cannot run here; mixed steps (one request's prefill beside others' decodes)
come from a small ``max_num_seqs`` and different output lengths instead.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swiftkv.bundled import copy_bundled_tokenizer
from tests.test_vllm_serving import (  # noqa: F401 (vllm_env: the autouse engine environment)
    LOGPROB_ATOL,
    assert_matches_hf,
    prompt,
    rows_per_step,
    vllm_env,
    vllm_greedy,
)
from tests.tiny import tiny_swiftkv_model

L, C = 6, 2  # layers, cutoff: AcrossKV g = 2 gives two groups
# What vLLM's CPU path needs of a DeepSeek-V2 config: the CPU MLA decode kernel is compiled for a latent
# of 512 + 64 only, and the CPU MoE router for n_group = topk_group = 1. rms_norm_eps 1e-6 as in the real
# models: HF's kv_a_layernorm/q_a_layernorm always use 1e-6, vLLM's use the config's value.
SERVING_OVERRIDES = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-6}
BLOCK_SIZE = 16  # the only one the CPU MLA backend takes
MAX_NUM_SEQS = 2  # fewer than the batch's prompts: later prompts are prefilled beside earlier ones' decodes


class DeepSeekEngines:
    """Tiny checkpoints written on first use, ``(family, g)`` (family ``deepseek_v2`` or
    ``deepseek_v2-q_lora``), and at most one live engine."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[tuple[str, int], torch.nn.Module] = {}
        self.key: tuple | None = None
        self.llm = None
        self.kv_tokens: dict[tuple, int] = {}

    def model(self, family: str, g: int) -> torch.nn.Module:
        if (family, g) not in self.models:
            self.models[family, g] = tiny_swiftkv_model(
                family, num_hidden_layers=L, num_key_value_layers=C, key_value_group_size=g, **SERVING_OVERRIDES
            )
        return self.models[family, g]

    def path(self, family: str, g: int, swiftkv: bool) -> Path:
        path = self.root / f"{family}-g{g}-{'swiftkv' if swiftkv else 'base'}"
        if not path.exists():
            model = self.model(family, g)
            model.swiftkv(swiftkv).save_pretrained(path)
            model.swiftkv(True)
            copy_bundled_tokenizer(path)
        return path

    def get(self, family: str, g: int = 1, swiftkv: bool = True, prefill_skipping: bool = True):
        from vllm import LLM

        key = (family, g, swiftkv, prefill_skipping)
        if key != self.key:
            self.close()
            self.llm = LLM(
                model=str(self.path(family, g, swiftkv)), dtype="float32", enforce_eager=True, max_model_len=512,
                max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE, seed=0,
                additional_config={"swiftkv": {"prefill_skipping": prefill_skipping}},
            )
            self.key = key
            cache = self.llm.llm_engine.vllm_config.cache_config
            self.kv_tokens[key] = cache.num_gpu_blocks * cache.block_size
        return self.llm

    def close(self) -> None:
        """Shut the engine down, and vLLM's process-wide parallel groups with it: an in-process engine
        keeps the groups it finds, and a dense model's (from another test module) have no
        expert-parallel group, which the MoE layers need."""
        from vllm.distributed import cleanup_dist_env_and_memory

        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm, self.key = None, None
        cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[DeepSeekEngines]:
    engines = DeepSeekEngines(tmp_path_factory.mktemp("deepseek"))
    yield engines
    engines.close()


@pytest.fixture(
    scope="module",
    params=[("deepseek_v2", 1), ("deepseek_v2-q_lora", 2)],
    ids=["no-q-lora", "q-lora-acrosskv2"],
)
def served(request, engines):
    """(engine, HF student) for one checkpoint; pytest groups the tests by it."""
    family, g = request.param
    return engines.get(family, g), engines.model(family, g)


def test_single_prompt_and_mixed_batch(served):
    llm, model = served
    assert llm.llm_engine.vllm_config.model_config.use_mla  # vLLM's MLA cache and backend, not plain attention
    single = [prompt(21, seed=1)]
    assert_matches_hf(model, single, vllm_greedy(llm, single, 8), 8)
    # Five prompts, two running at a time, with different output lengths: steps mix prefills with decodes.
    from vllm import SamplingParams, TokensPrompt

    batch = [prompt(n, seed=10 + n) for n in (3, 40, 17, 55, 9)]
    max_tokens = [3, 9, 5, 7, 4]
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=0, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    for prompt_ids, m, output in zip(batch, max_tokens, outputs, strict=True):
        assert_matches_hf(model, [prompt_ids], [output], m)


def test_only_logits_rows_run_the_later_layers(served):
    """Prefill skipping really happens: a 150-token prompt (one step: no chunked prefill for MLA on
    CPU) sends every token through layers < c but one row per step through layers >= c."""
    rows = rows_per_step(served[0], C, prompt(150, seed=6), 3)
    assert rows["before"] == [150, 1, 1]
    assert rows["after"] == [1, 1, 1]


def test_base_checkpoint_is_served_as_the_base_model(engines):
    llm = engines.get("deepseek_v2", 1, swiftkv=False)
    teacher = engines.model("deepseek_v2", 1).swiftkv(False)
    try:
        prompts = [prompt(n, seed=20 + n) for n in (5, 90)]
        assert_matches_hf(teacher, prompts, vllm_greedy(llm, prompts, 6), 6)
    finally:
        teacher.swiftkv(True)


def test_prompt_logprobs_without_prefill_skipping(engines):
    """With ``prefill_skipping: false`` every row runs every layer, so the later layers attend to
    prefill rows over the group's latent and ``k_pe`` handed to them (vLLM's MLA prefill path), not
    over the cache: prompt logprobs equal the HF student's full forward, and generation still
    equals the HF student."""
    from vllm import SamplingParams, TokensPrompt

    llm = engines.get("deepseek_v2-q_lora", 2, prefill_skipping=False)
    model = engines.model("deepseek_v2-q_lora", 2)
    prompt_ids = prompt(100, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids]), use_cache=False).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(99), torch.tensor(prompt_ids[1:])].tolist()
    got = [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], prompt_ids[1:], strict=True)]
    assert got == pytest.approx(expected, abs=LOGPROB_ATOL)
    prompts = [prompt(n, seed=30 + n) for n in (6, 40)]
    assert_matches_hf(model, prompts, vllm_greedy(llm, prompts, 6), 6)


@pytest.mark.parametrize(("family", "g"), [("deepseek_v2", 1), ("deepseek_v2-q_lora", 2)])
def test_kv_capacity_ratio(engines, family, g):
    """Same KV memory: AcrossKV keeps MLA caches (one latent + k_pe per token) for c + (L - c) / g
    layers, so it fits L / (c + (L-c)/g) times the base model's tokens (within one block)."""
    base_key, swift_key = ("deepseek_v2", 1, False, True), (family, g, True, True)
    for key in (base_key, swift_key):
        if key not in engines.kv_tokens:
            engines.get(*key)
    base, swift = engines.kv_tokens[base_key], engines.kv_tokens[swift_key]
    expected = base * L / (C + (L - C) // g)
    assert abs(swift - expected) <= BLOCK_SIZE, (base, swift, expected)


@pytest.mark.parametrize(
    ("tensor", "rows", "message"),
    [
        # Too large: vLLM's sharded loader alone would cut it to size and load it without a word.
        ("model.layers.3.self_attn.q_proj_swiftkv.weight", 640,
         r"q_proj_swiftkv.weight has shape \(640, 64\), but its config.json calls for \(320, 64\)"),
        ("model.layers.2.self_attn.kv_b_proj_swiftkv.weight", None,
         r"lacks 1 SwiftKV tensor.*layers.2.self_attn.kv_b_proj_swiftkv.weight"),
    ],
    ids=["swiftkv-q-too-large", "swiftkv-kv-b-missing"],
)
def test_bad_checkpoints_fail_at_load(engines, tmp_path, tensor, rows, message):
    import shutil

    from safetensors.torch import load_file, save_file
    from vllm import LLM

    engines.close()
    path = tmp_path / "broken"
    shutil.copytree(engines.path("deepseek_v2", 1, swiftkv=True), path)
    state = load_file(path / "model.safetensors")
    if rows is None:
        del state[tensor]
    else:
        state[tensor] = torch.zeros(rows, *state[tensor].shape[1:])
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=message):
        LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=256, block_size=BLOCK_SIZE)
    gc.collect()
