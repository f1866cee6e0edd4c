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


# networkpolicy.yaml: its selectors and ports must fit the pods and ports pdserve.yaml
# declares, or the policies cut the cluster off from itself (or protect nothing).

def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """``{"router" | "worker" | "redis": pod template}`` of pdserve.yaml, each template's
    labels with the ones KubeRay adds to the RayCluster's pods."""
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    redis = next(d for d in docs if d["kind"] == "Deployment")
    name = cluster["metadata"]["name"]
    head = cluster["spec"]["headGroupSpec"]["template"]
    (group,) = cluster["spec"]["workerGroupSpecs"]
    kuberay = {"ray.io/cluster": name}
    return {
        "router": {**head, "labels": {**head.get("metadata", {}).get("labels", {}), **kuberay,
                                      "ray.io/node-type": "head", "ray.io/group": "headgroup"}},
        "worker": {**group["template"],
                   "labels": {**group["template"].get("metadata", {}).get("labels", {}),
                              **kuberay, "ray.io/node-type": "worker",
                              "ray.io/group": group["groupName"]}},
        "redis": {**redis["spec"]["template"],
                  "labels": redis["spec"]["template"]["metadata"]["labels"]},
    }


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes' label selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def container_ports(template: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"]
            for c in template["spec"]["containers"] for p in c.get("ports", [])}


def policy_problems(docs: list[dict], policies: list[dict]) -> list[str]:
    """What is wrong with ``policies`` (networkpolicy.yaml) for ``docs`` (pdserve.yaml);
    empty when they fit."""
    pods = pod_templates(docs)
    by_name = {p["metadata"]["name"]: p for p in policies}
    problems = []
    wanted = {"pdserve-workers": "worker", "pdserve-router": "router", "pdserve-redis": "redis"}
    for name, role in wanted.items():
        policy = by_name.get(name)
        if policy is None:
            problems.append(f"no NetworkPolicy {name}")
            continue
        spec = policy["spec"]
        chosen = [r for r, pod in pods.items() if selects(spec["podSelector"], pod["labels"])]
        if chosen != [role]:
            problems.append(f"{name} selects {chosen}, not [{role!r}]")
        if spec.get("policyTypes") != ["Ingress"]:
            problems.append(f"{name}: policyTypes {spec.get('policyTypes')}")
        for rule in spec.get("ingress", []):
            for peer in rule.get("from", []):
                if set(peer) != {"podSelector"}:
                    problems.append(f"{name}: a peer beyond this namespace's pods: {peer}")
                    continue
                reached = [r for r, pod in pods.items()
                           if selects(peer["podSelector"], pod["labels"])]
                if not reached or "redis" in reached:
                    problems.append(f"{name}: a peer selecting {reached}")
    # the workers: reached by the router and by each other (KV transfer), on any port
    # (theirs are picked free at start), and by nobody else
    workers = by_name.get("pdserve-workers", {"spec": {}})["spec"]
    peers = {r for rule in workers.get("ingress", []) for peer in rule.get("from", [None])
             for r, pod in pods.items() if peer is None or selects(peer["podSelector"],
                                                                    pod["labels"])}
    if peers != {"router", "worker"}:
        problems.append(f"pdserve-workers admits {sorted(peers)}, not the router and workers")
    if any("from" not in rule for rule in workers.get("ingress", [])):
        problems.append("pdserve-workers has a rule open to every pod")
    # the router: its API ports open, as the head container and the Service declare them
    head = pods["router"]
    ports = container_ports(head)
    script = head["spec"]["containers"][0]["args"][0]
    service = next(d for d in docs if d["kind"] == "Service" and
                   d["metadata"]["name"] == "pdserve-router")
    api = {ports["http"], ports["grpc"]}
    flags = {int(re.search(rf"--{flag} (\d+)", script).group(1))
             for flag in ("port", "grpc-port")}
    targets = {p["targetPort"] for p in service["spec"]["ports"]}
    router = by_name.get("pdserve-router", {"spec": {}})["spec"]
    open_ports = {p["port"] for rule in router.get("ingress", []) if "from" not in rule
                  for p in rule.get("ports", [])}
    for what, expected in (("the container's http/grpc ports", api),
                           ("pdserve serve's --port/--grpc-port", flags),
                           ("the Service's targetPorts", targets)):
        if open_ports != expected:
            problems.append(f"pdserve-router opens {sorted(open_ports)} to all, "
                            f"{what} are {sorted(expected)}")
    # Redis: its port, to the cluster's pods
    redis_port = container_ports(pods["redis"])["redis"]
    redis = by_name.get("pdserve-redis", {"spec": {}})["spec"]
    redis_ports = {p["port"] for rule in redis.get("ingress", []) for p in rule.get("ports", [])}
    if redis_ports != {redis_port}:
        problems.append(f"pdserve-redis opens {sorted(redis_ports)}, Redis listens on "
                        f"{redis_port}")
    return problems


def test_the_network_policies_fit_the_pods_and_ports():
    docs = documents(DEPLOY / "pdserve.yaml")
    policies = documents(DEPLOY / "networkpolicy.yaml")
    assert {p["kind"] for p in policies} == {"NetworkPolicy"}
    assert policy_problems(docs, policies) == []


def _set_worker_label(docs, policies):
    group = next(d for d in docs if d["kind"] == "RayCluster")["spec"]["workerGroupSpecs"][0]
    group["template"]["metadata"]["labels"]["app.kubernetes.io/component"] = "gpu-worker"


def _move_grpc_port(docs, policies):
    head = next(d for d in docs if d["kind"] == "RayCluster")["spec"]["headGroupSpec"]
    for port in head["template"]["spec"]["containers"][0]["ports"]:
        if port["name"] == "grpc":
            port["containerPort"] = 50051


def _open_the_workers(docs, policies):
    policies[0]["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 9000}]})


def _router_label_typo(docs, policies):
    policies[0]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] = "routr"


def _wrong_redis_port(docs, policies):
    policies[2]["spec"]["ingress"][0]["ports"][0]["port"] = 6380


def _public_ray_port(docs, policies):
    policies[1]["spec"]["ingress"][0]["ports"].append({"protocol": "TCP", "port": 8265})


@pytest.mark.parametrize("break_it", [_set_worker_label, _move_grpc_port, _open_the_workers,
                                      _router_label_typo, _wrong_redis_port, _public_ray_port],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_policy_check_catches_a_wrong_label_or_port(break_it):
    docs = documents(DEPLOY / "pdserve.yaml")
    policies = documents(DEPLOY / "networkpolicy.yaml")
    assert [p["metadata"]["name"] for p in policies] == ["pdserve-workers", "pdserve-router",
                                                        "pdserve-redis"]
    break_it(docs, policies)
    assert policy_problems(docs, policies) != []


def test_the_head_takes_the_admin_key_from_the_secret():
    head = _one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in head["env"]
           if "secretKeyRef" in e.get("valueFrom", {})}
    assert env["PDSERVE_ADMIN_API_KEY"] == {"name": "pdserve-secrets", "key": "admin-api-key",
                                            "optional": True}
    assert "--admin-api-key" not in head["args"][0]  # never on a command line


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
