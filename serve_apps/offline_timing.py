"""Timing vLLM's offline ``LLM`` engine: random prompts that never repeat, and the throughput of
a batch submitted at once. The replica calibration (``calibrate.py``) and the engine benchmark
(``ray_jobs/bench_vllm.py``) measure with these."""

from __future__ import annotations

import time

import torch


class PromptMaker:
    """Random prompts, never repeated, the same sequence for every engine of a round."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed

    def batch(self, key: int, count: int, length: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        return torch.randint(10, self.vocab, (count, length), generator=gen).tolist()


def sampling_params(output_len: int):
    """Greedy, exactly ``output_len`` tokens, cumulative outputs at every step (so the first
    token's time is seen when it is made)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE
    )


def offline_throughput(llm, prompts: list[list[int]], output_len: int) -> float:
    """(input + output) tokens/s for all prompts submitted at once."""
    from vllm import TokensPrompt

    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling_params(output_len),
                           use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs) / elapsed
