"""Deprecated: meshddp.pipelining is the pipeline module (finalize_model_grads,
declare_tied_across_stages, PipelineStage) and meshddp.groups holds embedding_groups. This alias
module warns once, at import, and will be removed in the next release."""

from meshddp import _deprecated
from meshddp.groups import embedding_groups  # noqa: F401
from meshddp.pipelining import declare_tied_across_stages, finalize_model_grads  # noqa: F401

_deprecated.warn("meshddp.pipeline", "meshddp.pipelining (and meshddp.groups.embedding_groups)")
