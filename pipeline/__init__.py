"""Library of the LoRA fine-tuning pipeline: small typed functions, no knowledge of DVC or Hydra."""
