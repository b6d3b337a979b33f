"""vLLM's own OpenAI server, in-process and without its socket: its ``vllm serve`` arguments, the
engine config they give, and its FastAPI app around an ``AsyncLLM``. The only code of the
application that uses vLLM's server internals (its argument parser, app builder and app state).
"""

from __future__ import annotations

import difflib
from argparse import Namespace
from contextlib import AbstractAsyncContextManager
from types import SimpleNamespace
from typing import TYPE_CHECKING

from serve_apps.config import ModelOptions

if TYPE_CHECKING:
    from fastapi import FastAPI
    from vllm.config import VllmConfig
    from vllm.v1.engine.async_llm import AsyncLLM


def vllm_server_args(options: ModelOptions, model_path: str) -> Namespace:
    """vLLM's own ``vllm serve`` arguments for this model: its parser's defaults, then the model,
    its served name and ``engine_kwargs`` (each key checked against vLLM's option names)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", model_path, "--served-model-name", options.name]
    )
    known = vars(args)
    for key, value in options.engine_kwargs.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"model {options.name!r}: engine_kwargs.{key} is not a vLLM option{hint}")
        setattr(args, key, value)
    extra = dict(args.additional_config or {})
    extra["swiftkv"] = {**extra.get("swiftkv", {}), "prefill_skipping": options.prefill_skipping}
    args.additional_config = extra
    validate_parsed_serve_args(args)
    return args


def served_engine_config(options: ModelOptions, model_path: str) -> tuple[Namespace, VllmConfig]:
    """The ``vllm serve`` arguments and the engine config a replica runs with: vLLM's server
    defaults, which differ from its offline ``LLM`` class's (on CPU 2,048 tokens per step and 128
    sequences instead of 4,096 and 256)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = vllm_server_args(options, model_path)
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def check_admission(options: ModelOptions, vllm_config: VllmConfig) -> None:
    """Serve, not vLLM, holds the queue: a replica takes fewer requests than the engine runs at once."""
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    if options.max_ongoing_requests >= max_num_seqs:
        raise ValueError(
            f"model {options.name!r}: max_ongoing_requests ({options.max_ongoing_requests}) must be below the "
            f"engine's max_num_seqs ({max_num_seqs}): lower it, or raise engine_kwargs.max_num_seqs")


async def start_openai_app(engine: AsyncLLM, args: Namespace) -> tuple[FastAPI, AbstractAsyncContextManager]:
    """vLLM's FastAPI app serving ``engine``, and its entered lifespan (exit it to stop the app)."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    # vLLM's engine-error handler tells the uvicorn server it expects here to exit once the engine has
    # died; there is no server in a replica (a missing one turned those errors into plain-text 500s).
    # The stand-in takes the flag; the replica answers 503 and Serve's health check replaces it.
    app.state.server = SimpleNamespace(should_exit=False)
    # vLLM's lifespan: its periodic engine log lines ("Avg prompt throughput ..."). Held for the
    # replica's life: the context's exit deletes the app's state.
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    return app, lifespan
