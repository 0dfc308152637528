"""Tests of pipeline.merge."""
