"""Write the `openAPIV3Schema` of a published CustomResourceDefinition as
JSON, with every embedded core schema cut out: each Pod spec (a schema whose
properties include `containers`) becomes an object that accepts anything,
marked `x-keras-dist-validated-as`, because the tests validate pod templates
with kubernetes-validate, which knows Kubernetes' own schemas. That keeps the
vendored files small.

Usage: python extract_crd_schema.py CRD.yaml VERSION OUTPUT.json
(VERSION: the CRD version to take, e.g. v1alpha1)
"""

from __future__ import annotations

import json
import sys

import yaml

#: Properties only Kubernetes' own PodSpec has all of.
POD_SPEC_PROPERTIES = {"containers", "restartPolicy", "dnsPolicy", "volumes"}


def prune(schema: object, path: str = "") -> object:
    """`schema` without descriptions and with core Pod specs cut out."""
    if isinstance(schema, list):
        return [prune(item, f"{path}[]") for item in schema]
    if not isinstance(schema, dict):
        return schema
    properties = schema.get("properties")
    if isinstance(properties, dict) and POD_SPEC_PROPERTIES <= properties.keys():
        print(f"cut a PodSpec at {path}", file=sys.stderr)
        return {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "x-keras-dist-validated-as": "io.k8s.api.core.v1.PodSpec",
        }
    pruned = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key in ("properties", "patternProperties") and isinstance(value, dict):
            pruned[key] = {
                name: prune(sub, f"{path}.{name}") for name, sub in value.items()
            }
        else:
            pruned[key] = prune(value, path)
    return pruned


def main(source: str, version: str, output: str) -> None:
    with open(source) as file:
        documents = [doc for doc in yaml.safe_load_all(file) if doc]
    (crd,) = [doc for doc in documents if doc["kind"] == "CustomResourceDefinition"]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = prune(served["schema"]["openAPIV3Schema"])
    with open(output, "w") as file:
        json.dump(
            {
                "group": crd["spec"]["group"],
                "version": version,
                "kind": crd["spec"]["names"]["kind"],
                "openAPIV3Schema": schema,
            },
            file,
            indent=None,
            separators=(",", ":"),
            sort_keys=True,
        )
        file.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
