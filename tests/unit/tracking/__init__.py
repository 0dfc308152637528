"""Tests of pipeline.tracking."""
