"""Print k8s/base/prometheusrule.yaml: monitoring/rules.yml wrapped in a PrometheusRule (prometheus-operator).

    python tests/scripts/k8s_prometheusrule.py > k8s/base/prometheusrule.yaml

tests/test_k8s_manifests.py fails when the committed file differs from this output, so the rules Prometheus
runs on Kubernetes cannot drift from the ones promtool tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
HEADER = """\
# GENERATED from monitoring/rules.yml by tests/scripts/k8s_prometheusrule.py; do not edit by hand:
#   python tests/scripts/k8s_prometheusrule.py > k8s/base/prometheusrule.yaml
# The recording rules and alerts of docs/monitoring.md, for a Prometheus run by prometheus-operator.
"""


def render(rules_path: Path = REPO / "monitoring" / "rules.yml") -> str:
    groups = yaml.safe_load(rules_path.read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "ddp-service", "labels": {"app.kubernetes.io/name": "ddp-service"}},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
