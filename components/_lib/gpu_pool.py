"""The GPU node pool: its node label and taint toleration, read from the kustomize component that puts the serving
predictor there (manifests/components/gpu-pool/gpu-pool.yaml), so they are defined once. The TrainJobs
(components/_lib/trainjob.py) and the pipeline's GPU steps (pipelines/resources.py) land on the same pool."""

import yaml

from components._lib.paths import REPO_ROOT

_POOL = yaml.safe_load((REPO_ROOT / "manifests" / "components" / "gpu-pool" / "gpu-pool.yaml").read_text())
[(GPU_POOL_LABEL, GPU_POOL_VALUE)] = _POOL["spec"]["predictor"]["nodeSelector"].items()
[GPU_TOLERATION] = _POOL["spec"]["predictor"]["tolerations"]  # {key, operator, effect}
