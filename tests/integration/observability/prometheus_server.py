"""A real Prometheus server for the observability tests (Debian's `prometheus` package).

`PrometheusServer` writes a config that scrapes the given targets every second and loads the
repository's rules, starts `prometheus` on a free loopback port with its TSDB in a temp folder,
and answers PromQL through the HTTP API (`query`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
OBSERVABILITY = REPO / "deploy" / "observability"
RULES = OBSERVABILITY / "prometheus" / "pdserve.rules.yml"
DASHBOARD = OBSERVABILITY / "grafana" / "pdserve.json"


def require_prometheus() -> str:
    """The `prometheus` binary; skips when it is missing outside CI (in CI,
    scripts/setup-env.sh installs it, so a missing one fails)."""
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (scripts/setup-env.sh installs it in CI)")
        pytest.skip("needs Debian's prometheus package (apt-get install prometheus)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_port(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


class PrometheusServer:
    """One Prometheus scraping `jobs` ({job name: [metrics URL, ...]}) every second."""

    def __init__(self, binary: str, workdir: Path, jobs: dict[str, list[str]]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(_config(jobs)))
        self.log = workdir / "prometheus.log"
        self._log = self.log.open("wb")
        self._proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready(timeout_s=30)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout_s}s: {self.log.read_text()}")

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to now (a scalar answers as one sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def finite(self, expr: str) -> list[dict[str, Any]]:
        """The samples of `expr` with a finite value (NaN and ±Inf show as no data)."""
        return [s for s in self.query(expr) if math.isfinite(float(s["value"][1]))]

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._log.close()


def _config(jobs: dict[str, list[str]]) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [host_port(u) for u in urls]}],
            }
            for job, urls in jobs.items()
        ],
    }


@dataclass(frozen=True)
class Observed:
    """A live cluster watched by Prometheus (the observability tests' `observed` fixture)."""

    prometheus: PrometheusServer
    target: str
    router_metrics_urls: tuple[str, ...]
    controller_metrics_url: str
    ray_address: str
    ok_requests: int
