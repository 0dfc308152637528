"""Tests that start real processes: DeepSpeed launches, dvc, stage entry points, MLflow servers, the browser."""
