"""Helpers for the Kubernetes tests: render the overlays, validate them offline, run their pods locally.

No API server runs here. ``render`` is ``kubectl kustomize``; the CRD schemas come from ../shared/k8s
(made strict: an unknown field is an error); a pod's container runs on this machine as the kubelet would
start it: the image's ENTRYPOINT (parsed from the Dockerfile) with the manifest's args, ``$(VAR)`` expanded
from the container's env, downward-API fields resolved, mounted volumes mapped to local directories and
Service names to loopback addresses.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import IN_CI, REPO, require_tool

K8S = REPO / "k8s"
OVERLAYS = ("cpu", "gpu")
SHARED_K8S = REPO.parent / "shared" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # the oldest minor the training operator's release-1.9 and Trainer v2 support
CRDS = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.v1.crd.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): "trainer.kubeflow.org_trainingruntimes.yaml",
}
CORE_API_VERSIONS = ("v1", "apps/v1", "policy/v1", "batch/v1")


# -- rendering and schemas ------------------------------------------------------------------------------------


def render(overlay: str) -> list[dict]:
    """The overlay's documents, as `kubectl kustomize k8s/overlays/<overlay>` prints them (a fresh copy)."""
    return copy.deepcopy(_render(overlay))


@functools.cache
def _render(overlay: str) -> list[dict]:
    kubectl = require_tool("kubectl", "the machine image ships kubectl with kustomize built in.")
    done = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize k8s/overlays/{overlay} failed: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(docs: Iterable[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {name or ''}, found {len(found)}")
    return found[0]


def shared_k8s_candidates() -> list[Path]:
    """Where ../shared/k8s may be: next to this checkout, or next to the local repository it was cloned from
    (a fresh clone for CI may stand anywhere, e.g. under /tmp, while its origin sits beside ../shared)."""
    candidates = [SHARED_K8S]
    done = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"], capture_output=True,
                          text=True, timeout=10)  # fmt: skip
    origin = done.stdout.strip().removeprefix("file://")
    if done.returncode == 0 and origin and "://" not in origin and Path(origin).is_dir():
        candidates.append(Path(origin).resolve().parent / "shared" / "k8s")
    return candidates


def require_shared_k8s() -> Path:
    """../shared/k8s with the CRDs; a skip that says why, or a failure under CI=true."""
    candidates = shared_k8s_candidates()
    for candidate in candidates:
        if (candidate / "README.md").is_file():
            return candidate
    where = " and ".join(map(str, candidates))
    message = (f"{where}: absent, and with them the CRD schemas the manifests are checked against "
               "(../shared/k8s beside this checkout or beside the repository it was cloned from).")  # fmt: skip
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema in which every object that lists properties allows no others.

    Kubernetes prunes unknown fields of a CRD silently; a typo there would vanish, so here it is an error.
    Objects marked x-kubernetes-preserve-unknown-fields, or with their own additionalProperties, are kept.
    """
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def crd_validator(shared: Path, api_version: str, kind: str) -> Any:
    """A jsonschema validator for one CRD version, strict (see ``strict``)."""
    import jsonschema

    crd = yaml.safe_load((shared / CRDS[(api_version, kind)]).read_text())
    version = api_version.split("/")[1]
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            schema = strict(entry["schema"]["openAPIV3Schema"])
            # apiVersion, kind and metadata are the API server's; the CRD does not describe them.
            schema["properties"].setdefault("metadata", {"type": "object"})
            return jsonschema.Draft7Validator(schema)
    raise AssertionError(f"{CRDS[(api_version, kind)]} has no version {version}")


def schema_errors(validator: Any, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def core_errors(doc: dict) -> list[str]:
    """kubernetes-validate --strict on one core document (or a PodTemplate wrapping an embedded pod template)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{doc['kind']}/{doc['metadata']['name']}: {'/'.join(map(str, exc.path))}: {exc.message}"]
    return []


# -- what a pod runs ----------------------------------------------------------------------------------------


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(where, pod template) for every pod template in a workload or job document."""
    kind = doc["kind"]
    if kind == "StatefulSet":
        return [("spec.template", doc["spec"]["template"])]
    if kind == "PyTorchJob":
        return [(f"spec.pytorchReplicaSpecs.{role}.template", spec["template"])
                for role, spec in doc["spec"]["pytorchReplicaSpecs"].items()]  # fmt: skip
    if kind == "TrainingRuntime":
        jobs = doc["spec"]["template"]["spec"]["replicatedJobs"]
        return [(f"spec.template.spec.replicatedJobs.{job['name']}.template.spec.template",
                 job["template"]["spec"]["template"]) for job in jobs]  # fmt: skip
    return []


@dataclass(frozen=True)
class ImageConfig:
    """The Dockerfile's final-stage ENTRYPOINT, CMD, ENV and WORKDIR (exec forms only)."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    stopsignal: str | None


def dockerfile_config(path: Path = REPO / "Dockerfile") -> ImageConfig:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    final = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    entrypoint: list[str] = []
    cmd: list[str] = []
    env: dict[str, str] = {}
    workdir, stopsignal = "/", None
    for line in lines[final:]:
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word in ("ENTRYPOINT", "CMD"):
            if not rest.startswith("["):
                raise AssertionError(f"{word} must be in exec form (a JSON list), not {rest!r}")
            if word == "ENTRYPOINT":
                entrypoint = json.loads(rest)
            else:
                cmd = json.loads(rest)
        elif word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
        elif word == "WORKDIR":
            workdir = rest
        elif word == "STOPSIGNAL":
            stopsignal = rest
    return ImageConfig(entrypoint, cmd, env, workdir, stopsignal)


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion: known names are replaced, unknown ones kept, $$ escapes a $."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, value)


def container_env(container: dict, fields: Mapping[str, str]) -> dict[str, str]:
    """The container's env as the kubelet resolves it: values expanded in order, fieldRefs from ``fields``."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif "fieldRef" in item.get("valueFrom", {}):
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            if path not in fields:
                raise AssertionError(f"env {item['name']}: no value for the downward-API field {path}")
            env[item["name"]] = fields[path]
        else:
            raise AssertionError(f"env {item['name']}: only value and fieldRef are simulated, not {item}")
    return env


def _replace_paths(text: str, mounts: Mapping[str, Path]) -> str:
    """Each mount path (not a longer path it is the start of) becomes its local directory, in one pass."""
    if not mounts:
        return text
    names = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
    return re.sub(rf"(?<![\w./-])({names})(?=/|,|$)", lambda m: str(mounts[m.group(1)]), text)


def _replace_hosts(text: str, hosts: Mapping[str, str]) -> str:
    """Each Service name (or name:port) becomes its loopback address, in one pass."""
    if not hosts:
        return text
    names = "|".join(re.escape(h) for h in sorted(hosts, key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({names})(?![\w.-])", lambda m: hosts[m.group(1)], text)


@dataclass
class LocalPod:
    """One pod's container, started on this machine as the kubelet would start it in the image.

    ``mounts`` maps each volumeMount's path to a local directory; ``hosts`` maps Service names (or
    ``name:port``) to loopback addresses; ``operator_env`` is what the operator adds to the container's env.
    """

    name: str
    container: dict
    image: ImageConfig
    fields: Mapping[str, str]
    operator_env: Mapping[str, str]
    mounts: Mapping[str, Path]
    hosts: Mapping[str, str]
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        own = container_env(self.container, self.fields)
        merged = {**self.image.env, **own, **self.operator_env}
        env = {key: _replace_hosts(_replace_paths(value, self.mounts), self.hosts) for key, value in merged.items()}
        # This machine's own paths, added after the container paths are mapped: a checkout under /tmp must
        # not have its venv mapped into the pod's /tmp emptyDir.
        bin_dir = str(Path(sys.executable).parent)
        env.update(PATH=f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", HOME=str(self.workdir),
                   OMP_NUM_THREADS="1", LOGLEVEL="INFO",
                   PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "tasks")]))  # fmt: skip
        return env

    def argv(self) -> list[str]:
        command = self.container.get("command") or self.image.entrypoint
        args = self.container["args"] if "args" in self.container else self.image.cmd
        own = container_env(self.container, self.fields)
        env = {**self.image.env, **own, **self.operator_env}
        words = [expand(word, env) for word in [*command, *args]] + self.extra_args
        return [_replace_hosts(_replace_paths(word, self.mounts), self.hosts) for word in words]

    def start(self, log_path: Path) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), cwd=self.workdir, env=self.env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
