"""What leaves the pipeline:

- `gguf`: a merged LLaMA-style model -> one GGUF file (llama.cpp, Ollama); `gguf_roundtrip`: proof it reads back.
- `model_card`: the adapter's and the merged model's README cards with their evaluation tables.
"""
