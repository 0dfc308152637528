"""Tests of pipeline.core."""
