"""Adapter into base:

- `fold`: W + scale x B @ A, one tensor at a time in fp32, into a new model folder.
- `verify`: the merged model's logits against base + adapter's, within stated tolerances.
"""
