"""SwiftKV knowledge-recovery distillation as a Ray job.

    ray job submit --working-dir . -- python -m ray_jobs.distill --config ray_jobs/configs/<recipe>.yaml
    python -m ray_jobs.distill --config ray_jobs/configs/smollm2-cpu.yaml --set train.max_steps=20

Without ``ray job submit`` (and no ``RAY_ADDRESS``) it starts an embedded local Ray. The driver
validates the config, lists the data files (failing fast on a bad URI), builds the Ray Data
pipeline and runs a ``TorchTrainer``; the workers run ``swiftkv.distill.train_loop``. Under ZeRO-3 a
base model is first converted once, in a Ray task, into the run's folder, so that the workers load
that conversion already partitioned instead of each converting the whole model.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import fsspec
import pyarrow.fs
import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from swiftkv.distill.config import DistillConfig
from swiftkv.distill.data import build_datasets, resolve_files
from swiftkv.distill.model_io import conversion_memory_bytes, convert_once, is_swiftkv_checkpoint
from swiftkv.distill.train_loop import MODEL_DIR, train_loop_per_worker
from swiftkv.model_source import resolve_model
from swiftkv.yaml_config import job_main

logger = logging.getLogger("ray_jobs.distill")


def rows_per_step(cfg: DistillConfig) -> int:
    """Packed rows one optimizer step trains on, every worker's."""
    return cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.scaling.num_workers


def total_steps(cfg: DistillConfig, train_ds: ray.data.Dataset) -> int:
    """``max_steps``, or the optimizer steps in ``epochs`` passes (this counts the packed rows,
    which runs the pipeline once)."""
    if cfg.train.max_steps is not None:
        return cfg.train.max_steps
    logger.info("counting the packed training rows to size the learning-rate schedule: one pass over the data "
                "(read, template, pack; Ray Data's progress bars follow it); set train.max_steps to skip it")
    rows = train_ds.count()
    per_step = rows_per_step(cfg)
    steps = cfg.train.epochs * (rows // per_step)
    if steps == 0:
        raise ValueError(f"{rows} packed rows make no optimizer step of {per_step} rows: add data or set max_steps")
    logger.info("%d packed rows -> %d steps over %d epoch(s)", rows, steps, cfg.train.epochs)
    return steps


def _storage(path: str) -> tuple[str, pyarrow.fs.FileSystem | None]:
    """Ray's storage path and filesystem: remote URIs go through fsspec (so e.g. ``AWS_ENDPOINT_URL``
    is honoured)."""
    if "://" not in path:
        return os.path.abspath(path), None  # Ray wants absolute local paths
    fs, root = fsspec.core.url_to_fs(path)
    return root, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


def zero3_starting_point(cfg: DistillConfig, model_path: str) -> DistillConfig:
    """``cfg``, or under ZeRO-3 with a base model (``model_path``: ``cfg.model`` resolved), ``cfg``
    pointing at a SwiftKV conversion written once under ``<storage_path>/<name>/`` by a Ray task
    (``convert_once``; reused when the job reruns)."""
    if cfg.deepspeed.zero_stage != 3 or is_swiftkv_checkpoint(model_path):
        return cfg
    storage = cfg.output.storage_path
    root = storage.rstrip("/") if "://" in storage else os.path.abspath(storage)
    parent = f"{root}/{cfg.output.name}"
    logger.info("ZeRO-3: converting %s once under %s for the workers to load partitioned", cfg.model, parent)
    # The conversion reads only the tensors SwiftKV initialises from and copies the shards as files
    # (swiftkv.checkpoint_files): ask Ray for the memory that takes, so it lands on a node that has it.
    memory = conversion_memory_bytes(model_path, cfg.num_key_value_layers, cfg.key_value_group_size)
    task = ray.remote(num_cpus=1, memory=memory)(convert_once)
    converted = ray.get(task.remote(cfg.model, parent, cfg.num_key_value_layers, cfg.key_value_group_size))
    return cfg.model_copy(update={"model": converted})


def build_trainer(cfg: DistillConfig, tokenizer_path: str) -> TorchTrainer:
    train_ds, heldout_ds = build_datasets(cfg.data, tokenizer_path=tokenizer_path)
    steps = total_steps(cfg, train_ds)
    if cfg.train.max_steps is not None:
        # Only the rows max_steps trains on: the pipeline stops reading and templating there rather than
        # running on through data no step will see (Ray Data runs ahead of training until backpressured).
        # The prefix is the same in every run, so exact resume is unaffected; data shorter than this
        # still takes several epochs.
        train_ds = train_ds.limit(steps * rows_per_step(cfg))
    # Preserving the pipeline's order makes each worker's rows and their order the same in every run
    # (streaming_split then assigns blocks deterministically): what exact resume needs.
    ingest = ray.train.DataConfig.default_ingest_options()
    ingest.preserve_order = True
    datasets = {"train": train_ds} if heldout_ds is None else {"train": train_ds, "heldout": heldout_ds}
    storage_path, storage_fs = _storage(cfg.output.storage_path)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.model_dump(), "total_steps": steps},
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
        dataset_config=ray.train.DataConfig(execution_options=ingest),
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
            placement_strategy=cfg.scaling.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            name=cfg.output.name,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            failure_config=ray.train.FailureConfig(max_failures=cfg.output.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.output.num_to_keep),
        ),
        datasets=datasets,
    )


def run(cfg: DistillConfig) -> ray.train.Result:
    """Distil on the current Ray cluster (``ray.init`` joins ``RAY_ADDRESS`` or starts a local one)."""
    for source in cfg.data.sources:  # fail on a bad URI before starting or joining Ray
        resolve_files(source.uri)
    if not ray.is_initialized():
        ray.init()
    model_path = resolve_model(cfg.model)  # the tokenizer for the data pipeline comes from here
    result = build_trainer(zero3_starting_point(cfg, model_path), model_path).fit()
    summary = {
        "checkpoint": f"{result.checkpoint.path}/{MODEL_DIR}" if result.checkpoint else None,
        "metrics": result.metrics,
    }
    print(json.dumps(summary, indent=2, default=str), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m ray_jobs.distill", __doc__.split("\n\n")[0], DistillConfig, run, argv,
                    what="distillation config", config_help="a recipe from ray_jobs/configs/", config_required=True)


if __name__ == "__main__":
    sys.exit(main())
