"""Export a LLaMA-architecture HF model folder to one GGUF file (llama.cpp, Ollama) with its byte-level BPE tokenizer
inside, through the `gguf` package's writer. 2-D weights are stored as f16 or q8_0 (rows whose length is not a
multiple of 32 stay f16), norms as f32; tensors stream from the safetensors shards one at a time.

GGML applies rotary embeddings to interleaved pairs of a head's dimensions, transformers' LLaMA to its two halves;
the rows of q_proj and k_proj are reordered from the second layout to the first (readers undo it on load)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path, read_json

TYPES = ("f16", "q8_0")
ARCHITECTURES = {"llama": "llama"}  # HF model_type -> GGUF architecture
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34  # q8_0: 32 weights as int8 plus one f16 scale


def check_exportable(model_dir: Path, type_name: str) -> dict:
    """config.json of a model this exporter can write, or a ValueError saying what it cannot (before any work)."""
    if type_name not in TYPES:
        raise ValueError(f"--type: expected one of {', '.join(TYPES)}, got {type_name!r}")
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json; expected an HF model folder (e.g. artifacts/merged)")
    config = read_json(Path(model_dir) / "config.json")
    where = f"{model_dir}/config.json"
    if config.get("model_type") not in ARCHITECTURES:
        raise ValueError(
            f"{where}: model_type {config.get('model_type')!r}: the GGUF exporter knows "
            f"{', '.join(ARCHITECTURES)} (Llama-style models); --type {type_name} cannot be written for it"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: rope_type {rope['rope_type']!r}: only unscaled rotary embeddings are exported")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{where}: attention_bias/mlp_bias: biases are not exported")
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json; the GGUF file carries the tokenizer")
    spec = read_json(tokenizer_json)
    pre = spec.get("pre_tokenizer") or {}
    if spec["model"]["type"] != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError(
            f"{tokenizer_json}: the exporter writes byte-level BPE tokenizers with GPT-2's split (SmolLM2's), got "
            f"model {spec['model']['type']} with pre-tokenizer {json.dumps(pre)[:120]}"
        )
    return config


def rope_rows_interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder the rows of q_proj/k_proj (`heads` heads of d rows: d/2 first halves, then d/2 second halves) so that
    each head's rows pair up as (0, d/2), (1, d/2 + 1), ...: GGML's rotary layout."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def gguf_name(hf_name: str, tied: bool) -> str | None:
    """The GGUF tensor name of an HF LLaMA tensor (None: not stored)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return None if tied else "output.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] == "weight" and ".".join(parts[3:-1]) in LAYER_TENSORS:
        return f"blk.{parts[2]}.{LAYER_TENSORS['.'.join(parts[3:-1])]}.weight"
    raise ValueError(f"tensor {hf_name}: not part of a LLaMA model; expected the LLaMA architecture's tensors")


def vocabulary(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens as tokenizer.json spells them (byte-level strings), and their GGUF token types; embedding rows past
    the tokenizer (padding) become unused tokens."""
    import gguf

    spec = read_json(Path(model_dir) / "tokenizer.json")
    by_id = {i: token for token, i in spec["model"]["vocab"].items()}
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    by_id.update({i: t["content"] for i, t in added.items()})
    if max(by_id) >= vocab_size:
        raise ValueError(f"{model_dir}: the tokenizer has ids up to {max(by_id)}, the model only {vocab_size} rows")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _plan(model_dir: Path, config: dict, type_name: str) -> list[tuple[str, str, Path, tuple, str]]:
    """(gguf name, hf name, shard, shape, storage) for every stored tensor, from the shards' headers only."""
    from safetensors import safe_open

    tied = bool(config.get("tie_word_embeddings", False))
    plan = []
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = gguf_name(name, tied)
                if target is None:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                storage = "f32" if len(shape) == 1 else type_name
                if storage == "q8_0" and shape[-1] % Q8_BLOCK:
                    storage = "f16"
                plan.append((target, name, shard, shape, storage))
    if not plan:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights")
    return sorted(plan, key=lambda p: _order(p[0]))


def _order(name: str) -> tuple:
    """Embeddings, then blocks in order, then the output norm and head (as llama.cpp's files hold them)."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def _stored(array: np.ndarray, storage: str) -> tuple[np.ndarray, object]:
    """The bytes GGUF stores for one tensor, and its GGML type."""
    import gguf

    if storage == "f32":
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if storage == "f16":
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


def _nbytes(shape: tuple, storage: str) -> int:
    count = int(np.prod(shape))
    if storage == "q8_0":
        return count // Q8_BLOCK * Q8_BLOCK_BYTES
    return count * (4 if storage == "f32" else 2)


def _write_metadata(writer, model_dir: Path, config: dict, type_name: str) -> None:
    import gguf

    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(Path(model_dir).resolve().name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[type_name]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types = vocabulary(model_dir, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)  # merges, bos/eos/unk/pad ids, the chat template
    if "bos" not in special.add_special_token:
        writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)


def export_gguf(*, model_dir: Path, out: Path, type_name: str) -> dict:
    """Write `out` (atomically); returns what was written: tensors per storage type and the file's size."""
    import gguf
    from safetensors import safe_open

    config = check_exportable(model_dir, type_name)
    plan = _plan(model_dir, config, type_name)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    counts: dict[str, int] = {}
    with atomic_path(Path(out)) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch=ARCHITECTURES[config["model_type"]])
        _write_metadata(writer, model_dir, config, type_name)
        for target, _, _, shape, storage in plan:
            dtype = {"f32": np.float32, "f16": np.float16, "q8_0": np.uint8}[storage]
            byte_shape = (*shape[:-1], shape[-1] // Q8_BLOCK * Q8_BLOCK_BYTES) if storage == "q8_0" else shape
            raw = gguf.GGMLQuantizationType.Q8_0 if storage == "q8_0" else None
            writer.add_tensor_info(target, byte_shape, np.dtype(dtype), _nbytes(shape, storage), raw_dtype=raw)
            counts[storage] = counts.get(storage, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for target, name, shard, _, storage in plan:
            with safe_open(shard, "pt") as f:
                array = f.get_tensor(name).float().numpy()
            if target.endswith("attn_q.weight"):
                array = rope_rows_interleaved(array, heads)
            elif target.endswith("attn_k.weight"):
                array = rope_rows_interleaved(array, kv_heads)
            data, _ = _stored(array, storage)
            writer.write_tensor_data(data)
        writer.close()
    return {"tensors": counts, "bytes": Path(out).stat().st_size, "type": type_name}
