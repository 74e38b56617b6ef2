"""The artifact graph: every stage output's key and path, computed from config at planning time.

:mod:`~mixquant.graph.artifact` holds one artifact and how its key is made; the stages' artifacts are
added by :mod:`~mixquant.graph.inputs` (source model, calibration, prompt), :mod:`~mixquant.graph.rebuild`
(activations, quantize windows, search, export), :mod:`~mixquant.graph.kld` and
:mod:`~mixquant.graph.release`; :mod:`~mixquant.graph.resolve` builds a config's whole graph.
"""

from mixquant.graph.artifact import Artifact, GraphBuilder, deployment_of, keyed_path
from mixquant.graph.inputs import dataset_settings
from mixquant.graph.kld import engine_settings
from mixquant.graph.rebuild import layer_artifact_name, rebuild_params
from mixquant.graph.release import HASHED_ARTIFACTS, made_from, settings_fingerprint
from mixquant.graph.resolve import artifact_by_key, final_targets, layer_artifacts, resolve_artifacts

__all__ = [
    "HASHED_ARTIFACTS",
    "Artifact",
    "GraphBuilder",
    "artifact_by_key",
    "dataset_settings",
    "deployment_of",
    "engine_settings",
    "final_targets",
    "keyed_path",
    "layer_artifact_name",
    "layer_artifacts",
    "made_from",
    "rebuild_params",
    "resolve_artifacts",
    "settings_fingerprint",
]
