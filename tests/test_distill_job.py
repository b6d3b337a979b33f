"""The distillation job on a local Ray cluster with two CPU workers (gloo, DeepSpeed ZeRO-2/3).

Data comes from a real S3 server (moto) on 127.0.0.1 in the three public schemas; one worker is
killed with SIGKILL mid-run; the final checkpoint is loaded by Hugging Face and generates.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import boto3
import psutil
import pytest
import ray
import s3fs
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import swiftkv.modeling  # noqa: F401  (registers the SwiftKV Auto classes)
from ray_jobs.distill import run, starting_point
from swiftkv.bundled import copy_bundled_tokenizer, ensure_bundled_model
from swiftkv.cli import main as cli
from swiftkv.distill import data
from swiftkv.distill.config import DataConfig, parse_config
from swiftkv.distill.data import build_datasets
from swiftkv.distill.retrieval_data import retrieval_chat
from swiftkv.ray_workers import remote_in_own_workers
from tests.distill_data import sharegpt_rows, ultrachat_rows, write_jsonl, write_parquet
from tests.file_modes import unreadable
from tests.s3_server import moto_s3_server, s3_env
from tests.tiny import save_tiny_base, tiny_swiftkv_model

BUCKET = "swiftkv-chat"


@pytest.fixture(scope="module")
def s3_data(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 holding UltraChat / OpenHermes / SlimOrca files (credentials and
    endpoint in the environment, set before Ray starts so its workers inherit them)."""
    with moto_s3_server() as endpoint, s3_env(endpoint):
        yield from _s3_bucket(tmp_path_factory)


def _s3_bucket(tmp_path_factory):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    local = tmp_path_factory.mktemp("s3src")
    files = {
        "ultrachat/train-0.parquet": write_parquet(ultrachat_rows(120, 0), local / "u.parquet"),
        "openhermes/openhermes.jsonl": write_jsonl(sharegpt_rows(120, 1), local / "o.jsonl"),
        "slimorca/part-0.parquet": write_parquet(sharegpt_rows(60, 2), local / "s0.parquet"),
        "slimorca/part-1.parquet": write_parquet(sharegpt_rows(60, 3), local / "s1.parquet"),
    }
    for key, path in files.items():
        s3.upload_file(str(path), BUCKET, key)
    yield [
        {"uri": f"s3://{BUCKET}/ultrachat/*.parquet", "format": "ultrachat"},
        {"uri": f"s3://{BUCKET}/openhermes/openhermes.jsonl", "format": "openhermes", "sample_count": 100},
        {"uri": f"s3://{BUCKET}/slimorca/", "format": "slimorca", "weight": 0.8},
    ]


@pytest.fixture(scope="module")
def ray_cluster(s3_data):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # DeepSpeed compiles its CPU shared-memory comm op on first use (about a minute): keep the build
    # in the repo's ignored cache so later runs (and CI with a cached .cache/) skip it.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).parent.parent / ".cache" / "torch_extensions"))
    # More logical CPUs than cores, so two 0.5-CPU workers leave room for Ray Data's tasks.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def _config(model: Path, sources: list[dict], out: Path | str, **sections) -> dict:
    tree = {
        "model": str(model),
        "data": {"sources": sources, "max_seq_len": 128, "heldout_fraction": 0.15, "heldout_max_rows": 8},
        "train": {"max_steps": 8, "lr": 3e-3, "micro_batch_size": 2, "loss_chunk_tokens": 64},
        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
        "output": {"storage_path": str(out), "checkpoint_every_steps": 2},
    }
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    return tree


def test_s3_data_and_storage_zero3_distils_and_checkpoints_what_changes(ray_cluster, s3_data, tmp_path):
    # Random SwiftKV weights: the student starts far from the teacher, so recovery must show.
    model = tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2)
    model.save_pretrained(tmp_path / "tiny")
    copy_bundled_tokenizer(tmp_path / "tiny")
    # Checkpoints go to S3 too.
    cfg = parse_config(_config(tmp_path / "tiny", s3_data, f"s3://{BUCKET}/runs", deepspeed={"zero_stage": 3}))
    result = run(cfg)
    assert result.error is None
    final = result.metrics
    assert final["step"] == 8 and final["resumed_from_step"] == -1
    # Held-out KL to the teacher at least halves in 8 steps, on the very same held-out rows.
    assert final["heldout_kl"] < 0.5 * final["heldout_kl_at_start"], final
    assert final["heldout_tokens"] == final["heldout_tokens_at_start"]

    # The last checkpoint holds the full model: it loads, only the SwiftKV weights moved, it generates.
    ckpt = Path(result.checkpoint.to_directory(str(tmp_path / "downloaded"))) / "model"
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert loaded.config.model_type == "llama_swiftkv" and loaded.config.swiftkv
    assert loaded.config.num_key_value_layers == 2
    trained = dict(loaded.named_parameters())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, trained[n])}
    assert changed == {n for n, _ in model.swiftkv_parameters()}  # only the SwiftKV weights moved
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = loaded.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 5

    # An earlier checkpoint keeps only what training changes; `swiftkv merge` makes the full model of it.
    s3 = s3fs.S3FileSystem()
    kept = sorted(s3.glob(f"{BUCKET}/runs/swiftkv-distill/step_*"))  # num_to_keep: the last two
    assert [k.rsplit("/", 1)[1] for k in kept] == ["step_00000006", "step_00000008"]
    earlier = s3.find(kept[0])
    assert not any("/model/" in f for f in earlier) and any(f.endswith("swiftkv/swiftkv.safetensors") for f in earlier)
    s3.get(kept[0], str(tmp_path / "step6"), recursive=True)
    assert cli(["merge", str(tmp_path / "step6"), str(tmp_path / "merged")]) == 0
    assert unreadable(tmp_path / "merged") == []  # others can read it (safetensors writes 0600)
    merged = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").named_parameters())
    part = load_file(tmp_path / "step6" / "swiftkv" / "swiftkv.safetensors")
    assert set(part) == {n for n, _ in model.swiftkv_parameters()}
    assert all(torch.equal(merged[n], t) for n, t in part.items())
    assert all(torch.equal(merged[n], p) for n, p in model.named_parameters() if n not in part)


def _train_worker_pids() -> list[int]:
    """Ray Train worker processes of this test's cluster (Ray names them ``ray::RayTrainWorker``)."""
    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith("ray::RayTrainWorker"):
                pids.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def _kill_a_worker_after_first_checkpoint(run_dir: Path, victim: dict, timeout_s: float = 400) -> None:
    """SIGKILL one Ray Train worker process as soon as a checkpoint is registered."""
    deadline = time.monotonic() + timeout_s
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    while time.monotonic() < deadline:
        if snapshot.is_file() and "step_" in snapshot.read_text():
            pids = _train_worker_pids()
            if pids:
                victim["pid"] = pids[-1]
                os.kill(victim["pid"], signal.SIGKILL)
                return
        time.sleep(0.2)


def _swiftkv_weights(result) -> dict[str, torch.Tensor]:
    return load_file(Path(result.checkpoint.path) / "swiftkv" / "swiftkv.safetensors")


def test_a_killed_run_resumes_onto_the_same_data_and_ends_with_the_same_weights(ray_cluster, tmp_path):
    """A plain Llama base under ZeRO-3 (the job converts it once into the run's folder; the workers,
    restarted ones too, load that conversion partitioned). A run whose worker is killed after a
    checkpoint resumes from it, verifies the restored optimizer state and learning rate against it
    (it fails otherwise), trains on exactly the micro-batches an uninterrupted run trains on (the
    same data digest) and ends with the same SwiftKV weights (float32, to 1e-6)."""
    save_tiny_base(tmp_path / "base", "llama", bundled_tokenizer=True)
    sources = [
        {"uri": str(write_parquet(ultrachat_rows(150, 5), tmp_path / "chat" / "a.parquet")), "format": "ultrachat"},
        {"uri": str(write_jsonl(sharegpt_rows(150, 6), tmp_path / "chat" / "b.jsonl")), "format": "openhermes"},
    ]

    def tree(out: str) -> dict:
        return _config(tmp_path / "base", sources, tmp_path / out, train={"max_steps": 8},
                       output={"checkpoint_every_steps": 2, "max_failures": 2}, deepspeed={"zero_stage": 3})

    uninterrupted = run(parse_config(tree("whole")))
    assert uninterrupted.error is None and uninterrupted.metrics["resumed_from_step"] == -1

    victim: dict = {}
    killer = threading.Thread(
        target=_kill_a_worker_after_first_checkpoint, args=(tmp_path / "killed" / "swiftkv-distill", victim)
    )
    killer.start()
    resumed = run(parse_config(tree("killed")))
    killer.join()
    assert "pid" in victim, "no worker was killed"
    with pytest.raises(ProcessLookupError):
        os.kill(victim["pid"], 0)  # really gone
    assert resumed.error is None and resumed.metrics["step"] == 8
    assert resumed.metrics["resumed_from_step"] >= 2  # restarted from a checkpoint, not from scratch
    assert resumed.metrics["data_digest"] == uninterrupted.metrics["data_digest"]
    want, got = _swiftkv_weights(uninterrupted), _swiftkv_weights(resumed)
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    (init,) = (tmp_path / "killed" / "swiftkv-distill").glob("student-init-*/config.json")
    assert AutoConfig.from_pretrained(init.parent).num_key_value_layers == 2
    converted_at = init.stat().st_mtime_ns
    # Others can read what the run wrote: its checkpoints (the last with the model) and the conversion.
    assert unreadable(Path(uninterrupted.checkpoint.path).parent) == [] and unreadable(init.parent) == []

    # The same storage path again, asking for two more steps: it resumes at step 8.
    longer = tree("killed")
    longer["train"]["max_steps"] = 10
    again = run(parse_config(longer))
    assert again.metrics["resumed_from_step"] == 8 and again.metrics["step"] == 10
    assert init.stat().st_mtime_ns == converted_at  # the conversion was reused, not redone


def test_malformed_rows_are_skipped_and_bundled_chitchat_reads(ray_cluster, tmp_path):
    bad = [
        {"prompt": "x", "prompt_id": "bad-1", "messages": [{"role": "bot", "content": "hi"}]},
        {"prompt": "y", "prompt_id": "bad-2", "messages": [{"role": "user", "content": "no reply"}]},
    ]
    path = write_jsonl(ultrachat_rows(20, 9) + bad, tmp_path / "mixed.jsonl")
    tokenizer = str(ensure_bundled_model())
    cfg = DataConfig(
        sources=[{"uri": str(path), "format": "ultrachat"}], max_seq_len=128, pack=False, heldout_fraction=0
    )
    train, heldout = build_datasets(cfg, tokenizer)
    assert heldout is None and train.count() == 20  # one row per good conversation, the two bad ones skipped
    chat = DataConfig(
        sources=[{"uri": "bundled:chitchat", "format": "chitchat", "sample_count": 40}],
        max_seq_len=256,
        heldout_fraction=0,
    )
    rows = build_datasets(chat, tokenizer)[0].take_all()
    assert rows and all(r["loss_mask"].sum() > 0 for r in rows)


def test_one_big_file_streams_in_windows_of_small_integer_rows(ray_cluster, capsys):
    """The bundled chitchat file is one JSON object of 7K conversations: it is templated in windows
    (many blocks, not one task the first batch waits for, and no all-to-all stage), and the rows hold
    the smallest integer types that fit. The order is the same on every read (resume needs it)."""
    tokenizer = str(ensure_bundled_model())
    cfg = DataConfig(sources=[{"uri": "bundled:chitchat", "format": "chitchat", "sample_count": 400}],
                     max_seq_len=256, heldout_fraction=0, pack_window=50)
    train, _ = build_datasets(cfg, tokenizer)
    capsys.readouterr()
    train.explain()  # Ray Data prints the physical plan: map stages only, no all-to-all barrier
    plan = capsys.readouterr().out
    assert "TaskPoolMapOperator" in plan and "AllToAllOperator" not in plan
    rows = train.materialize()
    # Those with a reply: 231 of the 400.
    conversations = data._messages(cfg, heldout=False, tokenizer_path=tokenizer).count()
    assert conversations > 3 * cfg.pack_window and rows.num_blocks() >= conversations // cfg.pack_window
    first = rows.take(1)[0]
    dtypes = tuple(str(first[key].dtype) for key in ("input_ids", "position_ids", "loss_mask"))
    assert dtypes == ("int32", "int16", "uint8")
    again = build_datasets(cfg, tokenizer)[0].take(5)
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(rows.take(5), again, strict=True))


def test_parquet_is_read_without_a_listing_stage(ray_cluster, tmp_path, capsys):
    """Parquet goes through Ray Data's V1 reader: 2.60's default plan starts with a ``ListFiles`` stage
    that starts 32 footer-reading actors at every execution (the held-out set, each epoch)."""
    path = write_parquet(ultrachat_rows(20, 12), tmp_path / "chat.parquet")
    cfg = DataConfig(sources=[{"uri": str(path), "format": "ultrachat"}], max_seq_len=128, heldout_fraction=0)
    train, _ = build_datasets(cfg, str(ensure_bundled_model()))
    capsys.readouterr()
    train.explain()
    plan = capsys.readouterr().out
    assert "ReadParquet" in plan and "ListFiles" not in plan
    assert ray.data.DataContext.get_current().use_datasource_v2  # the user's setting is left as it was


def test_max_steps_reads_only_the_rows_its_steps_train_on(ray_cluster, tmp_path):
    """With max_steps the trainer's train dataset stops at steps x micro-batch x grad_accum x workers
    packed rows (the pipeline stops templating there); without it every row is read."""
    from ray_jobs.distill import build_trainer

    tokenizer = str(ensure_bundled_model())
    path = write_jsonl(ultrachat_rows(60, 11), tmp_path / "chat.jsonl")
    tree = {"model": tokenizer, "data": {"sources": [{"uri": str(path), "format": "ultrachat"}],
                                         "max_seq_len": 128, "pack": False, "heldout_fraction": 0},
            "train": {"max_steps": 3, "micro_batch_size": 2, "grad_accum": 2},
            "scaling": {"num_workers": 2}, "output": {"storage_path": str(tmp_path / "runs")}}
    assert build_trainer(parse_config(tree), tokenizer).datasets["train"].count() == 3 * 2 * 2 * 2
    tree["train"] = {"max_steps": None, "epochs": 1, "micro_batch_size": 2}
    assert build_trainer(parse_config(tree), tokenizer).datasets["train"].count() == 60  # unpacked: a row each


def test_the_conversion_task_asks_for_the_memory_it_takes(tmp_path):
    """Llama-3.1-70B at c = 40: the SwiftKV tensors twice in float32 plus 2 GiB, far below the 140 GB a
    whole bf16 base would take (a base in a format other than safetensors is loaded whole: twice its size)."""
    from swiftkv.distill.model_io import conversion_memory_bytes

    (tmp_path / "config.json").write_text((Path(__file__).parent / "fixtures" / "llama-3.1-70b-instruct-config.json")
                                          .read_text())
    (tmp_path / "model-00001-of-00030.safetensors").touch()
    assert 25e9 < conversion_memory_bytes(str(tmp_path), 40) < 35e9
    (tmp_path / "model-00001-of-00030.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    on_disk = 1000 + (tmp_path / "config.json").stat().st_size
    assert conversion_memory_bytes(str(tmp_path), 40) == 2 * 2**30 + 2 * on_disk


def _import_package(folder: str, marker: str = "") -> int:
    """Import ``pkg`` from ``folder`` (its ``__init__`` waits when ``marker`` names a file it creates)."""
    import sys

    os.environ["PKG_MARKER"] = marker
    sys.path.insert(0, folder)
    import pkg  # noqa: F401

    return os.getpid()


def test_model_tasks_run_in_workers_no_interrupted_import_has_left_half_done(ray_cluster, tmp_path):
    """A Ray Data task stopped by ``limit()`` is interrupted where it is, maybe inside ``import torch``;
    its worker keeps the half-imported package. The start's, evaluation's and benchmark's tasks run
    in workers of their own all the same (the start's in a new one each time)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "sub.py").write_text("VALUE = 1\n")
    # A package whose submodule is loaded before it stops: a worker interrupted there keeps pkg.sub in
    # sys.modules without pkg, and importing pkg again fails as torch did (torch._utils).
    (tmp_path / "pkg" / "__init__.py").write_text(
        "import os, pathlib, time\nimport pkg.sub\nVALUE = pkg.sub.VALUE\n"
        "if os.environ['PKG_MARKER']:\n    pathlib.Path(os.environ['PKG_MARKER']).touch()\n"
        "    for _ in range(1200):\n        time.sleep(0.1)\n")  # short sleeps: Ray's interrupt waits for bytecode
    marker = tmp_path / "importing"
    stopped = ray.remote(_import_package).remote(str(tmp_path), str(marker))
    for _ in range(600):  # bounded: the task starts within a minute
        if marker.exists():
            break
        time.sleep(0.1)
    assert marker.exists()
    ray.cancel(stopped)  # force=False, as Ray Data stops its tasks: a KeyboardInterrupt in the import
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(stopped, timeout=60)
    pooled = remote_in_own_workers(_import_package, "test")
    assert ray.get([pooled.remote(str(tmp_path)) for _ in range(2)])  # each imports the package whole
    once = remote_in_own_workers(_import_package, "test-once", max_calls=1)
    assert ray.get(once.remote(str(tmp_path))) != ray.get(once.remote(str(tmp_path)))  # a new worker each


def test_a_synthetic_source_holds_out_rows_of_its_own(ray_cluster):
    """A synthetic source's held-out rows are its next ids after the training ones: all its training
    rows train, none is generated to find the held-out ones, and the two sets share no row."""
    tokenizer = str(ensure_bundled_model())
    src = {"synthetic": "retrieval", "rows": 8, "min_tokens": 192, "max_tokens": 256, "filler": "bundled:squad"}
    cfg = DataConfig(sources=[src], max_seq_len=256, heldout_fraction=0.2)

    def texts(heldout: bool) -> list[str]:
        rows = data._messages(cfg, heldout=heldout, tokenizer_path=tokenizer).take_all()
        return [json.dumps(list(r["messages"]), default=str) for r in rows]

    train, heldout = texts(False), texts(True)
    assert len(train) == 8 and len(heldout) == 2 and not set(train) & set(heldout)  # ceil(8 * 0.2)
    spec = cfg.sources[0]
    ninth = retrieval_chat(8, spec.tasks, spec.filler, spec.min_tokens, spec.max_tokens, spec.seed,
                           data.load_tokenizer(tokenizer))
    assert heldout[0] == json.dumps(ninth, default=str)


def test_retrieval_rows_and_the_least_squares_start(ray_cluster, tmp_path):
    """Synthetic retrieval chats stream through the pipeline beside a chat file; the least-squares
    start is fitted once on the first rows (its R² saved beside it, the fitted K/V projections unlike
    the copy's), the run trains from it, and the final model carries its model card."""
    base = save_tiny_base(tmp_path / "base", "llama", bundled_tokenizer=True)
    sources = [{"uri": str(write_jsonl(ultrachat_rows(40, 13), tmp_path / "chat.jsonl")), "format": "ultrachat"},
               {"synthetic": "retrieval", "rows": 12, "min_tokens": 192, "max_tokens": 384, "filler": "bundled:squad"}]
    tree = _config(tmp_path / "base", sources, tmp_path / "runs", train={"max_steps": 2},
                   data={"max_seq_len": 384}, init={"method": "least_squares", "calibration_rows": 5})
    cfg = parse_config(tree)
    rows = build_datasets(cfg.data, str(tmp_path / "base"))[0].take_all()
    # The retrieval chats are the long examples (192-384 tokens; the chat file's are far shorter).
    assert max(int(r["position_ids"].max()) for r in rows) + 1 >= 192
    result = run(cfg)
    assert result.error is None and result.metrics["step"] == 2
    (fit,) = (tmp_path / "runs" / "swiftkv-distill").glob("student-init-ls-*/init_fit.json")
    figures = json.loads(fit.read_text())
    assert figures["k_r2_least_squares"] > figures["k_r2_before"] and figures["heldout_tokens"] > 0
    start = load_file(fit.parent / "model-swiftkv.safetensors")
    copied = base.model.layers[3].self_attn.k_proj.weight
    assert not torch.allclose(start["model.layers.3.self_attn.k_proj_swiftkv.weight"], copied)
    card = (Path(result.checkpoint.path) / "model" / "README.md").read_text()
    assert "least_squares" in card and "synthetic: retrieval" in card and "Quality gate" in card
    # A rerun with the same storage and rows reuses the fit (the job's own start step, without training).
    fitted_at = fit.stat().st_mtime_ns
    again = starting_point(cfg, str(tmp_path / "base"), build_datasets(cfg.data, str(tmp_path / "base"))[0])
    assert again.model == str(fit.parent) and fit.stat().st_mtime_ns == fitted_at
