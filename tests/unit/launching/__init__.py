"""Tests of pipeline.launching."""
