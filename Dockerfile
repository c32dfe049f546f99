# syntax=docker/dockerfile:1
# The ddp-service training image: `ddp-service launch` (under dumb-init) runs the job (k8s/README.md).
#
# The base is the CUDA PyTorch image whose torch is the one the test suite runs (2.13): the same tag that
# Kubeflow Trainer's own torch-distributed runtime uses. Pinned by tag; pin it by digest too once your
# registry mirror has it (`docker buildx imagetools inspect` prints the digest). CUDA images also run on
# CPU nodes (the k8s/overlays/cpu overlay), so one image serves both overlays.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

# -- build: only a wheel of this package (no compiler, no source tree in the final image) -----------------
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- runtime ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ddp-service" \
      org.opencontainers.image.description="Elastic multi-node PyTorch DDP training: exact resume, etcd v3 rendezvous, per-rank Prometheus metrics." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.base.name="pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime" \
      org.opencontainers.image.documentation="k8s/README.md"

# The package and its dependencies (torch comes from the base and satisfies torch>=2.4, so pip keeps it);
# dumb-init (a PyPI wheel with the static binary) as PID 1. The build fails if the base's torch is not 2.13.
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir /wheels/*.whl dumb-init==1.2.5.post1 \
    && rm -rf /wheels \
    && python -c "import sys, torch; sys.exit(0 if torch.__version__.startswith('2.13.') else 'torch ' + torch.__version__ + ' is not 2.13')"

# A non-root user with a fixed numeric id, so Kubernetes' runAsNonRoot can check it.
RUN useradd --no-log-init --create-home --uid 10001 --user-group ddp \
    && install -d -o 10001 -g 10001 /workspace
WORKDIR /workspace
USER 10001:10001

# Unbuffered logs; no .pyc writes (the root filesystem is read-only on Kubernetes); caches under /tmp,
# which the pod mounts as an emptyDir.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_CACHE_HOME=/tmp/.cache

# No HEALTHCHECK: this is a batch job, not a server. Kubernetes ignores Docker's HEALTHCHECK anyway, and a
# probe that restarts one member of a running world costs every member a restart. Progress is watched from
# outside, by the stall and straggler alerts on the per-rank metrics (monitoring/rules.yml).
HEALTHCHECK NONE

# The kubelet's SIGTERM goes to PID 1 = dumb-init, which forwards it to `ddp-service launch` only
# (--single-child) and reaps orphans. launch runs torchrun's agent in its own process and handles SIGTERM from
# its first moment; the agent sends it on to the workers, which save a checkpoint and exit 75, and SIGKILLs them
# after --shutdown-timeout. launch then exits 75 (preempted), 0 (completed), 2 (bad input) or 1 (failed), and
# dumb-init with it: the pod's exit code says how the job ended (k8s/README.md, "Exit codes"). A bare torchrun
# would exit 1 on a preemption, and as PID 1 would miss a SIGTERM before its agent installs its handlers.
STOPSIGNAL SIGTERM
ENTRYPOINT ["dumb-init", "--single-child", "--", "ddp-service", "launch"]
# `docker run IMAGE` trains the built-in demo on one process; Kubernetes passes its own options and job file.
CMD ["--nproc-per-node=1"]
