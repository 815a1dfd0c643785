"""KFP component: `feast apply` the feature repo over the ingested sources (the registry; `materialize` fills the
online store after validation)."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def feast_apply(sources: Input[Dataset], feature_store: Output[Artifact], fs_yaml: str = ""):
    """The registry in the `feature_store` folder (or the environment yaml `fs_yaml`'s registry)."""
    from components._lib import steps

    # With an environment yaml the offline store (Spark) reads the artifact where it lives (its URI).
    info = steps.feast_apply(sources.path, feature_store.path, fs_yaml, sources.uri if fs_yaml else "")
    feature_store.metadata.update(info)
