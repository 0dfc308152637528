"""Tests of pipeline.data."""
