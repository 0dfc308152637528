"""Tokenizer loading, training and Chinese-LLaMA-style vocabulary extension (SentencePiece and byte-level BPE)."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.atomic import read_json

SP_MODEL = "tokenizer.model"
HF_TOKENIZER = "tokenizer.json"
META = "pipeline_tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
FILES = (HF_TOKENIZER, SP_MODEL, *CONFIG_FILES)  # what travels with checkpoints and adapters
TEKKEN = "tekken.json"  # Mistral's own tokenizer format (mistral-common)
BPE_FILES = ("vocab.json", "merges.txt")  # GPT-2-style tokenizers saved without tokenizer.json


def find_tokenizer(folders: list[Path | None]) -> Path | None:
    """The first of `folders` that holds tokenizer files (None entries skipped), else None."""
    markers = (HF_TOKENIZER, SP_MODEL, "tokenizer_config.json", BPE_FILES[0])
    return next((Path(f) for f in folders if f is not None and any((Path(f) / m).is_file() for m in markers)), None)


def load_tokenizer(path: Path, gguf_file: str | None = None):
    """Load an HF tokenizer and refuse one that loads empty (transformers 5 can build those silently). For a
    Mistral-family config transformers first probes mistral-common's backend, importing the package's optional
    dependencies (tiktoken) even with `mistral_format=False` (transformers 5.23); where that import fails and the
    folder has no `tekken.json` (the only file that backend reads), the folder loads again past the probe (the
    `fix_mistral_regex` argument skips it, False being its default behaviour)."""
    from transformers import AutoTokenizer

    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: tokenizer folder not found")
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
        except ImportError as err:
            if gguf_file is None and (Path(path) / TEKKEN).is_file():
                raise ValueError(f"{TEKKEN} needs mistral-common with its dependencies ({err})") from None
            tokenizer = AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file, fix_mistral_regex=False)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: cannot load a tokenizer ({err})") from None
    if len(tokenizer) == 0 or not tokenizer("a b", add_special_tokens=False).input_ids:
        raise ValueError(
            f"{path}: tokenizer loads empty ({len(tokenizer)} entries); expected {HF_TOKENIZER} or "
            f"{SP_MODEL} with tokenizer_config.json"
        )
    return tokenizer


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class LightTokenizer:
    """The Rust tokenizer with the special tokens and chat template of its folder: what encoding training data needs
    (duck-typed as an HF tokenizer for `encoding.tokenize_documents` and `examples.sft_arrays`), without transformers'
    tokenizer classes (which import torch: 300 MB per process)."""

    backend_tokenizer: object
    special_tokens: dict[str, str]  # name (bos_token, ...) -> token, as HF's special_tokens_map
    chat_template: str | None

    def _id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def apply_chat_template(
        self,
        conversation: list,
        *,
        tools: list | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
    ):
        """The conversation (a list of messages), or each of a batch of them, rendered as transformers renders it
        (same renderer, same variables)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        assert not tokenize, "renders text only"
        batched = bool(conversation) and isinstance(conversation[0], list | tuple)
        chats = [
            [{k: v for k, v in m.items() if v is not None} for m in chat]
            for chat in (conversation if batched else [conversation])
        ]
        rendered, _ = render_jinja_template(
            conversations=chats,
            chat_template=self.chat_template,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        return rendered if batched else rendered[0]


@contextmanager
def template_refusals():
    """Chat templates render in transformers' jinja sandbox (an ImmutableSandboxedEnvironment: a template may
    format messages, never call into Python); what the sandbox refuses, or a template that does not parse, ends as
    bad input naming the chat template instead of a traceback. Nothing else here renders a template."""
    import jinja2.exceptions

    try:
        yield
    except jinja2.exceptions.SecurityError as err:
        raise ValueError(
            f"chat template: refused by the sandbox it renders in ({err}); a chat template may format messages, "
            "never reach Python objects: expected the tokenizer's own template (tokenizer_config.json or "
            "chat_template.jinja) without that expression"
        ) from None
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"chat template: cannot be rendered ({type(err).__name__}: {err})") from None


def light_tokenizer(folder: Path) -> LightTokenizer | None:
    """The folder's tokenizer.json, special tokens and chat template, where transformers reads them as they are
    written (tokenizer_config.json names the special tokens, overrides no BOS/EOS adding, holds at most one chat
    template; no special_tokens_map.json); None otherwise (load the HF tokenizer)."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    path, config_path = folder / HF_TOKENIZER, folder / CONFIG_FILES[0]
    if not (path.is_file() and config_path.is_file()) or (folder / CONFIG_FILES[1]).is_file():
        return None
    config = read_json(config_path)
    if {"add_bos_token", "add_eos_token"} & config.keys() or "eos_token" not in config:
        return None
    special = {}
    for name in SPECIAL_TOKENS:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None:
            special[name] = str(token)
    template_file = folder / CONFIG_FILES[2]
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    if template is not None and not isinstance(template, str):
        return None  # named templates: transformers chooses among them
    light = LightTokenizer(Tokenizer.from_file(str(path)), special, template)
    return light if light.eos_token_id is not None else None


def model_tokenizer(source: Path, memo: Path | None = None):
    """The tokenizer of a model source: an HF folder's (the Rust tokenizer alone where it reads as transformers reads
    it: no torch imported), or a .gguf file's (read from the file once, then from its copy in the folder `memo`, kept
    with the file's path, size and time: the file's tokenizer takes seconds to read)."""
    source = Path(source)
    if source.is_dir():
        light = light_tokenizer(source)
        if light is not None and not light.backend_tokenizer.encode("a b", add_special_tokens=False).ids:
            raise ValueError(f"{source}: tokenizer loads empty; expected {HF_TOKENIZER} with a vocabulary")
        return light or load_tokenizer(source)
    stat = source.stat()
    key = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    if memo is not None and (memo / MEMO_KEY).is_file() and (memo / MEMO_KEY).read_text(encoding="utf-8") == key:
        return light_tokenizer(memo) or load_tokenizer(memo)
    tokenizer = load_tokenizer(source.parent, gguf_file=source.name)
    if memo is not None:
        from pipeline.core.atomic import atomic_path

        with atomic_path(memo) as tmp:
            tokenizer.save_pretrained(str(tmp))
            (tmp / MEMO_KEY).write_text(key, encoding="utf-8")
    return tokenizer


MEMO_KEY = "source.txt"


def vocabulary_size(folder: Path) -> int:
    """len(tokenizer) without loading it: the highest id in tokenizer.json (vocabulary and added tokens) + 1;
    folders with only a SentencePiece model are loaded."""
    path = Path(folder) / HF_TOKENIZER
    if not path.is_file():
        return len(load_tokenizer(folder))
    data = read_json(path)
    vocab = data["model"]["vocab"]
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
    return max([*ids, *(t["id"] for t in data.get("added_tokens", []))]) + 1


def save_tokenizer(tokenizer, dst: Path, source: Path) -> None:
    """save_pretrained, keeping the SentencePiece model beside it when the source has one."""
    tokenizer.save_pretrained(str(dst))
    if source.is_dir() and (source / SP_MODEL).is_file():
        shutil.copy2(source / SP_MODEL, dst / SP_MODEL)


def tokens_per_char(tokenizer, texts: list[str], *, batch: int = 1024) -> float:
    """Tokens (no special tokens) per character over `texts`: the tokenizer's fertility (encoded `batch` texts at a
    time, so that the encodings of one batch exist at once)."""
    chars = sum(len(t) for t in texts)
    if chars == 0:
        raise ValueError("tokens_per_char: no text to measure")
    tokens = 0
    for start in range(0, len(texts), batch):
        encodings = tokenizer.backend_tokenizer.encode_batch_fast(
            texts[start : start + batch], add_special_tokens=False
        )
        tokens += sum(len(e.ids) for e in encodings)
    return tokens / chars


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def first_chars(texts: Iterable[str], max_chars: int) -> list[str]:
    """The leading texts, `max_chars` characters in all (the last one cut short): what a vocabulary is learned on."""
    kept, budget = [], max_chars
    for text in texts:
        if budget <= 0:
            break
        kept.append(text[:budget])
        budget -= len(text)
    return kept


def train_sentencepiece(texts: Iterable[str], *, vocab_size: int, model_type: str, character_coverage: float) -> bytes:
    """Train a SentencePiece model in memory; returns the serialized ModelProto."""
    import sentencepiece as spm

    out = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=out,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            normalization_rule_name="identity",
            max_sentence_length=1 << 16,
            split_digits=True,
            hard_vocab_limit=False,
            num_threads=2,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise ValueError(
            f"tokenizer.vocab_size / tokenizer.character_coverage: SentencePiece refused them: {err}"
        ) from None
    return out.getvalue()


def sentencepiece_type(model: bytes) -> str:
    """'bpe', 'unigram', 'word' or 'char': the algorithm of a serialized SentencePiece model."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    proto.ParseFromString(model)
    return sp_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()


def extend_sentencepiece(base: bytes, learned: bytes) -> tuple[bytes, int]:
    """Append the learned model's normal pieces the base lacks, scored below every base piece (ids unchanged)."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    base_proto, new_proto = sp_pb2.ModelProto(), sp_pb2.ModelProto()
    base_proto.ParseFromString(base)
    new_proto.ParseFromString(learned)
    known = {p.piece for p in base_proto.pieces}
    lowest = min(p.score for p in base_proto.pieces)
    added = 0
    for piece in new_proto.pieces:
        if piece.type != sp_pb2.ModelProto.SentencePiece.NORMAL or piece.piece in known:
            continue
        added += 1
        base_proto.pieces.add(piece=piece.piece, score=lowest - added, type=piece.type)
        known.add(piece.piece)
    return base_proto.SerializeToString(), added


def learn_byte_level_merges(base_json: dict, texts: Iterable[str], vocab_size: int) -> list[list[str]]:
    """Train a BPE with the base's normalizer and byte-level pre-tokenizer; return its merges in order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    work = Tokenizer.from_str(json.dumps(base_json))
    work.model = models.BPE()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    work.train_from_iterator(texts, trainer)
    return [list(m) if isinstance(m, list) else m.split(" ") for m in json.loads(work.to_str())["model"]["merges"]]


def extend_byte_level(base_json: dict, merges: list[list[str]]) -> tuple[dict, int]:
    """Append merges whose result the base lacks; BPE ranks them after every base merge, so ids never move."""
    extended = json.loads(json.dumps(base_json))
    vocab: dict[str, int] = extended["model"]["vocab"]
    next_id = 1 + max([*vocab.values(), *(t["id"] for t in extended.get("added_tokens", []))])
    added = 0
    for left, right in merges:
        token = left + right
        if token in vocab or left not in vocab or right not in vocab:
            continue
        vocab[token] = next_id + added
        extended["model"]["merges"].append([left, right])
        added += 1
    return extended, added


def tokenizer_kind(folder: Path) -> str:
    """'sentencepiece' or 'byte_level_bpe': the two layouts this module can extend."""
    if (folder / SP_MODEL).is_file():
        return "sentencepiece"
    tokenizer_json = folder / HF_TOKENIZER
    if tokenizer_json.is_file():
        spec = read_json(tokenizer_json)
        if spec["model"]["type"] == "BPE" and "ByteLevel" in json.dumps(spec.get("pre_tokenizer")):
            return "byte_level_bpe"
    raise ValueError(
        f"{folder}: cannot extend this tokenizer; expected {SP_MODEL} (SentencePiece) or a byte-level BPE "
        f"{HF_TOKENIZER}"
    )


def write_extended(
    base_dir: Path, out_dir: Path, texts: list[str], *, vocab_size: int, model_type: str, character_coverage: float
) -> int:
    """Write the extended HF tokenizer folder into `out_dir` (which must not exist) as transformers' save_pretrained
    writes it; return pieces added. A byte-level BPE whose files read as transformers reads them (`light_tokenizer`)
    is written by the Rust tokenizer alone, byte for byte what transformers would write (no torch imported: 3 s of
    CPU); otherwise the folder goes through transformers."""
    kind = tokenizer_kind(base_dir)
    out_dir.mkdir(parents=True)
    for name in CONFIG_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, out_dir / name)
    if kind == "sentencepiece":
        base = (base_dir / SP_MODEL).read_bytes()
        if sentencepiece_type(base) != model_type:
            raise ValueError(
                f"tokenizer.model_type: the base SentencePiece model is {sentencepiece_type(base)}; expected the "
                f"same, got {model_type!r}"
            )
        learned = train_sentencepiece(
            texts, vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage
        )
        merged, added = extend_sentencepiece(base, learned)
        (out_dir / SP_MODEL).write_bytes(merged)
        (out_dir / "learned_sentencepiece.model").write_bytes(learned)
    else:
        if model_type != "bpe":
            raise ValueError(
                f"tokenizer.model_type: a byte-level BPE base can only be extended with merges, expected 'bpe', "
                f"got {model_type!r}"
            )
        from tokenizers import Tokenizer

        base_json = read_json(base_dir / HF_TOKENIZER)
        merges = learn_byte_level_merges(base_json, texts, vocab_size)
        extended, added = extend_byte_level(base_json, merges)
        Tokenizer.from_str(json.dumps(extended, ensure_ascii=False)).save(str(out_dir / HF_TOKENIZER))
        if light_tokenizer(out_dir) is not None:
            return added
    # Round-trip through transformers so the folder holds what AutoTokenizer reads (tokenizer.json included).
    load_tokenizer(out_dir).save_pretrained(str(out_dir))
    return added
