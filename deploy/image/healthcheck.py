#!/usr/bin/env python3
"""The image's HEALTHCHECK: healthy when the router's HTTP door says it can serve.

GET $PDSERVE_HEALTH_URL (default http://127.0.0.1:8000/ready: 200 while a decode worker is
registered) within $PDSERVE_HEALTH_TIMEOUT_S seconds (default 4). /health and /ready need no API
key. Exit 0 healthy, 1 not (the reason on stderr), as podman and Docker read it. Kubernetes
ignores an image's HEALTHCHECK; under KubeRay the pods keep KubeRay's own Ray probes (a
readiness probe on the router would hold the head pod unready until the RayJob that starts
the router runs, which KubeRay submits only to a ready cluster), and
`kubectl exec HEAD -- pdserve-healthcheck` asks the router. Standard library only.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    url = os.environ.get("PDSERVE_HEALTH_URL", "http://127.0.0.1:8000/ready")
    timeout = float(os.environ.get("PDSERVE_HEALTH_TIMEOUT_S", "4"))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            body = reply.read(512).decode(errors="replace")
    except urllib.error.HTTPError as e:
        print(f"pdserve-healthcheck: {url} answered {e.code}: "
              f"{e.read(512).decode(errors='replace')}", file=sys.stderr)  # fmt: skip
        return 1
    except (OSError, ValueError) as e:
        print(f"pdserve-healthcheck: {url} did not answer: {e}", file=sys.stderr)
        return 1
    print(f"pdserve-healthcheck: {url}: {body}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
