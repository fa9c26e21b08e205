#!/usr/bin/env bash
# The main job on the embedded defaults: install, start a local cluster (tiny model written if
# missing, local Ray, local redis-server, 1 prefill + 1 decode worker, router), send one
# request through the gRPC API, print the streamed answer with TTFT/TPOT and the cluster
# status, then stop everything.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/setup-env.sh
. scripts/setup-env.sh
PROMPT=${PROMPT:-"The lighthouse keeper writes the weather in a thick book: the wind, the waves, the colour of the sky at noon and at dusk. Sailors trust her notes more than the radio. When the fog comes in,"}
trap 'pdserve down >/dev/null 2>&1 || true' EXIT
pdserve up --detach
pdserve generate "$PROMPT" --max-tokens 48
pdserve status
pdserve down
trap - EXIT
