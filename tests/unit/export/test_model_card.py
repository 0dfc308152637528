"""Model cards: the Hugging Face format (YAML header, Markdown body) with the data, the config that produced the model,
its figures and the commands that load it; nothing that changes from one identical run to the next."""

from __future__ import annotations

import yaml

from pipeline.core import config
from pipeline.export import model_card
from tests.conftest import REPO

DATASET = {
    "documents": 120, "tokens": 5000, "train_rows": 70, "validation_rows": 8, "masked_fraction": 0.0,
    "sources": {  # as dataset.json holds them: by name, sorted
        "enwiki_train": {"file": "data/corpus/enwiki_train.txt", "planned_share": 0.25, "realised_share": 0.2519},
        "peoples_daily_train": {
            "file": "data/corpus/peoples_daily_train.txt", "planned_share": 0.75, "realised_share": 0.7481,
        },
    },
}  # fmt: skip
TRAINING = {"steps": 20, "val_loss": 2.645785, "val_perplexity": 14.094501, "tokens_per_s": 154.6, "precision": "bf16"}


def _parts(card: str) -> tuple[dict, str]:
    _, header, body = card.split("---\n", 2)
    return yaml.safe_load(header), body


def test_adapter_card_has_the_format_and_the_facts():
    params = config.validate(config.compose(REPO / "conf", ["experiment=cpt_mix"])).model_dump()
    card = model_card.render(kind="adapter", params=params, dataset=DATASET, training=TRAINING)
    header, body = _parts(card)
    assert header["base_model"] == params["model"]["path"] and header["library_name"] == "peft"
    assert header["license"] == "other" and {"lora", "peft", "data-text"} <= set(header["tags"])
    config_block = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(config_block) == {k: params[k] for k in model_card.CONFIG_SECTIONS}
    assert "| enwiki_train | `data/corpus/enwiki_train.txt` | text | 1.0 | 0.25 | 0.2519 |" in body
    assert "| peoples_daily_train | `data/corpus/peoples_daily_train.txt` | text | 3.0 | 0.75 | 0.7481 |" in body
    assert "| val_loss | 2.645785 |" in body and "tokens_per_s" not in body, "no timings: a re-run writes the same"
    assert 'PeftModel.from_pretrained(base, "artifacts/adapter")' in body
    assert card == model_card.render(kind="adapter", params=params, dataset=DATASET, training=TRAINING)


def test_merged_card_and_the_vocabulary_extension(tmp_path):
    params = config.validate(config.compose(REPO / "conf", ["experiment=extend_vocab"])).model_dump()
    merge = {"max_abs_logit_diff": 3.1e-05, "mean_kl": 1.8e-09, "vocab_rows": 56704}
    card = model_card.render(kind="merged", params=params, dataset=DATASET, training=TRAINING, merge=merge)
    header, body = _parts(card)
    assert header["library_name"] == "transformers" and "merged" in header["tags"]
    assert "| max_abs_logit_diff | 3.1e-05 |" in body and 'from_pretrained("artifacts/merged")' in body
    adapter = model_card.render(kind="adapter", params=params, dataset=DATASET, training=TRAINING)
    assert "resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)" in adapter
    model_card.write(tmp_path, card)
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == card


def test_card_for_publishing_carries_the_evaluation_tables(tmp_path):
    """`python -m pipeline card` renders a card with eval.json's tables (bits per byte, task scores)."""
    import subprocess
    import sys

    from pipeline.core.atomic import write_json

    params = config.compose(REPO / "conf", ["experiment=sft_reviews"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    write_json(tmp_path / "metrics/dataset.json", {"documents": 4000, "tokens": 10, "sources": {}})
    write_json(tmp_path / "metrics/train.json", TRAINING)
    scores = {"acc": 0.93, "acc_stderr": 0.025643, "samples": 100}
    eval_json = {
        "in_domain": {"base": {"bits_per_byte": 0.9, "perplexity": 3.2}},
        "tasks": {"reviews_sentiment_mc": {"adapter": scores}},
    }
    write_json(tmp_path / "metrics/eval.json", eval_json)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "card", "--kind", "adapter", "--out", str(tmp_path / "README.md"),
         "--params", str(tmp_path / "params.yaml"), "--metrics", str(tmp_path / "metrics")],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    card = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "with the evaluation tables" in done.stdout
    assert "| in_domain | base | 0.9 | 3.2 |" in card
    assert "| reviews_sentiment_mc | adapter | acc | 0.93 | 0.025643 | 100 |" in card


def test_the_card_says_what_the_adapter_was_trained_for_and_from_what():
    def body(*overrides: str) -> str:
        params = config.validate(config.compose(REPO / "conf", list(overrides))).model_dump()
        return _parts(model_card.render(kind="adapter", params=params, dataset=DATASET, training=TRAINING))[1]

    assert "Next-token prediction on the data above (`train.objective: lm`)." in body()
    assert "against the base with the adapter disabled as the reference (`train.objective: dpo`)" in body(
        "experiment=dpo_reviews"
    )
    started = body("experiment=dpo_reviews", "train.init_adapter=sft/adapter", "train.reference=precomputed")
    assert (
        "starting from the adapter `sft/adapter` (`train.init_adapter`) against that adapter's model as the " in started
    )
