"""Thin entry points of the DVC stages: read params.yaml, call pipeline/, write the declared outputs."""

from pipeline.core import stage_server

# The stages that import torch, transformers and PEFT: forked from a stage server where one is named (the test suite)
SERVED = ("stages.prepare_base", "stages.consolidate", "stages.merge", "stages.evaluate")
stage_server.hand_over(SERVED)
