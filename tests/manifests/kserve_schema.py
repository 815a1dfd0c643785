"""A strict JSON Schema for InferenceService, derived at test time from what is installed, plus this project's
rules on top. Nothing of KServe's CRD is copied into the repository.

- KServe's own types (`V1beta1InferenceServiceSpec` and everything below it) come from the installed kserve
  package's models: each model's `openapi_types` (field -> type) and `attribute_map` (field -> JSON name) give a
  closed object, so every field KServe knows is accepted with its type and anything else is refused.
- The Kubernetes types KServe embeds (`V1Container`, `V1Toleration`, ...) come from kubernetes-validate's strict
  schema of the Kubernetes version KServe 0.21 was generated against (its models name `V1PodSchedulingGroup`,
  new in 1.36). The Python kubernetes client cannot stand in: it predates several of them.
- The project's rules: Serverless mode, a canary within 0-100, only known resource keys (a typo such as
  `nvidia.com/gpus` is refused), and a component that asks for a GPU sits on the one GPU pool
  (manifests/components/gpu-pool, shared with the training steps through pipelines/resources.py).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kserve.models
import kubernetes_validate

from components._lib.gpu_pool import GPU_POOL_LABEL, GPU_POOL_VALUE, GPU_TOLERATION
from pipelines.resources import GPU_TYPE

K8S_VERSION = "1.36.0"
K8S_DEFS = (
    Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
)
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
# KServe type names that are not `V1<Kind>` of core/v1. V1beta1MetricQuantity is referenced by KServe's
# V1beta1MetricTarget but missing from its models: KServe's docs give it as a resource quantity.
K8S_NAMES = {
    "ResourceQuantity": QUANTITY,
    "V1beta1MetricQuantity": QUANTITY,
    "V1ObjectMeta": "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
    "V1Time": "io.k8s.apimachinery.pkg.apis.meta.v1.Time",
}
SCALARS = {"str": "string", "int": "integer", "bool": "boolean", "float": "number"}
RESOURCE_KEYS = ["cpu", "memory", "ephemeral-storage", GPU_TYPE]


def k8s_name(type_name: str) -> str:
    """The Kubernetes schema definition a KServe model's type name refers to (KeyError when unknown)."""
    if type_name in K8S_NAMES:
        return K8S_NAMES[type_name]
    m = re.fullmatch(
        r"K8sIoApi([A-Z][a-z]+)(V\d\w*?)([A-Z]\w*)", type_name
    )  # K8sIoApiAppsV1DeploymentStrategy
    if m:
        return f"io.k8s.api.{m[1].lower()}.{m[2].lower()}.{m[3]}"
    m = re.fullmatch(r"V1([A-Z]\w*)", type_name)
    if m:
        return f"io.k8s.api.core.v1.{m[1]}"
    raise KeyError(f"no Kubernetes definition for KServe's type {type_name!r}")


@cache
def kserve_schema() -> dict[str, Any]:
    """The strict InferenceService schema (a JSON Schema 2020-12 document with every definition in $defs)."""
    k8s = json.loads((K8S_DEFS / "_definitions.json").read_text())["$defs"]
    defs: dict[str, Any] = {}

    def ref(type_name: str) -> dict[str, Any]:
        model = getattr(kserve.models, type_name, None)
        if model is None:
            name = k8s_name(type_name)
            if name not in k8s:
                raise KeyError(f"{type_name}: {name} is not in the Kubernetes {K8S_VERSION} schema")
            defs[name] = k8s[name]
            return {"$ref": f"#/$defs/{name}"}
        name = f"kserve.{type_name}"
        if name not in defs:
            defs[name] = {}  # placeholder first: the models are recursive
            defs[name] = {
                "type": "object",
                "additionalProperties": False,
                "properties": {model.attribute_map[f]: of(t) for f, t in model.openapi_types.items()},
            }
        return {"$ref": f"#/$defs/{name}"}

    def of(t: str) -> dict[str, Any]:
        if t in SCALARS:
            return {"type": SCALARS[t]}
        if t == "object":
            return {}
        if m := re.fullmatch(r"list\[(.+)\]", t):
            return {"type": "array", "items": of(m[1])}
        if m := re.fullmatch(r"dict\(str, (.+)\)", t):
            return {"type": "object", "additionalProperties": of(m[1])}
        return ref(t)

    spec = ref("V1beta1InferenceServiceSpec")
    defs.update({k: v for k, v in k8s.items() if k not in defs})  # what the Kubernetes definitions refer to
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "additionalProperties": False,  # a manifest carries no status
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "serving.kserve.io/v1beta1"},
            "kind": {"const": "InferenceService"},
            "metadata": ref("V1ObjectMeta"),
            "spec": spec,
        },
        "$defs": defs,
    }


def _component_rules() -> dict[str, Any]:
    """Known resource keys; a GPU request implies the GPU pool's node selector and toleration."""
    keys = {"type": "object", "propertyNames": {"enum": RESOURCE_KEYS}}
    asks_gpu = {
        "required": ["containers"],
        "properties": {
            "containers": {
                "contains": {
                    "required": ["resources"],
                    "properties": {
                        "resources": {
                            "required": ["limits"],
                            "properties": {"limits": {"required": [GPU_TYPE]}},
                        }
                    },
                }
            }
        },
    }
    return {
        "properties": {
            "containers": {
                "items": {"properties": {"resources": {"properties": {"limits": keys, "requests": keys}}}}
            }
        },
        "if": asks_gpu,
        "then": {
            "required": ["nodeSelector", "tolerations"],
            "properties": {
                "nodeSelector": {"const": {GPU_POOL_LABEL: GPU_POOL_VALUE}},
                "tolerations": {"contains": {"const": GPU_TOLERATION}},
            },
        },
    }


PROJECT_RULES: dict[str, Any] = {
    "properties": {
        "metadata": {
            "required": ["annotations"],
            "properties": {
                "annotations": {
                    "required": ["serving.kserve.io/deploymentMode"],
                    # canaryTrafficPercent and tag routing work only in Serverless (Knative) mode
                    "properties": {"serving.kserve.io/deploymentMode": {"const": "Serverless"}},
                }
            },
        },
        "spec": {
            "properties": {
                "predictor": {
                    "allOf": [
                        {"properties": {"canaryTrafficPercent": {"minimum": 0, "maximum": 100}}},
                        _component_rules(),
                    ]
                },
                "transformer": _component_rules(),
                "explainer": _component_rules(),
            }
        },
    }
}


@cache
def validator() -> jsonschema.protocols.Validator:
    schema = kserve_schema()
    return jsonschema.Draft202012Validator({**schema, "allOf": [PROJECT_RULES]})


def errors(doc: dict[str, Any]) -> list[str]:
    """Every violation, as 'path: message' (empty = valid)."""
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(doc))
