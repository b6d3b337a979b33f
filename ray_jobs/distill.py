"""SwiftKV knowledge-recovery distillation as a Ray job.

    ray job submit --working-dir . -- python -m ray_jobs.distill --config ray_jobs/configs/<recipe>.yaml
    python -m ray_jobs.distill --config ray_jobs/configs/smollm2-cpu.yaml --set train.max_steps=20

Without ``ray job submit`` (and no ``RAY_ADDRESS``) it starts an embedded local Ray. The driver
validates the config, checks every data source (failing fast on a bad URI or a retrieval spec that
cannot give its rows), builds the Ray Data pipeline and runs a ``TorchTrainer``; the workers run
``swiftkv.distill.train_loop``. A base model is first converted once, in a Ray task, into the run's
folder when the start is fitted (``init.method: least_squares``, on the pipeline's first rows) or
under ZeRO-3 (so that the workers load the conversion already partitioned instead of each
converting the whole model).
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
import torch
from ray.train.torch import TorchConfig, TorchTrainer

from swiftkv.distill.config import DistillConfig
from swiftkv.distill.data import build_datasets, check_sources
from swiftkv.distill.model_io import (
    check_layout,
    conversion_memory_bytes,
    convert_once,
    is_swiftkv_checkpoint,
    least_squares_once,
)
from swiftkv.distill.train_loop import MODEL_DIR, train_loop_per_worker
from swiftkv.model_source import resolve_model
from swiftkv.ray_workers import remote_in_own_workers
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


def starting_point(cfg: DistillConfig, model_path: str, train_ds: ray.data.Dataset) -> DistillConfig:
    """``cfg``, or ``cfg`` pointing at a SwiftKV conversion of the base model (``model_path``:
    ``cfg.model`` resolved) written once under ``<storage_path>/<name>/`` by a Ray task and reused
    when the job reruns: the least-squares start (fitted on the first ``init.calibration_rows``
    training rows), or under ZeRO-3 the copy start. A SwiftKV checkpoint is trained as it is."""
    least_squares = cfg.init.method == "least_squares"
    if is_swiftkv_checkpoint(model_path) or not (least_squares or cfg.deepspeed.zero_stage == 3):
        return cfg
    storage = cfg.output.storage_path
    root = storage.rstrip("/") if "://" in storage else os.path.abspath(storage)
    parent = f"{root}/{cfg.output.name}"
    args = (cfg.model, parent, cfg.num_key_value_layers, cfg.key_value_group_size)
    shift = cfg.token_shift.as_shift()
    if least_squares:
        logger.info("fitting the least-squares start on the first %d training rows under %s",
                    cfg.init.calibration_rows, parent)
        rows = train_ds.limit(cfg.init.calibration_rows).take_all()
        dtype = torch.bfloat16 if cfg.scaling.use_gpu else torch.float32
        # The fit runs the whole teacher once: it needs the model's memory, not only the conversion's.
        task = remote_in_own_workers(least_squares_once, "start", max_calls=1, num_cpus=1,
                                     num_gpus=int(cfg.scaling.use_gpu))
        start = ray.get(task.remote(*args, rows, dtype, shift))
    else:
        logger.info("ZeRO-3: converting %s once under %s for the workers to load partitioned", cfg.model, parent)
        # The conversion reads only the tensors SwiftKV initialises from and copies the shards as files
        # (swiftkv.checkpoint_files): ask Ray for the memory that takes, so it lands on a node that has it.
        memory = conversion_memory_bytes(model_path, cfg.num_key_value_layers, cfg.key_value_group_size)
        start = ray.get(remote_in_own_workers(convert_once, "start", max_calls=1, num_cpus=1,
                                             memory=memory).remote(*args, shift))
    return cfg.model_copy(update={"model": start})


def build_trainer(cfg: DistillConfig, tokenizer_path: str,
                  datasets: tuple[ray.data.Dataset, ray.data.Dataset | None] | None = None,
                  recipe: DistillConfig | None = None) -> TorchTrainer:
    """The trainer of ``cfg``; ``datasets`` (``build_datasets``'s) when already built; ``recipe``: the
    config as the user gave it, for the model card, when ``cfg`` starts from a conversion of it."""
    train_ds, heldout_ds = datasets or build_datasets(cfg.data, tokenizer_path=tokenizer_path)
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
        train_loop_config={"config": cfg.model_dump(), "total_steps": steps,
                           "recipe": (recipe or cfg).model_dump()},
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
    model_path = resolve_model(cfg.model)  # the tokenizer for the data pipeline comes from here
    check_sources(cfg.data, model_path)  # fail on a bad source before starting or joining Ray
    check_layout(model_path, cfg.num_key_value_layers, cfg.key_value_group_size, cfg.token_shift.as_shift())
    if not ray.is_initialized():
        ray.init()
    datasets = build_datasets(cfg.data, tokenizer_path=model_path)
    start = starting_point(cfg, model_path, datasets[0])
    result = build_trainer(start, model_path, datasets, recipe=cfg).fit()
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
