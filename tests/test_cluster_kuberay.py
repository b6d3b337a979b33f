"""The KubeRay manifests (cluster/kuberay/): what KubeRay requires of each kind, pod templates that
are valid Kubernetes, and resources that match what they run.

KubeRay's CRD schemas and kubeconform are not on PyPI or npm, so the CRD-level checks below are the
required fields and rules of KubeRay's CRDs and validation webhook (ray.io/v1), written out; every
pod template inside a manifest is validated against the Kubernetes JSON schemas that the
``kubernetes-validate`` package ships (strict: unknown fields fail). Nothing starts Ray.
"""

from __future__ import annotations

import re
import shlex

import kubernetes_validate
import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_apps.app import build_app
from serve_apps.vllm_app import vllm_server_args
from tests.cluster_files import (
    CREDENTIAL,
    GPU_RECIPES,
    GPUS_PER_NODE,
    KUBERAY_MANIFESTS,
    REPO,
    app_configs,
    check_recipe_fits,
    check_serving_fits,
    image,
    image_workdir,
    load_yaml,
    recipe,
)

KUBERNETES = "1.33.0"  # the Kubernetes version the pod templates are validated for
# KubeRay's limits on names (DNS-1035 labels; RayJob and RayService names leave room for a suffix).
NAME_LIMIT = {"RayCluster": 53, "RayJob": 47, "RayService": 47}
SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)


def manifest(kind: str) -> dict:
    (doc,) = [load_yaml(p) for p in KUBERAY_MANIFESTS if load_yaml(p)["kind"] == kind]
    return doc


def cluster_spec(doc: dict) -> dict:
    """The RayCluster spec inside any of the three kinds."""
    return {"RayCluster": lambda s: s, "RayJob": lambda s: s["rayClusterSpec"],
            "RayService": lambda s: s["rayClusterConfig"]}[doc["kind"]](doc["spec"])


def groups(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]


def containers(spec: dict) -> list[dict]:
    return [c for g in groups(spec) for c in g["template"]["spec"]["containers"]]


def gpus(group: dict) -> int:
    limits = group["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def gpu_groups(spec: dict) -> list[dict]:
    return [g for g in spec.get("workerGroupSpecs", []) if gpus(g)]


def cpus(group: dict) -> float:
    return float(group["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"])


def test_one_manifest_of_each_kind():
    assert sorted(load_yaml(p)["kind"] for p in KUBERAY_MANIFESTS) == ["RayCluster", "RayJob", "RayService"]


@pytest.mark.parametrize("path", KUBERAY_MANIFESTS, ids=lambda p: p.name)
def test_has_what_kuberay_requires_for_its_kind(path):
    (doc,) = yaml.safe_load_all(path.read_text())  # one resource per file
    assert doc["apiVersion"] == "ray.io/v1"
    name = doc["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= NAME_LIMIT[doc["kind"]]
    if doc["kind"] == "RayJob":
        assert doc["spec"]["entrypoint"].strip()
    if doc["kind"] == "RayService":
        assert isinstance(doc["spec"]["serveConfigV2"], str)  # KubeRay takes the Serve config as a string
    spec = cluster_spec(doc)
    assert spec["rayVersion"] == ray.__version__
    assert spec["headGroupSpec"]["template"]["spec"]["containers"]
    names = [g["groupName"] for g in spec["workerGroupSpecs"]]
    assert names and len(set(names)) == len(names)
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        assert group["template"]["spec"]["containers"]
    for group in groups(spec):
        # KubeRay refuses resources given both as ray start parameters and as the group's `resources`.
        assert "resources" not in group
        assert "labels" not in group.get("rayStartParams", {})
    for container in containers(spec):
        assert container["image"] == image()


@pytest.mark.parametrize("path", KUBERAY_MANIFESTS, ids=lambda p: p.name)
def test_pod_templates_are_valid_kubernetes(path):
    doc = load_yaml(path)
    for group in groups(cluster_spec(doc)):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                        "template": group["template"]}
        kubernetes_validate.validate(pod_template, KUBERNETES, strict=True)


@pytest.mark.parametrize("path", KUBERAY_MANIFESTS, ids=lambda p: p.name)
def test_gpu_pods_take_whole_h100_nodes(path):
    spec = cluster_spec(load_yaml(path))
    assert "nvidia.com/gpu" not in str(spec["headGroupSpec"])  # a CPU head
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert gpu_groups(spec)
    for group in gpu_groups(spec):
        pod = group["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        assert resources["requests"] == resources["limits"] and gpus(group) == GPUS_PER_NODE
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


@pytest.mark.parametrize("path", KUBERAY_MANIFESTS, ids=lambda p: p.name)
def test_credentials_come_only_from_kubernetes_secrets(path):
    assert not CREDENTIAL.search(path.read_text())
    for container in containers(cluster_spec(load_yaml(path))):
        for env in container.get("env", []):
            if SECRET_ENV.search(env["name"]):
                assert "value" not in env and "secretKeyRef" in env["valueFrom"], env
        assert container["envFrom"] and all(set(e) == {"secretRef"} for e in container["envFrom"])
        assert {"name": "swiftkv-s3"} in [{"name": e["secretRef"]["name"]} for e in container["envFrom"]]


def job_recipe(doc: dict):
    """The distillation recipe a RayJob's entrypoint runs (the image's copy is this checkout's)."""
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "ray_jobs.distill"]
    config = argv[argv.index("--config") + 1]
    assert config.startswith(image_workdir() + "/")
    overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    return recipe(REPO / config.removeprefix(image_workdir() + "/"), overrides)


def test_rayjob_runs_a_gpu_recipe_with_one_worker_per_gpu_and_checkpoints_on_s3():
    doc = manifest("RayJob")
    cfg = job_recipe(doc)
    assert doc["spec"]["shutdownAfterJobFinishes"] is True
    assert cfg.output.storage_path.startswith("s3://")
    (group,) = gpu_groups(cluster_spec(doc))
    assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]  # a fixed-size training cluster
    # GPUs per pod = the recipe's workers per node; pods x GPUs = the recipe's workers.
    assert group["replicas"] * gpus(group) == cfg.scaling.num_workers
    check_recipe_fits(cfg, gpus(group), cpus(group), group["replicas"])


def test_raycluster_autoscales_gpu_pods_up_to_the_largest_recipe():
    spec = cluster_spec(manifest("RayCluster"))
    assert spec["enableInTreeAutoscaling"] is True
    (group,) = gpu_groups(spec)
    assert group["minReplicas"] == 0
    for path in GPU_RECIPES:
        check_recipe_fits(recipe(path), gpus(group), cpus(group), group["maxReplicas"])


def test_rayservice_runs_our_application_on_the_distilled_checkpoint():
    doc = manifest("RayService")
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    (app,) = app_configs(serve_config)
    build_app(app)  # the deployments bind (no Ray needed)
    spec = cluster_spec(doc)
    assert spec["enableInTreeAutoscaling"] is True  # GPU pods follow Serve's replica count
    (group,) = gpu_groups(spec)
    check_serving_fits(app, gpus(group), cpus(group), group["maxReplicas"])
    distilled = job_recipe(manifest("RayJob")).output
    for model in app.models:
        vllm_server_args(model, model.model)  # every engine option is one vLLM knows
        # What the RayJob writes: <storage_path>/<name>/step_XXXXXXXX/model.
        assert re.fullmatch(re.escape(f"{distilled.storage_path}/{distilled.name}/") + r"step_\w{8}/model",
                            model.model), model.model
    # The API key and the object-store keys reach every node from Kubernetes secrets.
    for container in containers(spec):
        (key,) = [e for e in container["env"] if e["name"] == app.api_key_env]
        assert key["valueFrom"]["secretKeyRef"]["name"] == "swiftkv-api-key"


def test_rayservice_probes_check_ray_on_every_pod_and_the_serve_proxy_on_workers():
    doc = manifest("RayService")
    port = yaml.safe_load(doc["spec"]["serveConfigV2"])["http_options"]["port"]
    spec = cluster_spec(doc)
    for container in containers(spec):
        assert container["livenessProbe"]["httpGet"] == {"path": "/api/healthz", "port": 52365}
        assert container["readinessProbe"]["httpGet"]["path"]
    for group in spec["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        assert worker["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": port}
        assert {"containerPort": port, "name": "serve"} in worker["ports"]
