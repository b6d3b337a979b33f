"""The Ray cluster launcher YAMLs (cluster/*.yaml): valid for `ray up` and sized for the recipes.

Validity is checked the way `ray up` checks before it contacts the cloud: the file against the
cluster-config JSON schema shipped in the ray package, then Ray's own ``prepare_config`` (provider
defaults merged, node types filled in) and ``validate_config``. Nothing starts Ray or reaches a cloud.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.cluster_files import (
    CREDENTIAL,
    GPU_RECIPES,
    GPU_SERVE_CONFIG,
    LAUNCHER_YAMLS,
    app_configs,
    check_recipe_fits,
    check_serving_fits,
    image,
    load_yaml,
    recipe,
)

SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_there_is_one_launcher_yaml_per_cloud():
    assert {load_yaml(p)["provider"]["type"] for p in LAUNCHER_YAMLS} == {"aws", "gcp"}


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_validates_as_ray_up_does(path):
    config = load_yaml(path)
    jsonschema.validate(config, SCHEMA)
    validate_config(prepare_config(config))


def _gpu_node_type(config: dict) -> dict:
    (gpu,) = [t for t in config["available_node_types"].values() if t["resources"].get("GPU")]
    return gpu


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_gpu_workers_are_sized_for_the_recipes_and_serving(path):
    config = load_yaml(path)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}  # no work on the CPU head (the 70B conversion needs ~140 GB)
    gpu = _gpu_node_type(config)
    gpus, cpus, nodes = gpu["resources"]["GPU"], gpu["resources"]["CPU"], gpu["max_workers"]
    assert gpus == 8 and gpu["min_workers"] == 0 and nodes <= config["max_workers"]
    for path_ in GPU_RECIPES:  # 8B: one node; 70B: four
        check_recipe_fits(recipe(path_), gpus, cpus, nodes)
    assert max(recipe(p).scaling.num_workers for p in GPU_RECIPES) == nodes * gpus  # no node type left unused
    for app in app_configs(load_yaml(GPU_SERVE_CONFIG)):
        check_serving_fits(app, gpus, cpus, nodes)


def test_aws_nodes_run_the_project_image_with_instance_role_credentials():
    config = load_yaml(next(p for p in LAUNCHER_YAMLS if p.name == "aws.yaml"))
    assert config["docker"]["image"] == image()
    assert config["setup_commands"] == []  # everything comes from the image
    gpu = _gpu_node_type(config)
    assert gpu["node_config"]["InstanceType"] == "p5.48xlarge"
    assert gpu["node_config"]["IamInstanceProfile"]["Arn"].endswith(":instance-profile/ray-autoscaler-v1")


def test_gcp_nodes_install_with_the_project_setup_and_use_the_service_account():
    config = load_yaml(next(p for p in LAUNCHER_YAMLS if p.name == "gcp.yaml"))
    assert config["file_mounts"]["~/swiftkv"] == "."
    assert ".venv" in config["rsync_exclude"]  # the local environment is never copied over
    assert "SWIFTKV_EXTRAS=gpu,demo,test bash scripts/setup.sh" in config["setup_commands"][0]
    for command in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        assert command.startswith("source ~/swiftkv/.venv/bin/activate && ")
    gpu = _gpu_node_type(config)
    assert gpu["node_config"]["machineType"] == "a3-highgpu-8g"
    (account,) = gpu["node_config"]["serviceAccounts"]
    assert account["email"].startswith("ray-autoscaler-sa-v1@")


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_no_credentials_in_the_files(path):
    assert not CREDENTIAL.search(path.read_text())
    assert "--dashboard-host=127.0.0.1" in " ".join(load_yaml(path)["head_start_ray_commands"])


@pytest.mark.parametrize("path", LAUNCHER_YAMLS, ids=lambda p: p.name)
def test_every_node_gets_the_api_key_file_the_gpu_serve_config_reads(path):
    (app,) = app_configs(load_yaml(GPU_SERVE_CONFIG))
    assert load_yaml(path)["file_mounts"][app.api_key_file] == app.api_key_file  # same place, from the laptop
