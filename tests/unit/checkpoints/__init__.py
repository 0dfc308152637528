"""Tests of pipeline.checkpoints on synthetic shards (no DeepSpeed launch)."""
