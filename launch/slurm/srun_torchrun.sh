#!/usr/bin/env bash
# One Slurm task per node runs this: torchrun's agent for the node's workers, through `python -m service launch`
# (torchrun that validates the job first and exits 0 completed, 75 preempted, 2 bad input, 1 failed, with no
# traceback), and `python -m service train` in each worker.
#
#   srun --ntasks-per-node=1 launch/slurm/srun_torchrun.sh [wrapper flags] [job.yaml] [--set key=value ...]
#
# Wrapper flags (each also an environment variable; a flag wins). See launch/slurm/README.md.
#   --nproc-per-node N      DDP_NPROC_PER_NODE   workers per node; default SLURM_GPUS_ON_NODE (the GPUs allotted)
#   --rdzv-endpoint H:P     DDP_RDZV_ENDPOINT    an etcd endpoint: etcd3 rendezvous (elastic); default: c10d
#   --rdzv-backend NAME     DDP_RDZV_BACKEND     backend for --rdzv-endpoint (default etcd3)
#   --rdzv-conf K=V,...     DDP_RDZV_CONF        torchrun --rdzv-conf for that backend (TLS, key prefix, ...)
#   --rdzv-host HOST        DDP_RDZV_HOST        c10d: the store's host (default: the first node's NodeAddr)
#   --rdzv-port PORT        DDP_RDZV_PORT        c10d: the store's port (default 15000 + job id % 17000)
#   --rdzv-id ID            DDP_RDZV_ID          default: the job id (array jobs: <array id>_<task id>);
#                                                etcd3 adds .rN on the N-th requeue
#   --nnodes N|MIN:MAX      DDP_NNODES           default SLURM_NNODES
#   --max-restarts N        DDP_MAX_RESTARTS     torchrun --max-restarts (default 0)
#   --shutdown-timeout S    DDP_SHUTDOWN_TIMEOUT seconds a signalled worker gets to checkpoint (default 60)
#   --python PATH           DDP_PYTHON           the interpreter with ddp-service installed (default python3)
#   --                                           ends the wrapper flags; the rest goes to `service train`
set -euo pipefail

die() {
    echo "srun_torchrun.sh: $*" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    flag=$1 value=
    case "$flag" in
        --*=*) value=${flag#*=} flag=${flag%%=*} ;;
        --) shift; break ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    esac
    case "$flag" in
        --nproc-per-node) var=DDP_NPROC_PER_NODE ;;
        --rdzv-endpoint) var=DDP_RDZV_ENDPOINT ;;
        --rdzv-backend) var=DDP_RDZV_BACKEND ;;
        --rdzv-conf) var=DDP_RDZV_CONF ;;
        --rdzv-host) var=DDP_RDZV_HOST ;;
        --rdzv-port) var=DDP_RDZV_PORT ;;
        --rdzv-id) var=DDP_RDZV_ID ;;
        --nnodes) var=DDP_NNODES ;;
        --max-restarts) var=DDP_MAX_RESTARTS ;;
        --shutdown-timeout) var=DDP_SHUTDOWN_TIMEOUT ;;
        --python) var=DDP_PYTHON ;;
        *) break ;;  # the first argument that is not a wrapper flag starts the training arguments
    esac
    if [ "$flag" = "$1" ]; then
        [ $# -ge 2 ] || die "The flag $flag needs a value, as in '$flag VALUE'."
        value=$2
        shift
    fi
    shift
    printf -v "$var" '%s' "$value"
done

for name in SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_NNODES SLURMD_NODENAME SLURM_STEP_ID; do
    [ -n "${!name:-}" ] || die "$name is not set: run this script as an srun task, one per node" \
        "(srun --ntasks-per-node=1 $0 ...), inside an sbatch or salloc allocation; see launch/slurm/train.sbatch."
done
tasks=${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS:-$SLURM_NNODES}}
nodes=${SLURM_STEP_NUM_NODES:-$SLURM_NNODES}
[ "$tasks" = "$nodes" ] || die "This srun step runs $tasks tasks on $nodes nodes, but the wrapper wants one task" \
    "per node (torchrun starts the node's workers itself). Use srun --ntasks-per-node=1."

is_count() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }

if [ -n "${DDP_NPROC_PER_NODE:-}" ]; then
    is_count "$DDP_NPROC_PER_NODE" || die "DDP_NPROC_PER_NODE (--nproc-per-node) is '$DDP_NPROC_PER_NODE';" \
        "set it to the number of worker processes per node, such as 4."
    nproc=$DDP_NPROC_PER_NODE
elif is_count "${SLURM_GPUS_ON_NODE:-}"; then
    nproc=$SLURM_GPUS_ON_NODE
else
    die "No GPUs are allotted on $SLURMD_NODENAME (SLURM_GPUS_ON_NODE is '${SLURM_GPUS_ON_NODE:-}') and" \
        "DDP_NPROC_PER_NODE is not set: ask for GPUs (sbatch --gpus-per-node=N) or set DDP_NPROC_PER_NODE=N" \
        "(or --nproc-per-node N) for N CPU processes per node."
fi

shutdown=${DDP_SHUTDOWN_TIMEOUT:-60}
is_count "$shutdown" || die "DDP_SHUTDOWN_TIMEOUT (--shutdown-timeout) is '$shutdown'; set it to whole seconds," \
    "enough for the rest of a step plus one checkpoint save, and less than the warning time of --signal=USR1@90."
restarts=${DDP_MAX_RESTARTS:-0}
[[ $restarts =~ ^[0-9]+$ ]] || die "DDP_MAX_RESTARTS (--max-restarts) is '$restarts'; set it to 0 or more."
nnodes=${DDP_NNODES:-$SLURM_NNODES}
[[ $nnodes =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "DDP_NNODES (--nnodes) is '$nnodes'; use N or MIN:MAX."

if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
    job=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
else
    job=$SLURM_JOB_ID
fi
rdzv_id=${DDP_RDZV_ID:-$job}

if [ -n "${DDP_RDZV_ENDPOINT:-}" ]; then
    # A requeued attempt must not join the previous attempt's etcd run: that run's keys live on under its
    # lease until it expires, and then vanish under the new agents (RunLostError). Each attempt gets its own.
    if [ -z "${DDP_RDZV_ID:-}" ] && [ "${SLURM_RESTART_COUNT:-0}" != 0 ]; then
        rdzv_id=$job.r$SLURM_RESTART_COUNT
    fi
    rdzv=(--rdzv-backend="${DDP_RDZV_BACKEND:-etcd3}" --rdzv-endpoint="$DDP_RDZV_ENDPOINT")
    [ -z "${DDP_RDZV_CONF:-}" ] || rdzv+=(--rdzv-conf="$DDP_RDZV_CONF")
else
    # c10d: the first node of the step hosts the store; a port from the job id lets jobs share nodes.
    first=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | head -n 1)
    [ -n "$first" ] || die "scontrol show hostnames found no host in '${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}'."
    host=${DDP_RDZV_HOST:-}
    if [ -z "$host" ]; then
        # NodeAddr is the address Slurm itself reaches the node at (often just its name).
        host=$(scontrol show node -o "$first" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
        host=${host:-$first}
    fi
    port=${DDP_RDZV_PORT:-$((15000 + SLURM_JOB_ID % 17000))}
    is_count "$port" && [ "$port" -lt 65536 ] || die "DDP_RDZV_PORT (--rdzv-port) is '$port'; use 1 to 65535."
    is_host=$([ "$SLURMD_NODENAME" = "$first" ] && echo 1 || echo 0)
    rdzv=(--rdzv-backend=c10d --rdzv-endpoint="$host:$port" --rdzv-conf="is_host=$is_host${DDP_RDZV_CONF:+,$DDP_RDZV_CONF}")
fi

# torchrun sets OMP_NUM_THREADS=1 only for two or more processes per node. With one, each worker would use
# every core of its node, and a CPU run's numbers would depend on that count (docs/resume.md): set it the same.
threads_note=
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    export OMP_NUM_THREADS=1
    threads_note=" (set here, as torchrun does for several processes per node; export OMP_NUM_THREADS to choose)"
fi

python=${DDP_PYTHON:-python3}
command -v "$python" >/dev/null || die "DDP_PYTHON (--python) is '$python', which is not a program here;" \
    "set it to the python of the environment that has ddp-service installed, such as \$PWD/.venv/bin/python."

echo "srun_torchrun.sh: $SLURMD_NODENAME: torchrun --nnodes=$nnodes --nproc-per-node=$nproc ${rdzv[*]}" \
    "--rdzv-id=$rdzv_id (job $job, attempt ${SLURM_RESTART_COUNT:-0}), OMP_NUM_THREADS=$OMP_NUM_THREADS$threads_note" >&2
# exec: the step's signals (Slurm's --signal=USR1@90, scancel --signal) go straight to the agent, which hands
# them to its workers; a shell in between would die of SIGUSR1.
exec "$python" -m service launch \
    --nnodes="$nnodes" --nproc-per-node="$nproc" "${rdzv[@]}" --rdzv-id="$rdzv_id" \
    --max-restarts="$restarts" --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --shutdown-timeout="$shutdown" \
    "$@"
