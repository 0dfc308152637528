"""Tests of pipeline.kernels."""
