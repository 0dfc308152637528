"""Tests of pipeline.training."""
