"""The cluster walk-through of docs/cluster.md on one machine: a ``ray.cluster_utils.Cluster`` with a
CPU-less head and two worker nodes (custom resources ``node_a``/``node_b`` tell them apart), an S3
server (moto) on 127.0.0.1, and the same commands a user runs against a real cluster.

1. ``ray job submit`` a distillation of a tiny random SwiftKV model with one worker per node
   (``placement_strategy: STRICT_SPREAD``), data and checkpoints on S3. After the first checkpoint
   the node holding one worker is removed and a replacement node joins (as the autoscaler would
   bring one): the run resumes from the checkpoint and completes; the result loads in Hugging Face.
2. ``serve deploy`` the Serve application on that result (``s3://``), one replica per node
   (``max_replicas_per_node: 1``); the ``openai`` client is answered by both replicas through the
   head's proxy; ``serve status`` and ``ray status`` run; ``serve shutdown`` leaves no engine behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import openai
import pytest
import ray
import s3fs
import yaml
from ray import serve
from ray.cluster_utils import Cluster
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.state import list_actors
from transformers import AutoModelForCausalLM

from serve_apps.subprocess_server import free_port
from swiftkv.bundled import copy_bundled_tokenizer
from tests.distill_data import ultrachat_rows, write_parquet
from tests.s3_server import moto_s3_server, s3_env
from tests.serve_cluster import CACHE, CPU_ENV, engine_processes, wait_for
from tests.tiny import tiny_swiftkv_model

BUCKET = "swiftkv-cluster"
RUN = "tiny-swiftkv"
STEPS = 8  # checkpoints every 2: the node goes after the first, well before the end
BIN = Path(sys.executable).parent  # the `ray` and `serve` commands of this environment
# Marks this test's vLLM processes, so the leftover check never touches another run's engines.
MARKER = {"SWIFTKV_TEST_CLUSTER": uuid.uuid4().hex}


def cli(*args: str, timeout_s: float = 120) -> str:
    """Run a ``ray``/``serve`` command as a user would; fail with its output if it fails."""
    done = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


class LocalCluster:
    """The cluster under test: node handles by name, and the dashboard address the CLI talks to."""

    def __init__(self, cluster: Cluster, dashboard: str) -> None:
        self.cluster = cluster
        self.dashboard = dashboard
        self.nodes: dict[str, object] = {}

    def add(self, name: str) -> None:
        # Two logical CPUs: a 0.5-CPU training worker or a 1-CPU model replica, plus Ray Data's tasks.
        self.nodes[name] = self.cluster.add_node(num_cpus=2, resources={name: 1})

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name))

    def node_names(self, actor_class: str, state: str | None = None) -> list[str]:
        """The names of the nodes holding the actors of a class (in the state given, if any)."""
        by_id = {node.node_id: name for name, node in self.nodes.items()}
        filters = [("class_name", "=", actor_class)] + ([("state", "=", state)] if state else [])
        actors = list_actors(address=self.dashboard, filters=filters, detail=True, raise_on_missing_output=False)
        return sorted(by_id.get(a.node_id, "gone") for a in actors)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with moto_s3_server() as endpoint, s3_env(endpoint):
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        # Set before the nodes start, so every raylet (and so every worker and job driver) inherits them.
        os.environ["RAY_AUTH_MODE"] = "disabled"
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(CACHE / "torch_extensions"))
        port, gcs_port = free_port(), free_port()
        # Every process of this cluster finds it by RAY_ADDRESS, never by "the latest Ray on this
        # machine" (Ray Train's placement-group cleaner looks the cluster up that way; other Rays run here).
        saved = os.environ.get("RAY_ADDRESS")
        os.environ["RAY_ADDRESS"] = f"{ray.util.get_node_ip_address()}:{gcs_port}"
        # No CPUs on the head: training workers and replicas land on the worker nodes only.
        # The agent's default port (52365) may be another Ray's on this machine; worker nodes pick their own.
        cluster = Cluster(initialize_head=True, head_node_args={
            "gcs_server_port": gcs_port, "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": port, "dashboard_agent_listen_port": free_port()})
        local = LocalCluster(cluster, f"http://127.0.0.1:{port}")
        try:
            ray.init(address=cluster.address)  # the driver sits on the head, which is never removed
            for name in ("node_a", "node_b"):
                local.add(name)
            yield local
        finally:
            ray.shutdown()
            cluster.shutdown()
            if saved is None:
                os.environ.pop("RAY_ADDRESS")
            else:
                os.environ["RAY_ADDRESS"] = saved


def write_recipe(tmp_path: Path) -> Path:
    """A tiny random SwiftKV checkpoint (local), its chat data on S3, and its distillation recipe."""
    model = tmp_path / "tiny"
    # hidden_size 128: a head size (32) that vLLM's CPU attention supports, for the Serve test.
    tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2, hidden_size=128).save_pretrained(model)
    copy_bundled_tokenizer(model)
    data = write_parquet(ultrachat_rows(200, 0), tmp_path / "chat.parquet")
    boto3.client("s3").upload_file(str(data), BUCKET, "chat/train-0.parquet")
    recipe = {
        "model": str(model),
        "data": {"sources": [{"uri": f"s3://{BUCKET}/chat/*.parquet", "format": "ultrachat"}],
                 "max_seq_len": 128, "heldout_fraction": 0},
        "train": {"max_steps": STEPS, "lr": 3e-3, "micro_batch_size": 2, "loss_chunk_tokens": 64},
        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "placement_strategy": "STRICT_SPREAD"},
        "output": {"storage_path": f"s3://{BUCKET}/runs", "name": RUN, "checkpoint_every_steps": 2,
                   "max_failures": 2},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def wait_for_checkpoint(timeout_s: float) -> None:
    snapshot = f"{BUCKET}/runs/{RUN}/checkpoint_manager_snapshot.json"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)

    def registered() -> bool:
        fs.invalidate_cache()
        return fs.exists(snapshot) and "step_" in fs.cat(snapshot).decode()

    wait_for(registered, timeout_s, "the first checkpoint on S3", period_s=0.5)


def job_summary(client: JobSubmissionClient, job_id: str, timeout_s: float) -> dict:
    """Wait for the job to end; return the JSON summary its driver prints (checkpoint and metrics)."""
    wait_for(lambda: client.get_job_status(job_id).is_terminal(), timeout_s, "the distillation job", period_s=2.0)
    logs = client.get_job_logs(job_id)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, logs[-4000:]
    start = logs.rindex('{\n  "checkpoint"')
    return json.JSONDecoder().raw_decode(logs[start:])[0]


@pytest.fixture(scope="module")
def distilled(cluster, tmp_path_factory) -> dict:
    """Submit the distillation, remove a worker's node after the first checkpoint, add a new node;
    return the driver's summary and where the workers ran before and after."""
    recipe = write_recipe(tmp_path_factory.mktemp("recipe"))
    job_id = "distill-" + uuid.uuid4().hex[:8]
    cli("ray", "job", "submit", "--address", cluster.dashboard, "--submission-id", job_id, "--no-wait", "--",
        sys.executable, "-m", "ray_jobs.distill", "--config", str(recipe))
    wait_for_checkpoint(timeout_s=600)
    before = cluster.node_names("RayTrainWorker", state="ALIVE")
    victim = before[-1]
    cluster.remove(victim)
    cluster.add("node_c")  # the replacement the autoscaler would launch
    summary = job_summary(JobSubmissionClient(cluster.dashboard), job_id, timeout_s=600)
    return {"summary": summary, "before": before, "victim": victim,
            "after": cluster.node_names("RayTrainWorker")}


def test_distillation_one_worker_per_node_survives_a_lost_node(distilled, tmp_path):
    assert distilled["before"] == ["node_a", "node_b"]  # one worker on each node
    assert "node_c" in distilled["after"]  # the resumed worker group used the replacement node
    metrics = distilled["summary"]["metrics"]
    assert metrics["step"] == STEPS
    assert metrics["resumed_from_step"] >= 2  # from the checkpoint, not from scratch
    checkpoint = distilled["summary"]["checkpoint"]
    local = tmp_path / "model"
    s3fs.S3FileSystem(skip_instance_cache=True).get(checkpoint.removeprefix("s3://") + "/", str(local),
                                                    recursive=True)
    loaded = AutoModelForCausalLM.from_pretrained(local)
    assert loaded.config.model_type == "llama_swiftkv" and loaded.config.swiftkv


def serve_config(model_uri: str, port: int) -> dict:
    """A Serve config file for ``serve deploy``: the application on the distilled checkpoint, two
    replicas that may not share a node, the proxy on the head only (all nodes share 127.0.0.1 here)."""
    model = {
        "name": "tiny-distilled",
        "model": model_uri,
        "env": {**CPU_ENV, **MARKER},
        "num_cpus": 1,
        "max_replicas_per_node": 1,
        "engine_kwargs": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256},
        "autoscaling": {"min_replicas": 2, "max_replicas": 2, "policy": "requests"},
        "routing": {"router": "pow2"},
    }
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "swiftkv", "route_prefix": "/", "import_path": "serve_apps.app:build_app",
                          "args": {"api_key_env": None, "models": [model]}}],
    }


def app_status() -> str:
    """The application's status (from this driver, cheaper than polling the CLI); a failed deployment
    fails the test."""
    app = serve.status().applications.get("swiftkv")
    assert app is None or app.status != "DEPLOY_FAILED", app.message
    return app.status if app else "NOT_STARTED"


def marked_engines() -> list:
    return [p for p in engine_processes() if _environ(p).get("SWIFTKV_TEST_CLUSTER") == MARKER["SWIFTKV_TEST_CLUSTER"]]


def _environ(proc) -> dict:
    try:
        return proc.environ()
    except Exception:  # gone, or not ours to read
        return {}


def test_serve_one_replica_per_node_answers_through_the_proxy(cluster, distilled, tmp_path):
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(serve_config("s3://" + distilled["summary"]["checkpoint"].removeprefix("s3://"),
                                                  port)))
    cli("serve", "deploy", str(config), "--address", cluster.dashboard)
    try:
        wait_for(lambda: app_status() == "RUNNING", 600, "the Serve application to run", period_s=2.0)
        assert yaml.safe_load(cli("serve", "status", "--address", cluster.dashboard))["applications"]["swiftkv"][
            "status"] == "RUNNING"
        replicas = cluster.node_names("ServeReplica:swiftkv:model-tiny-distilled", state="ALIVE")
        assert len(replicas) == 2 and len(set(replicas)) == 2, replicas  # one replica on each node
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        seen: set[str] = set()
        deadline = time.monotonic() + 90
        while len(seen) < 2 and time.monotonic() < deadline:
            raw = client.chat.completions.with_raw_response.create(
                model="tiny-distilled", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            assert raw.parse().choices[0].message.content is not None
            seen.add(raw.headers["x-swiftkv-replica"])
        assert len(seen) == 2, f"only {seen} answered"
        assert "node_a" in cli("ray", "status", "--address", cluster.cluster.address)
    finally:
        cli("serve", "shutdown", "-y", "--address", cluster.dashboard)
    wait_for(lambda: not marked_engines(), 60, "the vLLM engines to stop")
