"""vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) serves a tiny SwiftKV
checkpoint through our plugin, called with the real ``openai`` client: greedy completions equal the
HF student's tokens and logprobs, chat goes through the checkpoint's template, and prompt logprobs
(which prefill skipping cannot give) are refused with HTTP 400 naming the reason."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from swiftkv.bundled import copy_bundled_tokenizer
from tests.serve_cluster import CPU_ENV, free_port
from tests.test_vllm_serving import LOGPROB_ATOL, hf_greedy, prompt, token_logprobs
from tests.tiny import tiny_swiftkv_model

NAME = "tiny-swiftkv"
STARTUP_S = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(HF student, openai client) for a server on 127.0.0.1, stopped with its engine processes."""
    root = tmp_path_factory.mktemp("openai")
    # AcrossKV g=2 and random SwiftKV weights: a wrong wiring would change the tokens.
    model = tiny_swiftkv_model("llama", num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=2,
                               hidden_size=128)
    model.save_pretrained(root / "model")
    copy_bundled_tokenizer(root / "model")
    port = free_port()
    env = {**os.environ, **CPU_ENV}
    log = open(root / "server.log", "w")  # noqa: SIM115 (closed after the server stops)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(root / "model"),
         "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "512", "--seed", "0"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{(root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"server not healthy after {STARTUP_S} s:\n{(root / 'server.log').read_text()[-3000:]}")
                time.sleep(1)
        yield model, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the engine core runs in the server's process group
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def greedy_completion(client: openai.OpenAI, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The server's greedy continuation of ``ids`` as token ids, with their logprobs."""
    result = client.completions.create(
        model=NAME, prompt=ids, max_tokens=max_tokens, temperature=0.0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    assert result.usage.prompt_tokens == len(ids) and result.usage.completion_tokens == max_tokens
    logprobs = result.choices[0].logprobs
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens], logprobs.token_logprobs


def assert_equals_hf(model, ids: list[int], max_tokens: int, tokens: list[int], logprobs: list[float]) -> None:
    want_tokens, step_logprobs = hf_greedy(model, ids, max_tokens)
    assert tokens == want_tokens, f"prompt of {len(ids)} tokens"
    assert logprobs == pytest.approx(token_logprobs(step_logprobs, want_tokens), abs=LOGPROB_ATOL)


def test_completions_equal_the_hf_student(server):
    model, client = server
    ids = prompt(40, seed=7)
    assert_equals_hf(model, ids, 8, *greedy_completion(client, ids, 8))


def test_concurrent_completions_equal_the_hf_student(server):
    """Eight requests of different lengths at once: AsyncLLM batches them as they arrive, so steps
    mix prefills with decodes; each answer is still the HF student's."""
    model, client = server
    lengths, max_tokens = (5, 60, 130, 20, 250, 9, 90, 40), (6, 20, 9, 14, 7, 18, 11, 16)
    prompts = [prompt(n, seed=60 + n) for n in lengths]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda ids, n: greedy_completion(client, ids, n), prompts, max_tokens))
    for ids, n, answer in zip(prompts, max_tokens, answers, strict=True):
        assert_equals_hf(model, ids, n, *answer)


def test_chat_uses_the_checkpoint_template(server):
    _, client = server
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0.0,
                                            extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and result.usage.completion_tokens == 6
    # ChatML around the question: more prompt tokens than the question alone.
    assert result.usage.prompt_tokens > 12


def test_prompt_logprobs_and_bad_requests_are_400(server):
    _, client = server
    with pytest.raises(openai.BadRequestError, match="prompt logprobs are not available from a SwiftKV checkpoint"):
        client.completions.create(model=NAME, prompt="hello there", max_tokens=2, echo=True, logprobs=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hello there", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hello", max_tokens=2)
