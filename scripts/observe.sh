#!/usr/bin/env bash
# Watch a running `pdserve up`: start Prometheus scraping its routers and its controller, with
# pdserve's recording and alerting rules, and Grafana with the pdserve dashboard where
# `grafana-server` (or `grafana`) is installed. Runs until Ctrl-C, then stops what it started.
#
#   scripts/observe.sh [--config-only]
#
#   OBSERVE_DIR           where configs, the TSDB and Grafana's data go (default
#                         ~/.cache/pdserve/observe)
#   PROMETHEUS_PORT       Prometheus on 127.0.0.1 (default 9090)
#   GRAFANA_PORT          Grafana on 127.0.0.1 (default 3000; anonymous viewers, admin/admin)
#   GRAFANA_HOME          Grafana's homepath (default /usr/share/grafana)
#   SCRAPE_INTERVAL       default 5s
#   --config-only         write prometheus.yml (and Grafana's provisioning), print it, exit
#
# The targets are read once, at start: after a `pdserve up` again (or a restarted controller,
# which serves on a new port) run this again. Prometheus comes from Debian's `prometheus`
# package (scripts/setup-env.sh installs it as root); Grafana is not packaged in Debian.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DIR=${OBSERVE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/observe}
PROM_PORT=${PROMETHEUS_PORT:-9090}
GRAFANA_PORT=${GRAFANA_PORT:-3000}
GRAFANA_HOME=${GRAFANA_HOME:-/usr/share/grafana}
INTERVAL=${SCRAPE_INTERVAL:-5s}
CONFIG_ONLY=0
[ "${1:-}" = "--config-only" ] && CONFIG_ONLY=1
PYTHON=python3
[ -x "$REPO/.venv/bin/python" ] && PYTHON="$REPO/.venv/bin/python"

mkdir -p "$DIR"
echo "[observe] reading the cluster's metrics endpoints"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" scripts/observe_config.py \
  "$DIR/prometheus.yml" --scrape-interval "$INTERVAL"

# Grafana's provisioning: the repository's files, with the datasource URL and the
# dashboards folder filled in through the environment (Grafana expands ${VAR} in them).
GRAFANA=""
if command -v grafana-server >/dev/null 2>&1; then
  GRAFANA="grafana-server"
elif command -v grafana >/dev/null 2>&1; then
  GRAFANA="grafana server"
fi
prov="$DIR/grafana/provisioning"
mkdir -p "$prov/datasources" "$prov/dashboards" "$prov/plugins" "$prov/alerting" \
  "$DIR/grafana/data" "$DIR/grafana/logs"
cp deploy/observability/grafana/provisioning/datasources/pdserve.yml "$prov/datasources/"
cp deploy/observability/grafana/provisioning/dashboards/pdserve.yml "$prov/dashboards/"
cat >"$DIR/grafana/grafana.ini" <<EOF
[paths]
data = $DIR/grafana/data
logs = $DIR/grafana/logs
plugins = $DIR/grafana/data/plugins
provisioning = $prov
[server]
http_addr = 127.0.0.1
http_port = $GRAFANA_PORT
[auth.anonymous]
enabled = true
org_role = Viewer
[analytics]
reporting_enabled = false
check_for_updates = false
[dashboards]
default_home_dashboard_path = $REPO/deploy/observability/grafana/pdserve.json
EOF

if [ "$CONFIG_ONLY" = 1 ]; then
  cat "$DIR/prometheus.yml"
  echo "[observe] wrote $DIR/prometheus.yml and $DIR/grafana/"
  exit 0
fi

if ! command -v prometheus >/dev/null 2>&1; then
  echo "[observe] prometheus is not installed (apt-get install prometheus)" >&2
  exit 1
fi
pids=()
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT TERM

prometheus --config.file="$DIR/prometheus.yml" --storage.tsdb.path="$DIR/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$DIR/prometheus.log" 2>&1 &
pids+=($!)
echo "[observe] Prometheus  http://127.0.0.1:$PROM_PORT  (alerts: /alerts; log $DIR/prometheus.log)"

if [ -n "$GRAFANA" ]; then
  PDSERVE_PROMETHEUS_URL="http://127.0.0.1:$PROM_PORT" \
  PDSERVE_DASHBOARDS_DIR="$REPO/deploy/observability/grafana" \
    $GRAFANA --homepath "$GRAFANA_HOME" --config "$DIR/grafana/grafana.ini" \
    >"$DIR/grafana/grafana.out" 2>&1 &
  pids+=($!)
  echo "[observe] Grafana     http://127.0.0.1:$GRAFANA_PORT/d/pdserve-overview  (log $DIR/grafana/grafana.out)"
else
  echo "[observe] no grafana-server here: import deploy/observability/grafana/pdserve.json into a Grafana"
  echo "          whose Prometheus datasource points at http://127.0.0.1:$PROM_PORT"
fi
echo "[observe] Ctrl-C stops them"
wait -n "${pids[@]}" || true
echo "[observe] a process exited; stopping" >&2
