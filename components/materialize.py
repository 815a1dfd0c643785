"""KFP component: materialize the validated sources into the online store that serving reads."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from components._image import COMPONENT_KWARGS


@dsl.component(**COMPONENT_KWARGS)
def materialize(
    sources: Input[Dataset],
    registry: Input[Artifact],
    feature_store: Output[Artifact],
    fs_yaml: str = "",
):
    """Runs only after the targets passed validation, so bad data never reaches serving's online store.

    Locally `feature_store` is a new store folder (the registry copied from `registry`, the online sqlite
    filled); with an environment yaml (`fs_yaml`) the environment's online store is filled and the artifact
    records it.
    """
    from components._lib import steps

    info = steps.materialize(sources.path, registry.path, feature_store.path, fs_yaml)
    feature_store.metadata.update(info)
