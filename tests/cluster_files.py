"""The files under cluster/ and what they must agree with: the GPU recipes, the GPU Serve config,
the project's version (the image tag). Shared by the cluster config tests; nothing here starts Ray."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from setuptools.config.pyprojecttoml import load_file  # a TOML reader on Python 3.10 too

from serve_apps.config import AppConfig
from swiftkv.distill.config import DistillConfig, load_config
from swiftkv.yaml_config import parse_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
LAUNCHER_YAMLS = sorted(CLUSTER.glob("*.yaml"))
KUBERAY_MANIFESTS = sorted((CLUSTER / "kuberay").glob("*.yaml"))
DOCKERFILE = CLUSTER / "Dockerfile"
GPU_RECIPES = [REPO / "ray_jobs/configs/llama-3.1-8b-instruct-50.yaml",
               REPO / "ray_jobs/configs/llama-3.1-70b-instruct-50.yaml"]
GPU_SERVE_CONFIG = REPO / "serve_apps/llama-3.1-8b-gpu.yaml"
GPUS_PER_NODE = 8  # p5.48xlarge and a3-highgpu-8g: 8 x H100 each
# Credential material in a file: an AWS key id, a private key, a literal secret/key/token value (the
# docs' `--from-literal=AWS_SECRET_ACCESS_KEY=...` placeholders are not), key files or their variables.
CREDENTIAL = re.compile(r"AKIA[0-9A-Z]{16}|PRIVATE KEY-----|(SECRET_ACCESS_KEY|API_KEY|TOKEN)\s*[=:]\s*[\w/+]{12,}|"
                        r"\.aws/credentials|GOOGLE_APPLICATION_CREDENTIALS|ssh_private_key", re.IGNORECASE)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def pyproject() -> dict[str, Any]:
    return load_file(REPO / "pyproject.toml")


def image() -> str:
    """The image every node runs: ``registry.example.com/swiftkv:<the project's version>``."""
    return f"registry.example.com/swiftkv:{pyproject()['project']['version']}"


def recipe(path: Path, overrides: list[str] = ()) -> DistillConfig:
    return load_config(path, list(overrides))


def app_configs(serve_config: dict[str, Any]) -> list[AppConfig]:
    """Our application's typed config for each application of a Serve config file."""
    apps = serve_config["applications"]
    assert apps and all(app["import_path"] == "serve_apps.app:build_app" for app in apps)
    return [parse_config(AppConfig, app["args"], what="serve_apps config") for app in apps]


def check_recipe_fits(cfg: DistillConfig, gpus_per_node: int, cpus_per_node: float, nodes: int) -> None:
    """A GPU recipe fills whole nodes (one worker per GPU, so workers per node = GPUs per node),
    needs at most ``nodes`` of them, and its workers' CPUs fit a node."""
    assert cfg.scaling.use_gpu
    assert cfg.scaling.num_workers % gpus_per_node == 0, (cfg.scaling.num_workers, gpus_per_node)
    assert cfg.scaling.num_workers // gpus_per_node <= nodes
    assert cfg.scaling.cpus_per_worker * gpus_per_node <= cpus_per_node


def check_serving_fits(app: AppConfig, gpus_per_node: int, cpus_per_node: float, nodes: int) -> None:
    """Every replica reserves its tensor-parallel size in GPUs, replicas tile a node exactly, and
    the most replicas allowed fit ``nodes`` nodes."""
    for model in app.models:
        tp = model.engine_kwargs.get("tensor_parallel_size", 1)
        assert model.num_gpus == tp, (model.name, model.num_gpus, tp)
        assert gpus_per_node % tp == 0
        per_node = gpus_per_node // tp
        assert model.num_cpus * per_node <= cpus_per_node
        assert -(-model.autoscaling.max_replicas // per_node) <= nodes, (model.name, model.autoscaling.max_replicas)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order, as (INSTRUCTION, arguments), continuation lines joined."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [(words[0].upper(), words[1].strip()) for line in joined.splitlines()
            if (words := line.strip().split(None, 1))]


def image_workdir() -> str:
    (workdir,) = [args for instruction, args in dockerfile_instructions() if instruction == "WORKDIR"]
    return workdir
