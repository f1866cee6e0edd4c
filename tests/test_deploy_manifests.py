"""CI validates the Kubernetes manifests in deploy/kuberay/ against the Kubernetes and
KubeRay schemas kept in deploy/kuberay/schemas/ (strict: an unknown field is an error),
with ``check-jsonschema`` (PyPI). The validator must also catch what a typo would do."""

from __future__ import annotations

import re
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
    claims = {v["persistentVolumeClaim"]["claimName"] for v in head["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {_one("PersistentVolumeClaim")["metadata"]["name"]}


def test_the_ray_version_matches_the_image_and_allows_token_auth():
    """KubeRay refuses token auth below Ray 2.52, and the head's Ray must be the image's."""
    cluster = _one("RayCluster")
    version = cluster["spec"]["rayVersion"]
    dockerfile = (DEPLOY.parents[1] / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={version}\n" in dockerfile
    if cluster["spec"].get("authOptions", {}).get("mode") == "token":
        assert tuple(int(p) for p in version.split(".")) >= (2, 52, 0)


def _cert_manager(kind: str, name: str) -> dict:
    (doc,) = [d for d in documents(DEPLOY / "cert-manager.yaml")
              if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _ray_pods() -> dict[str, dict]:
    """The pod spec of the RayCluster's head and of each worker group."""
    cluster = _one("RayCluster")
    pods = {"head": cluster["spec"]["headGroupSpec"]["template"]["spec"]}
    for group in cluster["spec"]["workerGroupSpecs"]:
        pods[group["groupName"]] = group["template"]["spec"]
    return pods


def test_the_cluster_ca_is_a_cert_manager_ca_issuer_of_a_self_signed_certificate():
    """cert-manager.yaml: a self-signed Issuer signs the CA Certificate (isCA); the CA
    Issuer signs with the Secret that Certificate writes."""
    selfsigned = _cert_manager("Issuer", "pdserve-selfsigned")
    assert selfsigned["spec"] == {"selfSigned": {}}
    ca = _cert_manager("Certificate", "pdserve-cluster-ca")
    assert ca["spec"]["isCA"] is True
    assert ca["spec"]["issuerRef"] == {"name": "pdserve-selfsigned", "kind": "Issuer",
                                       "group": "cert-manager.io"}
    issuer = _cert_manager("Issuer", "pdserve-cluster-ca")
    assert issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]


def test_every_ray_pod_mounts_its_own_certificate_and_pdserve_reads_it():
    """Each Ray pod (the router's head, every worker group) mounts a csi.cert-manager.io
    volume signed by the CA Issuer for its DNS name under the headless Service that its
    ``subdomain`` names (which selects this RayCluster's pods); its container mounts it
    where ``pdserve serve``'s --cluster-ssl-* flags point, and advertises that same DNS
    name ($PDSERVE_ADVERTISE_HOST, which the launcher reads)."""
    from pdserve.entrypoints.launcher import ADVERTISE_HOST_ENV

    cluster = _one("RayCluster")
    issuer = _cert_manager("Issuer", "pdserve-cluster-ca")
    (service,) = [d for d in documents(DEPLOY / "cert-manager.yaml") if d["kind"] == "Service"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    subdomain = service["metadata"]["name"]
    script = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
    flags = dict(re.findall(r"--(cluster-ssl-[a-z-]+) (\S+)", script))
    assert set(flags) == {"cluster-ssl-certfile", "cluster-ssl-keyfile", "cluster-ssl-ca-certs"}
    directories = {str(Path(path).parent) for path in flags.values()}
    assert len(directories) == 1
    (directory,) = directories
    assert {name: Path(path).name for name, path in flags.items()} == {
        "cluster-ssl-certfile": "tls.crt", "cluster-ssl-keyfile": "tls.key",
        "cluster-ssl-ca-certs": "ca.crt"}  # the csi-driver's default file names
    pods = _ray_pods()
    assert len(pods) >= 2
    for name, pod in pods.items():
        assert pod["subdomain"] == subdomain, name
        csi = [v for v in pod["volumes"] if v.get("csi", {}).get("driver") ==
               "csi.cert-manager.io"]
        assert len(csi) == 1, name
        attributes = csi[0]["csi"]["volumeAttributes"]
        assert attributes["csi.cert-manager.io/issuer-name"] == issuer["metadata"]["name"]
        assert attributes["csi.cert-manager.io/issuer-kind"] == "Issuer"
        assert attributes["csi.cert-manager.io/dns-names"] == \
            f"${{POD_NAME}}.{subdomain}.${{POD_NAMESPACE}}.svc.cluster.local"
        (container,) = pod["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts[csi[0]["name"]]["mountPath"] == directory, name
        assert mounts[csi[0]["name"]]["readOnly"] is True
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.namespace"
        assert env[ADVERTISE_HOST_ENV]["value"] == \
            f"$(POD_NAME).{subdomain}.$(POD_NAMESPACE).svc.cluster.local", name
