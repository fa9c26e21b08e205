"""The shipped cluster configs: the Ray cluster launcher YAML passes Ray's own config validation,
the pdserve configs in them parse with `pdserve up`'s parser, and the custom resources the
workers ask for are the ones the node groups advertise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.cli.options import config_input, effective_config

CONFIGS = Path(__file__).parents[3] / "deploy" / "configs"


def options(config: dict[str, Any]) -> Any:
    return effective_config(config_input(config, {}))


def kuberay_docs() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((CONFIGS / "kuberay.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def ray_start_resources(params: dict[str, str]) -> dict[str, float]:
    """KubeRay's rayStartParams `resources`: a JSON object quoted once more for the shell."""
    return dict(json.loads(json.loads(params["resources"])))


def test_ray_cluster_launcher_config_passes_rays_validation() -> None:
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load((CONFIGS / "ray-cluster.yaml").read_text())
    validate_config(config)
    types = config["available_node_types"]
    assert types["prefill-gpu"]["resources"]["prefill"] == types["prefill-gpu"]["resources"]["GPU"]
    assert types["decode-gpu"]["resources"]["decode"] == types["decode-gpu"]["resources"]["GPU"]


def test_gpu_pdserve_config_asks_for_what_the_launcher_node_types_have() -> None:
    cluster = yaml.safe_load((CONFIGS / "ray-cluster.yaml").read_text())
    cfg = options(yaml.safe_load((CONFIGS / "pdserve-gpu.yaml").read_text()))
    types = cluster["available_node_types"]
    placement = cfg.workers.placement
    assert placement.prefill.num_gpus == 1
    assert dict(placement.prefill.resources) == {"prefill": 1.0}
    assert dict(placement.decode.resources) == {"decode": 1.0}
    assert "prefill" in types["prefill-gpu"]["resources"]
    assert "decode" in types["decode-gpu"]["resources"]
    (router_resource,) = dict(cfg.cluster.router_resources)
    assert router_resource in types[cluster["head_node_type"]]["resources"]
    assert cfg.workers.planner.enabled and cfg.workers.planner.request_resources
    assert cfg.router.host == "0.0.0.0"


def test_kuberay_example_is_consistent_with_its_pdserve_config() -> None:
    docs = kuberay_docs()
    assert set(docs) == {"ConfigMap", "RayCluster", "RayJob", "Service"}
    cfg = options(yaml.safe_load(docs["ConfigMap"]["data"]["pdserve.yaml"]))
    cluster = docs["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["spec"]["enableInTreeAutoscaling"]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    assert ray_start_resources(groups["prefill"]["rayStartParams"]) == {"prefill": 1}
    assert ray_start_resources(groups["decode"]["rayStartParams"]) == {"decode": 1}
    placements = cfg.workers.placement
    for role, placement in (("prefill", placements.prefill), ("decode", placements.decode)):
        assert dict(placement.resources) == {role: 1.0}
        group = groups[role]
        assert float(group["rayStartParams"]["num-gpus"]) >= placement.num_gpus
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    head = cluster["spec"]["headGroupSpec"]
    (router_resource,) = dict(cfg.cluster.router_resources)
    assert router_resource in ray_start_resources(head["rayStartParams"])
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {cfg.router.grpc_port, cfg.router.metrics_port} <= ports
    job = docs["RayJob"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert (
        "pdserve up --address auto --config /etc/pdserve/pdserve.yaml" in job["spec"]["entrypoint"]
    )
    service = docs["Service"]
    assert service["spec"]["selector"] == {
        "ray.io/cluster": cluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }


@pytest.mark.parametrize("name", ["ray-cluster.yaml", "kuberay.yaml"])
def test_cluster_configs_say_they_are_unvalidated_examples(name: str) -> None:
    head = " ".join((CONFIGS / name).read_text()[:1500].lower().split())
    assert "an example, not validated against a live" in head.replace("# ", "")


def test_configs_beyond_loopback_name_a_keys_file_and_keep_the_admin_plane_on_loopback() -> None:
    from deploy.control.security import Access, exposure_refusal, is_loopback
    from router.auth import ApiKey

    docs = kuberay_docs()
    trees = [
        options(yaml.safe_load((CONFIGS / "pdserve-gpu.yaml").read_text())),
        options(yaml.safe_load(docs["ConfigMap"]["data"]["pdserve.yaml"])),
    ]
    for cfg in trees:
        assert not is_loopback(cfg.router.host)
        assert cfg.cluster.api_keys_file and not cfg.cluster.insecure
        assert is_loopback(cfg.router.admin_host)
        assert exposure_refusal(cfg, Access()) is not None  # without keys: refused
        assert exposure_refusal(cfg, Access((ApiKey("0" * 64, "t"),), "k" * 20)) is None
    head = docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    key_path = trees[1].cluster.api_keys_file
    assert key_path is not None and key_path.startswith(mounts["pdserve-keys"] + "/")
    launcher = yaml.safe_load((CONFIGS / "ray-cluster.yaml").read_text())
    (start,) = [c for c in launcher["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in start
