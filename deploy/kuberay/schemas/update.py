"""Write the JSON schemas that CI validates deploy/kuberay/*.yaml against, one
self-contained file per kind (``$defs`` holds only the definitions the kind reaches).

Sources (record them in README.md beside this file when you update):

- Kubernetes: the strict schemas that the ``kubernetes-validate`` wheel (PyPI) bundles,
  generated from Kubernetes' OpenAPI spec; unknown fields are errors.
- KubeRay: the ``openAPIV3Schema`` of KubeRay's CustomResourceDefinitions
  (``helm-chart/kuberay-operator/crds/ray.io_*.yaml`` at a release tag), made strict the
  way Kubernetes' own schemas are: an object that lists its properties and does not
  preserve unknown fields admits no others (the API server would silently prune them,
  which hides a misspelt field).

- cert-manager (the cluster CA's Issuers and Certificate, cert-manager.yaml): the
  pydantic models of ``cloudcoil-models-cert-manager`` (PyPI; generated from
  cert-manager's CRDs, 1.17.1.0 here), as JSON schemas made strict the same way.

    pip download --no-deps kubernetes-validate==1.37.0 && unzip kubernetes_validate-*.whl
    python deploy/kuberay/schemas/update.py \\
        --kubernetes kubernetes_validate/kubernetes-json-schema/v1.34.0-local-strict \\
        --crd ray.io_rayclusters.yaml
    pip install cloudcoil-models-cert-manager==1.17.1.0
    python deploy/kuberay/schemas/update.py --cert-manager
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import yaml

HERE = Path(__file__).parent
# The built-in kinds deploy/kuberay uses; add a kind here when a manifest starts using it.
KUBERNETES_KINDS = ("deployment-apps-v1", "service-v1",
                    "persistentvolumeclaim-v1", "networkpolicy-networking-v1")
_REF = re.compile(r"^(?:/api/_definitions\.json)?#/\$defs/(.+)$")


def _rewrite_refs(node, used: set[str]):
    """Point every ``$ref`` at ``#/$defs/NAME`` and collect the names."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                match = _REF.match(value)
                if match is None:
                    raise ValueError(f"unexpected $ref {value!r}")
                used.add(match.group(1))
                out[key] = f"#/$defs/{match.group(1)}"
            else:
                out[key] = _rewrite_refs(value, used)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, used) for v in node]
    return node


def kubernetes_schema(folder: Path, kind_file: str) -> dict:
    """One kind's schema with the definitions it reaches, transitively, under ``$defs``."""
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]
    used: set[str] = set()
    schema = _rewrite_refs(json.loads((folder / f"{kind_file}.json").read_text()), used)
    defs: dict = {}
    todo = list(used)
    while todo:
        name = todo.pop()
        if name in defs:
            continue
        found: set[str] = set()
        defs[name] = _rewrite_refs(definitions[name], found)
        todo.extend(found - defs.keys())
    schema["$defs"] = dict(sorted(defs.items()))
    return schema


def _strict(node):
    """Close every object schema that names its properties (see the module docstring)."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def crd_schemas(crd_file: Path, object_meta: dict) -> dict[str, dict]:
    """``{file stem: schema}`` for every served, not deprecated version of the CRD in
    ``crd_file``.
    ``metadata`` (left open by CRDs) gets Kubernetes' ObjectMeta schema."""
    crd = yaml.safe_load(crd_file.read_text())
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    out = {}
    for version in crd["spec"]["versions"]:
        if not version.get("served", True) or version.get("deprecated"):
            continue
        schema = _strict(version["schema"]["openAPIV3Schema"])
        props = schema["properties"]
        props["apiVersion"] = {"type": "string", "enum": [f"{group}/{version['name']}"]}
        props["kind"] = {"type": "string", "enum": [kind]}
        props["metadata"] = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
        schema["$defs"] = object_meta
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema.setdefault("required", [])
        for field in ("apiVersion", "kind", "metadata"):
            if field not in schema["required"]:
                schema["required"].append(field)
        out[f"{kind.lower()}-{group.split('.')[0]}-{version['name']}"] = schema
    return out


CERT_MANAGER_KINDS = ("Issuer", "Certificate")


def cert_manager_schemas() -> dict[str, dict]:
    """``{file stem: schema}`` of ``CERT_MANAGER_KINDS`` (cert-manager.io/v1) from
    cloudcoil's pydantic models: strict, ``apiVersion``, ``kind`` and ``metadata``
    required, ``status`` left out (the controller writes it)."""
    from cloudcoil.models.cert_manager import v1

    out = {}
    for kind in CERT_MANAGER_KINDS:
        schema = _strict(getattr(v1, kind).model_json_schema(by_alias=True))
        props = schema["properties"]
        props.pop("status", None)
        props["apiVersion"] = {"type": "string", "enum": ["cert-manager.io/v1"]}
        props["kind"] = {"type": "string", "enum": [kind]}
        props["metadata"] = {"$ref": "#/$defs/ObjectMeta"}
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
        out[f"{kind.lower()}-cert-manager-v1"] = schema
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubernetes", type=Path, default=None,
                        help="a kubernetes-validate *-local-strict schema folder")
    parser.add_argument("--cert-manager", action="store_true",
                        help="write the cert-manager kinds' schemas (needs "
                             "cloudcoil-models-cert-manager)")
    parser.add_argument("--crd", type=Path, action="append", default=[],
                        help="a KubeRay CustomResourceDefinition YAML (repeatable)")
    args = parser.parse_args()
    written = {}
    if args.kubernetes is not None:
        for kind in KUBERNETES_KINDS:
            written[kind] = kubernetes_schema(args.kubernetes, kind)
        meta = kubernetes_schema(args.kubernetes, "objectmeta-meta-v1")
        object_meta = {"io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta":
                       {k: v for k, v in meta.items() if k not in ("$defs", "$schema", "$id")},
                       **meta["$defs"]}
        for crd in args.crd:
            written.update(crd_schemas(crd, object_meta))
    elif args.crd:
        parser.error("--crd needs --kubernetes (for ObjectMeta)")
    if args.cert_manager:
        written.update(cert_manager_schemas())
    for stem, schema in written.items():
        # Compact: the KubeRay schemas spell out a whole PodTemplateSpec per pod group.
        (HERE / f"{stem}.json").write_text(json.dumps(schema, separators=(",", ":")) + "\n")
        print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
