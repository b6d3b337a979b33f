"""The Ray Data pipeline: read each source, map its schema to messages, mix, template, pack.

read (parquet / jsonl / chitchat json; local, glob, s3:// or any fsspec URI; files in a seeded order)
  -> sample (sample_count or weight) -> messages + held-out flag (malformed rows logged, skipped;
     synthetic sources hold out rows of their own, after the training ids)
  -> small blocks -> union of the sources (one block of each in turn) -> chat template + loss mask
  -> packed rows of max_seq_len tokens (int32 ids, int16/int32 positions, uint8 mask).

Everything streams: no source is read whole into the driver, no stage waits for the whole data
(there is no all-to-all shuffle), and the first packed rows reach training while the sources are
still being read; rows are mixed by a seeded local shuffle buffer as each worker reads them
(``train_loop.py``). The order is deterministic when the consumer preserves order, which the
distillation job asks for (Ray Train's ``DataConfig``): the same rows reach the same worker in the
same order in every run, which is what exact resume needs. Files are listed with fsspec at start,
so an unknown format or an unreadable URI fails before any Ray work with a message naming it.
S3 credentials and endpoint come from the environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``...).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import zlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec
import numpy as np
import pyarrow as pa
import ray.data

from swiftkv.chat_schemas import MalformedRow, to_messages
from swiftkv.distill.chat_tokens import tokenize_chat
from swiftkv.distill.config import DataConfig, RetrievalSourceConfig, SourceConfig
from swiftkv.distill.packing import pack_rows, truncate
from swiftkv.distill.retrieval_data import check_retrieval_spec, retrieval_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MESSAGES_SCHEMA = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
BUNDLED_CHITCHAT = "bundled:chitchat"
_EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "json"}


def _bundled_chitchat_file() -> str:
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("bundled:chitchat needs `pip install chitchat-dataset==0.9.0` (scripts/setup.sh)")
    return str(Path(spec.submodule_search_locations[0]) / "dataset.json")


def resolve_files(uri: str) -> tuple[fsspec.AbstractFileSystem, list[str], str]:
    """``(filesystem, files, kind)`` for a source URI; raises ``FileNotFoundError`` / ``ValueError``
    naming the URI when nothing readable is there."""
    if uri == BUNDLED_CHITCHAT:
        uri = _bundled_chitchat_file()
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        files = sorted(f for f in fs.glob(path) if fs.isfile(f)) if fs.exists(path) or "*" in path else []
        if not files and fs.isdir(path):
            files = sorted(f for f in fs.find(path) if Path(f).suffix in _EXTENSIONS)
    except (OSError, ValueError, ImportError) as err:
        raise FileNotFoundError(f"data source {uri!r} cannot be read: {err}") from err
    if not files:
        raise FileNotFoundError(f"data source {uri!r} matches no file")
    kinds = {_EXTENSIONS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(
            f"data source {uri!r}: files must all be .parquet, all .jsonl or all .json, got "
            f"{sorted({Path(f).suffix or '<none>' for f in files})}"
        )
    return fs, files, kinds.pop()


def _chitchat_conversations(item: dict) -> list[dict]:
    """The chitchat-dataset file (one JSON object of conversations) as one row per conversation."""
    data = json.loads(item["bytes"])
    return [{"messages": conversation["messages"]} for conversation in data.values()]


def _read_parquet_v1(files: list[str], fs: fsspec.AbstractFileSystem,
                     shuffle: ray.data.FileShuffleConfig) -> ray.data.Dataset:
    """``read_parquet`` through Ray Data's V1 datasource. Ray 2.60's default (V2) lists files in a task
    that starts 32 footer-reading actors and kills them after every listing, that is at every
    execution (each epoch, the held-out set): measured 7-14 s per listing of a one-file source on a
    2-core node against 0.25 s with V1. We list the files up front already, so V2's distributed
    footer reads buy nothing here. The switch is read when the plan is built, so it is set only
    around this call."""
    ctx = ray.data.DataContext.get_current()
    use_v2, ctx.use_datasource_v2 = ctx.use_datasource_v2, False
    try:
        return ray.data.read_parquet(files, filesystem=fs, shuffle=shuffle)
    finally:
        ctx.use_datasource_v2 = use_v2


def _read(src: SourceConfig, seed: int) -> ray.data.Dataset:
    fs, files, kind = resolve_files(src.uri)
    # Files in a seeded order, the same in every epoch and run (exact resume needs that).
    shuffle = ray.data.FileShuffleConfig(seed=seed, reseed_after_execution=False)
    if kind == "parquet":
        return _read_parquet_v1(files, fs, shuffle)
    if kind == "jsonl":
        return ray.data.read_json(files, filesystem=fs, file_extensions=["jsonl"], shuffle=shuffle)
    if src.format != "chitchat":
        raise ValueError(f"data source {src.uri!r}: .json files are read only for format chitchat; use .jsonl")
    return ray.data.read_binary_files(files, filesystem=fs).flat_map(_chitchat_conversations)


def is_heldout(messages: list[dict], fraction: float) -> bool:
    """A stable per-example coin: the same conversation is held out in every run."""
    text = "\x00".join(m["content"] for m in messages).encode()
    return zlib.crc32(text) / 2**32 < fraction


def _to_messages_batch(batch: pa.Table, fmt: str, uri: str, heldout: bool, fraction: float) -> pa.Table:
    kept, bad = [], []
    for row in batch.to_pylist():
        try:
            messages = to_messages(fmt, row)
        except MalformedRow as err:
            bad.append(str(err))
            continue
        if is_heldout(messages, fraction) == heldout:
            kept.append({"messages": messages})
    if bad:
        logger.warning(
            "%s: skipped %d malformed %s row(s) of %d; first: %s", uri, len(bad), fmt, batch.num_rows, bad[0]
        )
    return pa.Table.from_pylist(kept, schema=MESSAGES_SCHEMA)


@lru_cache(maxsize=2)
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    # Imported here: transformers takes seconds to import, and only the templating tasks need it, not
    # every Ray Data task that imports this module.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer of {path} has no chat template")
    return tokenizer


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


DATA_TASK_CPUS = 0.5
"""CPUs each map task of the pipeline declares. Ray Data reserves one task's CPUs per live stage,
upstream first, and gives a stage nothing when those are spent: at 1 CPU per task, a pipeline with
more live stages than CPUs (a 2-core machine, or the CPUs Ray Train leaves to data) starves its last
stage until every source row is made, and the first packed row waits for all of them."""


def heldout_retrieval_rows(src: RetrievalSourceConfig, fraction: float) -> int:
    """Held-out rows of a synthetic source: ``fraction`` of its ``rows`` (at least one), generated from
    the ids after the training ones, so that holding them out costs only their own generation (a hash
    coin would make every training row to find them)."""
    return max(1, math.ceil(src.rows * fraction))


def _retrieval_messages(batch: dict[str, np.ndarray], src: RetrievalSourceConfig, tokenizer_path: str,
                        first_id: int) -> pa.Table:
    tokenizer = load_tokenizer(tokenizer_path)
    chats = [retrieval_chat(first_id + int(index), src.tasks, src.filler, src.min_tokens, src.max_tokens, src.seed,
                            tokenizer) for index in batch["id"]]
    return pa.Table.from_pylist([{"messages": m} for m in chats], schema=MESSAGES_SCHEMA)


def check_sources(cfg: DataConfig, tokenizer_path: str) -> None:
    """Fail before any Ray work, naming the source, when one cannot give rows: a URI with no readable
    file, a retrieval spec whose filler is missing or whose lengths its templates cannot reach."""
    for src in cfg.sources:
        if isinstance(src, RetrievalSourceConfig):
            check_retrieval_spec(src.tasks, src.filler, src.min_tokens, src.max_tokens, load_tokenizer(tokenizer_path))
        else:
            resolve_files(src.uri)


def _tokenize_and_pack(batch: pa.Table, tokenizer_path: str, cfg: DataConfig) -> dict[str, np.ndarray]:
    tokenizer = load_tokenizer(tokenizer_path)
    examples, bad, long = [], 0, 0
    for row in batch.to_pylist():
        try:
            tokens = tokenize_chat(tokenizer, row["messages"], cfg.loss_on)
        except MalformedRow:
            bad += 1
            continue
        if len(tokens.input_ids) > cfg.max_seq_len:
            long += 1
            tokens = truncate(tokens, cfg.max_seq_len)
            if not any(tokens.loss_mask):  # the first reply starts past max_seq_len: nothing to learn
                bad += 1
                continue
        examples.append(tokens)
    if bad or long:
        logger.warning(
            "templating: skipped %d conversation(s), truncated %d over %d tokens", bad, long, cfg.max_seq_len
        )
    rows = pack_rows(examples, cfg.max_seq_len, pad_id(tokenizer), cfg.pack)
    # The smallest integer types that hold the values (an object store of rows is mostly ids).
    dtypes = {"input_ids": np.int32, "position_ids": np.int16 if cfg.max_seq_len <= 2**15 else np.int32,
              "loss_mask": np.uint8}
    return {key: np.stack([r[key] for r in rows]).astype(dtype) if rows else np.zeros((0, cfg.max_seq_len), dtype)
            for key, dtype in dtypes.items()}


def _messages(cfg: DataConfig, heldout: bool, tokenizer_path: str) -> ray.data.Dataset:
    # Blocks of pack_window / sources rows (exactly, or within one for a synthetic source's even split
    # of its ids): the union takes one block of each source in turn,
    # so every pack window mixes the sources, and a big file (chitchat's one JSON of 7K conversations)
    # is templated window by window instead of in one task that the first batch waits for. Exact
    # sizes also make the blocks the same in every run whatever read parallelism Ray picks from the
    # CPUs free at the time (a restarted run may see fewer), which the seeded sample, the workers'
    # shuffle buffers and streaming_split's block assignment all depend on.
    rows_per_block = max(1, cfg.pack_window // len(cfg.sources))
    parts = []
    for i, src in enumerate(cfg.sources):
        if isinstance(src, RetrievalSourceConfig):
            # Read in blocks of the window's share already (row i is made from i alone, none is
            # dropped): no repartition stage to hold a CPU reservation.
            rows, first_id = (heldout_retrieval_rows(src, cfg.heldout_fraction), src.rows) if heldout else (src.rows, 0)
            parts.append(ray.data.range(rows, override_num_blocks=-(-rows // rows_per_block)).map_batches(
                _retrieval_messages, batch_size=None, batch_format="numpy", num_cpus=DATA_TASK_CPUS,
                fn_kwargs=dict(src=src, tokenizer_path=tokenizer_path, first_id=first_id)))
            continue
        ds = _read(src, cfg.seed + i)
        if src.sample_count is not None:
            ds = ds.limit(src.sample_count)
        ds = ds.map_batches(
            _to_messages_batch,
            batch_format="pyarrow",
            num_cpus=DATA_TASK_CPUS,
            fn_kwargs=dict(fmt=src.format, uri=src.uri, heldout=heldout, fraction=cfg.heldout_fraction),
        ).repartition(target_num_rows_per_block=rows_per_block, strict=True)
        if src.weight is not None:
            ds = ds.random_sample(src.weight, seed=cfg.seed + i)
        parts.append(ds)
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def build_datasets(cfg: DataConfig, tokenizer_path: str) -> tuple[ray.data.Dataset, ray.data.Dataset | None]:
    """``(train, heldout)`` datasets of packed rows (``input_ids``, ``position_ids``, ``loss_mask``).

    ``train`` streams. ``heldout`` is materialised here, once: the first ``heldout_max_rows`` rows
    of the conversations whose text hashes into the held-out share, so every evaluation of the run
    (and of a resumed run) measures the very same rows."""
    load_tokenizer(tokenizer_path)  # fail here, not in a read task, if it is missing

    def packed(heldout: bool) -> ray.data.Dataset:
        ds = _messages(cfg, heldout, tokenizer_path).map_batches(
            _tokenize_and_pack,
            batch_size=cfg.pack_window,
            batch_format="pyarrow",
            num_cpus=DATA_TASK_CPUS,
            fn_kwargs=dict(tokenizer_path=tokenizer_path, cfg=cfg),
        )
        ds.context.execution_options.preserve_order = True  # deterministic when executed here (the driver)
        return ds

    heldout = None
    if cfg.heldout_fraction > 0:
        logger.info("building the held-out set (the first %d held-out rows, kept for the whole run)",
                    cfg.heldout_max_rows)
        heldout = packed(heldout=True).limit(cfg.heldout_max_rows).materialize()
    return packed(heldout=False), heldout
