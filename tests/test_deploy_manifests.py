"""CI validates the Kubernetes manifests in deploy/kuberay/ against the Kubernetes and
KubeRay schemas kept in deploy/kuberay/schemas/ (strict: an unknown field is an error),
with ``check-jsonschema`` (PyPI). The validator must also catch what a typo would do."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kuberay"
SCHEMAS = DEPLOY / "schemas"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def schema_for(doc: dict) -> Path:
    """deploy/kuberay/schemas/<kind>[-<group>]-<version>.json, as update.py names them."""
    group, _, version = doc["apiVersion"].rpartition("/")
    stem = "-".join(p for p in (doc["kind"].lower(), group.split(".")[0], version) if p)
    path = SCHEMAS / f"{stem}.json"
    assert path.exists(), (f"no schema for {doc['apiVersion']} {doc['kind']}: add the kind "
                           f"to deploy/kuberay/schemas/update.py and run it")
    return path


def check(doc: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run check-jsonschema on one document against its kind's schema."""
    path = tmp_path / f"{doc['kind']}-{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cli = shutil.which("check-jsonschema") or str(Path(sys.executable).parent /
                                                 "check-jsonschema")
    return subprocess.run([cli, "--schemafile", str(schema_for(doc)), str(path)],
                          capture_output=True, text=True, timeout=120, check=False)


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_every_document_validates_against_its_schema(manifest, tmp_path):
    docs = documents(manifest)
    assert docs
    for doc in docs:
        out = check(doc, tmp_path)
        assert out.returncode == 0, f"{doc['kind']} {doc['metadata']['name']}:\n{out.stdout}"


def _one(kind: str) -> dict:
    (doc,) = [d for d in documents(DEPLOY / "pdserve.yaml") if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("break_it, where", [
    (lambda d: d["spec"]["headGroupSpec"].__setitem__(
        "rayStartParam", d["spec"]["headGroupSpec"].pop("rayStartParams")),
     "RayCluster"),  # a misspelt KubeRay field
    (lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     ["livenessProbe"].__setitem__("periodSeconds", "ten"), "RayCluster"),  # a wrong type
    (lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"), "RayCluster"),  # required
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__(
        "readinessProbes", {}), "Deployment"),  # a misspelt Kubernetes field
    (lambda d: d["spec"].__setitem__("accessModes", "ReadWriteMany"),
     "PersistentVolumeClaim"),
])
def test_the_validator_catches_broken_manifests(break_it, where, tmp_path):
    doc = _one(where)
    assert check(doc, tmp_path).returncode == 0
    break_it(doc)
    out = check(doc, tmp_path)
    assert out.returncode != 0, f"a broken {where} passed validation"


def test_the_router_is_the_head_containers_main_process_with_probes():
    """What the issue asks of the head: a supervised router (not a postStart hook),
    probes on /health and /ready, the Redis password from a Secret, a defined volume."""
    cluster = _one("RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    (container,) = head["containers"]
    assert "lifecycle" not in container
    script = container["args"][0]
    assert "exec pdserve serve" in script and "${KUBERAY_GEN_RAY_START_CMD/--block/}" in script
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    env = {e["name"]: e for e in container["env"]}
    assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-secrets"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in head["volumes"]}
    assert claims == {_one("PersistentVolumeClaim")["metadata"]["name"]}


def test_the_ray_version_matches_the_image_and_allows_token_auth():
    """KubeRay refuses token auth below Ray 2.52, and the head's Ray must be the image's."""
    cluster = _one("RayCluster")
    version = cluster["spec"]["rayVersion"]
    dockerfile = (DEPLOY.parents[1] / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={version}\n" in dockerfile
    if cluster["spec"].get("authOptions", {}).get("mode") == "token":
        assert tuple(int(p) for p in version.split(".")) >= (2, 52, 0)
