"""Thin entry points of the DVC stages: read params.yaml, call pipeline/, write the declared outputs."""
