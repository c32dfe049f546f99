"""The image and the Kubernetes pods, run on this machine as the container runtime would run them.

- The Dockerfile's ENTRYPOINT + CMD, ENV and WORKDIR: the demo runs to completion; SIGTERM to PID 1's
  stand-in (dumb-init) reaches `ddp-service launch`, its agent and its workers, which checkpoint and stop: the
  container exits 75 (preempted).
- The elastic PyTorchJob: two "pods" (2 workers each) from the rendered cpu overlay, with the env the
  training operator adds for 2 Worker replicas, against the etcd StatefulSet's 3 pods (also run from the
  rendered manifest: TLS for clients and peers, compaction, quota) with a password user and an HMAC key, all
  mounted as files. The pod of rank 0 is killed mid-run; the other finishes as a world of 2.
- The TrainJob: two "pods" with the PET_* env Trainer's torch plugin injects, and a wrong pod-level RANK.

Real processes, tiny jobs; see tests/k8s_support.py for how a pod is started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_support import ImageConfig, LocalPod, dockerfile_config, find, pod_templates, render
from procs import kill_tree
from rendezvous.agents import SAVED_LINE, STEP_LINE
from rendezvous.conftest import _make_ca, _make_leaf, etcdctl, free_port, require_etcd, require_openssl

pytestmark = pytest.mark.e2e

# A tiny job on top of the manifests' args, as one would append `--set`s to a pod's command. logging.all_ranks:
# each pod's log holds its own ranks' step lines (which ranks a pod runs is what some tests check).
TINY = [
    f"--set={item}"
    for item in (
        "task_options.train_size=1024", "task_options.eval_size=32", "task_options.image_size=32",
        "task_options.width=8", "train.global_batch_size=64", "train.epochs=1000", "data.num_workers=0",
        "train.log_every=1", "metrics.port=auto", "metrics.tensorboard=false", "logging.all_ranks=true",
    )
]  # fmt: skip
USER, PASSWORD, HMAC = "ddp", "pw-" + os.urandom(8).hex(), "hmac-key-" + os.urandom(12).hex()


def wait_exit(pod: LocalPod, timeout: float) -> int:
    assert pod.proc is not None
    try:
        return pod.proc.wait(timeout=timeout)
    except Exception:
        kill_tree(pod.proc.pid)
        raise AssertionError(f"pod {pod.name} ran past {timeout} s:\n{pod.log()[-4000:]}") from None


def wait_for(pod: LocalPod, pattern: str, timeout: float) -> re.Match:
    deadline, regex = time.monotonic() + timeout, re.compile(pattern, re.M)
    while time.monotonic() < deadline:
        match = regex.search(pod.log())
        if match:
            return match
        if pod.proc is not None and pod.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no /{pattern}/ from pod {pod.name}:\n{pod.log()[-4000:]}")


@pytest.fixture
def pods() -> Iterator[list[LocalPod]]:
    started: list[LocalPod] = []
    yield started
    for pod in started:
        if pod.proc is not None:
            kill_tree(pod.proc.pid)
            pod.proc.wait(timeout=10)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# -- the image ------------------------------------------------------------------------------------------------


def image_pod(tmp_path: Path, extra: list[str]) -> LocalPod:
    """The container `docker run IMAGE [args]` starts: ENTRYPOINT + CMD (+ args), ENV, in WORKDIR."""
    image = dockerfile_config()
    workdir = tmp_path / "workspace"
    container = {"name": "ddp-service", "args": [*image.cmd, *extra]}
    return LocalPod("image", container, image, {}, {}, {image.workdir: workdir}, {}, workdir)


def test_the_images_command_trains_the_demo_to_completion(tmp_path: Path, pods: list[LocalPod]) -> None:
    pod = image_pod(tmp_path, [])
    entrypoint = ["dumb-init", "--single-child", "--", "ddp-service", "launch"]
    assert pod.argv()[: len(dockerfile_config().entrypoint)] == entrypoint
    pods.append(pod)
    pod.start(tmp_path / "image.log")
    assert wait_exit(pod, 180) == 0, pod.log()[-4000:]
    result = summary(tmp_path / "workspace" / "runs" / "demo")  # the demo's run_dir, relative to WORKDIR
    assert result["status"] == "completed" and result["world_size"] == 1, result


def test_sigterm_to_the_images_pid1_checkpoints_and_stops_within_the_shutdown_timeout(
    tmp_path: Path, pods: list[LocalPod]
) -> None:
    pod = image_pod(tmp_path, [*TINY, "--set", "run_dir=run", "--set", "train.max_steps=100000"])
    pods.append(pod)
    pod.start(tmp_path / "image.log")
    wait_for(pod, r"\[rank 0\] INFO step 3/", 120)
    signalled = time.monotonic()
    assert pod.proc is not None
    os.kill(pod.proc.pid, signal.SIGTERM)  # what the kubelet sends to PID 1 (STOPSIGNAL SIGTERM)
    code = wait_exit(pod, 60)
    took = time.monotonic() - signalled
    result = summary(tmp_path / "workspace" / "run")
    assert result["status"] == "preempted", result
    saved = [int(s) for s in SAVED_LINE.findall(pod.log())]
    assert saved and saved[-1] == result["global_step"], (saved, result["global_step"])
    # Issue 24: torchrun as the entrypoint exited 1 here, which the operators' exit-code policies read as a failure.
    assert code == 75, pod.log()[-4000:]  # preempted, as `ddp-service launch` says everywhere (k8s/README.md)
    assert "launch: exit 75 (preempted" in pod.log()
    print(f"SIGTERM to exit: {took:.2f} s (torchrun's default --shutdown-timeout: 30 s), exit code {code}")
    # The save itself fit in torchrun's 30 s (else its SIGKILL would have left no "preempted" summary); the
    # whole exit, agent teardown included, must fit in the pod's grace period with room to spare.
    assert took < 60


# -- the elastic PyTorchJob -------------------------------------------------------------------------------------


ETCD_PODS = {"ddp-etcd-0": "127.0.0.11", "ddp-etcd-1": "127.0.0.12", "ddp-etcd-2": "127.0.0.13"}
NAMESPACE = "default"


def etcd_pki(workdir: Path) -> dict[str, dict[str, Path]]:
    """The two TLS Secrets' files: members (server and peer, naming the pods' addresses) and the job's client."""
    openssl = require_openssl()
    workdir.mkdir(parents=True)
    ca = _make_ca(openssl, workdir, "ca")
    # etcd checks a peer's client certificate against the address it connects from (on a cluster: the pod IP,
    # reverse-resolved to ddp-etcd-N.ddp-etcd.<ns>.svc.cluster.local; here: 127.0.0.1, loopback's source).
    sans = ",".join(f"IP:{ip}" for ip in [*ETCD_PODS.values(), "127.0.0.1"])
    member = _make_leaf(openssl, workdir, "member", ca, 11,
                        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n")  # fmt: skip
    client = _make_leaf(openssl, workdir, "client", ca, 12, "extendedKeyUsage=clientAuth\n")
    return {"ddp-etcd-server-tls": {"ca.crt": ca[0], "tls.crt": member[0], "tls.key": member[1]},
            "ddp-etcd-client-tls": {"ca.crt": ca[0], "tls.crt": client[0], "tls.key": client[1]}}  # fmt: skip


def secret_dir(root: Path, name: str, files: dict[str, Path | str]) -> Path:
    """A Secret volume: one file per key, mode 0440."""
    (root / name).mkdir(parents=True)
    for key, source in files.items():
        target = root / name / key
        if isinstance(source, Path):
            shutil.copy(source, target)
        else:
            target.write_text(source + "\n")
        target.chmod(0o440)
    return root / name


@pytest.fixture
def statefulset_etcd(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The etcd StatefulSet's 3 pods, run from the rendered manifest on 127.0.0.11-13; auth on as documented.

    Yields the client endpoint of member 0 (what the ddp-etcd-client Service leads to) and the trainer pods'
    Secrets directory.
    """
    etcd_binary = require_etcd()
    (container,) = find(render("cpu"), "StatefulSet", "ddp-etcd")["spec"]["template"]["spec"]["containers"]
    pki = etcd_pki(tmp_path / "pki")
    secrets = tmp_path / "secrets"
    server_tls = secret_dir(secrets, "etcd-server-tls", dict(pki["ddp-etcd-server-tls"]))
    members: list[LocalPod] = []
    try:
        for pod_name, address in ETCD_PODS.items():
            hosts = {f"{p}.ddp-etcd.{NAMESPACE}.svc": ip for p, ip in ETCD_PODS.items()}
            hosts["0.0.0.0"] = address  # the pod's own interfaces
            mounts = {"/var/lib/etcd": tmp_path / pod_name / "data", "/etc/etcd/tls": server_tls}
            assert set(mounts) == {m["mountPath"] for m in container["volumeMounts"]}
            fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE}
            no_image = ImageConfig([], [], {}, "/", None)  # the container names its command
            pod = LocalPod(pod_name, container, no_image, fields, {}, mounts, hosts, tmp_path / pod_name)
            assert pod.argv()[0] == "etcd" and Path(shutil.which("etcd", path=pod.env()["PATH"]) or "").samefile(
                etcd_binary
            )
            members.append(pod)
            pod.start(tmp_path / f"{pod_name}.log")
        endpoint = f"{ETCD_PODS['ddp-etcd-0']}:2379"
        client = pki["ddp-etcd-client-tls"]
        flags = [f"--cacert={client['ca.crt']}", f"--cert={client['tls.crt']}", f"--key={client['tls.key']}"]
        deadline = time.monotonic() + 60
        while True:
            try:
                etcdctl(endpoint, *flags, "endpoint", "health", "--cluster", timeout=10)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise AssertionError("\n".join(m.log()[-2000:] for m in members)) from None
                time.sleep(0.5)
        # The quota flag is in force: etcd reports it on the metrics listener the probes use.
        metrics = urllib.request.urlopen(f"http://{ETCD_PODS['ddp-etcd-0']}:2381/metrics", timeout=10).read()
        assert re.search(rb"^etcd_server_quota_backend_bytes 2\.147483648e\+09$", metrics, re.M), "quota"
        for command in (["user", "add", "root", f"--new-user-password=root-{os.urandom(4).hex()}"],
                        ["role", "add", "ddp-role"],
                        ["role", "grant-permission", "ddp-role", "--prefix=true", "readwrite", "/torchelastic/etcd3/"],
                        ["user", "add", USER, f"--new-user-password={PASSWORD}"],
                        ["user", "grant-role", USER, "ddp-role"],
                        ["auth", "enable"]):  # fmt: skip
            etcdctl(endpoint, *flags, *command)
        secret_dir(secrets, "etcd-tls", dict(client))
        secret_dir(secrets, "etcd-auth", {"password": PASSWORD})
        secret_dir(secrets, "rdzv-hmac", {"secret": HMAC})
        yield endpoint, secrets
    finally:
        for member in members:
            if member.proc is not None:
                kill_tree(member.proc.pid)
                member.proc.wait(timeout=10)


def operator_env_v1(job: dict) -> dict[str, str]:
    """What the training operator (release-1.9, envvar.go and elastic.go) adds for a Worker-only elastic job."""
    policy = job["spec"]["elasticPolicy"]
    env = {"PYTHONUNBUFFERED": "0",
           "PET_RDZV_ENDPOINT": f"{policy['rdzvHost']}:{policy['rdzvPort']}",
           "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
           "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}"}  # fmt: skip
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    assert "Master" not in job["spec"]["pytorchReplicaSpecs"]  # else also MASTER_ADDR, RANK, WORLD_SIZE ...
    return env


def test_elastic_pytorchjob_pods_survive_losing_the_pod_of_rank_0(
    tmp_path: Path, statefulset_etcd: tuple[str, Path], pods: list[LocalPod]
) -> None:
    etcd_endpoint, secrets = statefulset_etcd
    docs = render("cpu")
    job = find(docs, "PyTorchJob", "ddp-elastic")
    ((_, template),) = pod_templates(job)
    (container,) = template["spec"]["containers"]
    config = tmp_path / "configmap"
    config.mkdir()
    for key, value in find(docs, "ConfigMap", "ddp-service-job")["data"].items():
        (config / key).write_text(value)
    name = job["metadata"]["name"]
    max_steps = 30
    for index, address in enumerate(("127.0.0.2", "127.0.0.3")):
        pod_name = f"{name}-worker-{index}"
        mounts = {"/etc/ddp-service/config": config, "/etc/ddp-service/etcd-tls": secrets / "etcd-tls",
                  "/etc/ddp-service/etcd-auth": secrets / "etcd-auth",
                  "/etc/ddp-service/rdzv-hmac": secrets / "rdzv-hmac", "/data": tmp_path / "pvc",
                  "/tmp": tmp_path / pod_name / "tmp", "/dev/shm": Path("/dev/shm")}  # fmt: skip
        assert set(mounts) == {m["mountPath"] for m in container["volumeMounts"]}
        mounts["/tmp"].mkdir(parents=True)
        fields = {"metadata.labels['training.kubeflow.org/job-name']": name, "status.podIP": address,
                  "metadata.name": pod_name}  # fmt: skip
        tiny = [*TINY, "--set", f"train.max_steps={max_steps}", "--set", "checkpoint.every_steps=5"]
        pod = LocalPod(pod_name, container, dockerfile_config(), fields, operator_env_v1(job), mounts,
                       {"ddp-etcd-client:2379": etcd_endpoint}, tmp_path / pod_name / "workspace", tiny)  # fmt: skip
        pods.append(pod)
    a, b = pods
    argv = a.argv()
    assert "--rdzv-backend=etcd3" in argv and a.env()["PET_RDZV_BACKEND"] == "c10d"  # the flag must win
    assert f"--rdzv-endpoint={etcd_endpoint}" in argv and "--local-addr=127.0.0.2" in argv
    assert f"--rdzv-id={name}" in argv
    for pod in pods:
        pod.start(tmp_path / f"{pod.name}.log")
    for pod in pods:
        wait_for(pod, r"\[rank [0-3]\] INFO step 2/", 150)
    assert {r for pod in pods for r in re.findall(r"\[rank (\d)\] INFO step", pod.log())} == {"0", "1", "2", "3"}
    victim = a if "[rank 0]" in a.log() else b
    survivor = b if victim is a else a
    wait_for(victim, r"\[rank 0\] INFO checkpoint saved: \S*step-00000005\.pt", 60)
    wait_for(victim, r"\[rank 0\] INFO step 7/", 60)
    assert victim.proc is not None
    killed_at = time.time()
    kill_tree(victim.proc.pid)  # the node of rank 0 is lost: agent and workers gone at once
    assert wait_exit(survivor, 150) == 0, survivor.log()[-4000:]
    result = summary(tmp_path / "pvc" / "runs" / name)
    assert result["status"] == "completed" and result["world_size"] == 2, result
    assert result["global_step"] == max_steps and result["restarts"] >= 1, result
    assert result["resumed_from"] is not None and result["resumed_from"]["step"] >= 5, result
    assert (result["global_batch_size"], result["grad_accum"]) == (64, 2), result
    after = [int(step) for ts, rank, step in STEP_LINE.findall(survivor.log()) if rank == "0"]
    print(f"elastic: rank-0 pod killed at step >= 7, survivor resumed from step {result['resumed_from']['step']} "
          f"and finished {after[-1]} steps; {time.time() - killed_at:.1f} s from the kill to the end")  # fmt: skip


# -- the TrainJob ---------------------------------------------------------------------------------------------


def test_trainjob_pods_use_pet_node_rank_and_master_addr_not_the_pod_rank(tmp_path: Path, pods: list[LocalPod]) -> None:
    docs = render("cpu")
    runtime, train_job = find(docs, "TrainingRuntime", "ddp-service-fixed"), find(docs, "TrainJob", "ddp-fixed")
    ((_, template),) = pod_templates(runtime)
    (container,) = template["spec"]["containers"]
    config = tmp_path / "configmap"
    config.mkdir()
    (config / "job.yaml").write_text(find(docs, "ConfigMap", "ddp-service-job")["data"]["job.yaml"])
    name = train_job["metadata"]["name"]
    nodes, nproc = train_job["spec"]["trainer"]["numNodes"], train_job["spec"]["trainer"]["numProcPerNode"]
    assert (nodes, nproc) == (2, 2)
    master_port = free_port()  # Trainer's is 29400; other tests share this machine
    master_host = f"{name}-node-0-0.{name}"
    for node_rank in range(nodes):
        pod_name = f"{name}-node-0-{node_rank}"
        mounts = {"/etc/ddp-service/config": config, "/data": tmp_path / "pvc", "/tmp": tmp_path / pod_name / "tmp",
                  "/dev/shm": Path("/dev/shm")}  # fmt: skip
        assert set(mounts) == {m["mountPath"] for m in container["volumeMounts"]}
        mounts["/tmp"].mkdir(parents=True)
        trainer_env = {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(node_rank),
                       "PET_MASTER_ADDR": master_host, "PET_MASTER_PORT": str(master_port),
                       # A pod-level RANK that would be wrong as any process rank: nothing may read it.
                       "RANK": "7", "WORLD_SIZE": "3"}  # fmt: skip
        pod = LocalPod(pod_name, container, dockerfile_config(),
                       {"metadata.labels['jobset.sigs.k8s.io/jobset-name']": name}, trainer_env, mounts,
                       {master_host: "127.0.0.2"}, tmp_path / pod_name / "workspace",
                       [*TINY, "--set", "train.max_steps=8"])  # fmt: skip
        pods.append(pod)
    for pod in reversed(pods):  # node 1 first: the order the pods start in must not matter
        pod.start(tmp_path / f"{pod.name}.log")
    for pod in pods:
        assert wait_exit(pod, 150) == 0, pod.log()[-4000:]
    result = summary(tmp_path / "pvc" / "runs" / name)
    assert (result["status"], result["world_size"], result["global_step"]) == ("completed", 4, 8), result
    ranks = [set(re.findall(r"\[rank (\d)\] INFO step", pod.log())) for pod in pods]
    assert ranks == [{"0", "1"}, {"2", "3"}], ranks  # node rank 1 holds ranks 2 and 3: PET_NODE_RANK was used
    for pod in pods:  # torchrun's static rendezvous dialled PET_MASTER_ADDR:PET_MASTER_PORT (the mapped Service)
        assert re.search(rf"rdzv_endpoint\s*:\s*127\.0\.0\.2:{master_port}\b", pod.log()), pod.log()[:3000]
