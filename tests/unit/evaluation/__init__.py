"""Tests of pipeline.evaluation."""
