#!/usr/bin/env bash
# See the monitoring kit work in one command: a real Prometheus (Debian package `prometheus`) with
# monitoring/rules.yml scrapes a local 2-process CPU job of shapes-segmentation (torchrun --standalone,
# metrics.port + LOCAL_RANK per rank). Prints the Prometheus URL and example queries, then the live per-rank
# throughput every 10 s; stops Prometheus and removes its data when the job ends (or on Ctrl-C).
#
#   launch/monitor.sh [--set key=value ...]     # extra settings go to `service train`
#   make monitor MONITOR_ARGS="--set train.epochs=5"
#
# Environment: PYTHON (default .venv/bin/python), NPROC (2), PROM_PORT (a free port), RUN_DIR (runs/monitor),
# SCRAPE (1s), LINGER (seconds to keep Prometheus up after the job, for browsing; default 0).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
case "$PY" in /*) ;; *) PY="$REPO/$PY" ;; esac
NPROC="${NPROC:-2}"
RUN_DIR="${RUN_DIR:-$REPO/runs/monitor}"
SCRAPE="${SCRAPE:-1s}"
LINGER="${LINGER:-0}"
PROMETHEUS="$(command -v prometheus || true)"
[ -n "$PROMETHEUS" ] || { echo "prometheus not found: make prometheus (apt-get install prometheus)" >&2; exit 2; }

free_ports() {  # a base port with $1 free ports from it, outside the kernel's ephemeral range
  "$PY" -c 'import sys; from service.rendezvous.ports import listen_ports; print(listen_ports(int(sys.argv[1])))' "$1"
}
PROM_PORT="${PROM_PORT:-$(free_ports 1)}"
BASE="$(free_ports "$NPROC")"
WORK="$(mktemp -d -t ddp-monitor-XXXXXX)"
URL="http://127.0.0.1:$PROM_PORT"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

TARGETS="$("$PY" -c 'import json, sys; b, n = int(sys.argv[1]), int(sys.argv[2]); print(json.dumps([f"127.0.0.1:{b + i}" for i in range(n)]))' "$BASE" "$NPROC")"
sed -e "s|__SCRAPE_INTERVAL__|$SCRAPE|g" -e "s|__RULES__|$REPO/monitoring/rules.yml|" -e "s|__TARGETS__|$TARGETS|" \
  "$REPO/monitoring/prometheus.local.yml" >"$WORK/prometheus.yml"

setsid "$PROMETHEUS" --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/data" \
  --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$WORK/prometheus.log" 2>&1 &
PIDS+=("$!")
for _ in $(seq 100); do
  "$PY" -c "import urllib.request as u; u.urlopen('$URL/-/ready', timeout=1)" 2>/dev/null && break
  sleep 0.2
done

RUN_ID="monitor-$(date +%s)"
echo "Prometheus: $URL   (rules: monitoring/rules.yml; targets: $TARGETS; data in $WORK)"
echo "Job: $NPROC processes, run_id $RUN_ID, run_dir $RUN_DIR, metrics on 127.0.0.1:$BASE + LOCAL_RANK"
cat <<EOF
Example queries (paste into $URL/graph, or curl '$URL/api/v1/query?query=...'):
  sum by (rank) (rate(ddp_train_samples_total[30s]))          samples/s per rank
  job:ddp_train_samples:rate1m                                 job throughput (recording rule)
  rank:ddp_train_step_seconds:p95_1m                           step time p95 per rank
  rank:ddp_train_busy_seconds:relative_to_median               straggler score (alert at 1.5)
  rank:ddp_train_data_wait:ratio_1m                            share of step time waiting on data
  time() - job:ddp_train_checkpoint_last_success:timestamp     checkpoint age
  ALERTS                                                       firing or pending alerts ($URL/alerts)
Grafana: import monitoring/dashboard.json with a Prometheus data source pointing at $URL.
EOF

setsid env OMP_NUM_THREADS=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m torch.distributed.run \
  --standalone --nproc-per-node="$NPROC" --rdzv-id="$RUN_ID" -m service train \
  --set run_dir="$RUN_DIR" --set checkpoint.resume=never --set train.progress_bar=false \
  --set metrics.tensorboard=false --set metrics.port="$BASE" --set train.log_every=5 \
  --set task_options.train_size=4096 --set train.epochs=3 --set checkpoint.every_steps=50 \
  "$@" >"$WORK/job.log" 2>&1 &
JOB=$!
PIDS+=("$JOB")
echo "training (log: $WORK/job.log) ..."

show() {  # one line of live numbers from the HTTP API
  "$PY" - "$URL" <<'EOF' || true
import json, sys, urllib.parse, urllib.request
url = sys.argv[1]
def q(expr):
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5) as r:
        return json.loads(r.read())["data"]["result"]
rates = {r["metric"].get("rank"): float(r["value"][1]) for r in q("sum by (rank) (rate(ddp_train_samples_total[30s]))")}
step = q("max(ddp_train_global_step)")
p95 = q("max(rank:ddp_train_step_seconds:p95_1m)")
print("  step %s  samples/s by rank %s  step p95 %s s" % (
    step[0]["value"][1] if step else "-",
    {k: round(v, 1) for k, v in sorted(rates.items())} or "-",
    round(float(p95[0]["value"][1]), 3) if p95 else "-"))
EOF
}
while kill -0 "$JOB" 2>/dev/null; do
  for _ in $(seq 20); do kill -0 "$JOB" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$JOB" 2>/dev/null && show
done
status=0
wait "$JOB" || status=$?
tail -n 3 "$WORK/job.log"
[ -f "$RUN_DIR/summary.json" ] && echo "summary: $RUN_DIR/summary.json ($(grep -o '"samples_per_second": [0-9.]*' "$RUN_DIR/summary.json"))"
if [ "$LINGER" -gt 0 ]; then echo "Prometheus stays up at $URL for $LINGER s"; sleep "$LINGER"; fi
exit "$status"
