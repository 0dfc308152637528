"""Tests of pipeline.model."""
