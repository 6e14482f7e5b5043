"""Pipeline parallelism for language models: ``FabricLearner(..., strategy=PipelineStrategy(...))``.

See ``pipeline.learner`` and docs/pipeline.md; the default split lives in ``sharding.pipeline_split``.
"""

from fabric_learner.pipeline.learner import PipelineLearner, PipelineStrategy
from fabric_learner.sharding.pipeline_split import check_split, decoder_split

__all__ = ["PipelineLearner", "PipelineStrategy", "check_split", "decoder_split"]
