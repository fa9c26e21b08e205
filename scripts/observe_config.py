"""Write a Prometheus config that scrapes the running `pdserve up` (used by scripts/observe.sh).

The targets: every router's metrics endpoint (from the cluster's state file, as `pdserve up`
wrote it) and the controller's (asked of the controller actor over Ray: it serves on a free
port of its node). Jobs are named `pdserve-router` and `pdserve-controller`, which the
`PdserveMetricsDown` alert of deploy/observability/prometheus/pdserve.rules.yml matches.

    python scripts/observe_config.py OUT.yml [--rules FILE] [--scrape-interval 5s]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.parse
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[1] / "deploy/observability/prometheus/pdserve.rules.yml"


def controller_metrics_url(ray_address: str, external: bool, cluster_name: str) -> str:
    """The controller's metrics URL ("" when it cannot be asked; the reason goes to stderr)."""
    if not external:
        from deploy.control.local_ray import loopback_env

        loopback_env()  # a local Ray of `pdserve up` listens on loopback only
    import ray

    from deploy.control.cluster_controller import CONTROLLER_NAME

    try:
        ray.init(
            address=ray_address, namespace=cluster_name, log_to_driver=False,
            logging_level=logging.WARNING,
        )  # fmt: skip
        controller = ray.get_actor(CONTROLLER_NAME, namespace=cluster_name)
        return str(ray.get(controller.metrics_url.remote(), timeout=30))
    except Exception as e:
        print(f"observe: controller metrics unknown ({type(e).__name__}: {e})", file=sys.stderr)
        return ""
    finally:
        if ray.is_initialized():
            ray.shutdown()


def scrape_config(job: str, urls: list[str]) -> dict[str, object]:
    parts = [urllib.parse.urlsplit(u) for u in urls]
    return {
        "job_name": job,
        "metrics_path": parts[0].path or "/metrics",
        "static_configs": [{"targets": [p.netloc for p in parts]}],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="prometheus.yml to write")
    parser.add_argument("--rules", type=Path, default=RULES)
    parser.add_argument("--scrape-interval", default="5s")
    args = parser.parse_args()

    from deploy.cli.daemon import read_state

    state = read_state()
    if state is None:
        print("observe: no cluster is running (`pdserve up` starts one)", file=sys.stderr)
        return 1
    jobs = {"pdserve-router": list(state.metrics)}
    if not jobs["pdserve-router"]:
        print("observe: the routers serve no metrics (metrics_port: null)", file=sys.stderr)
    if state.ray_address:
        url = controller_metrics_url(state.ray_address, state.ray_external, state.cluster_name)
        if url:
            jobs["pdserve-controller"] = [url]
    config = {
        "global": {
            "scrape_interval": args.scrape_interval,
            "evaluation_interval": args.scrape_interval,
        },
        "rule_files": [str(args.rules.resolve())],
        "scrape_configs": [scrape_config(job, urls) for job, urls in jobs.items() if urls],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(yaml.safe_dump(config, sort_keys=False))
    print(json.dumps(jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
