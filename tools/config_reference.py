"""Generate docs/configuration.md from conf/: every group's choices and every key with its default and the comment
beside it in the YAML (the single source; tests/unit/test_structure.py fails when the page drifts or a key has none).

    python -m tools.config_reference          # rewrite docs/configuration.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"
KEY = re.compile(r"^(\w+):\s*(?P<value>[^#]*?)\s*(?:#\s*(?P<comment>.*))?$")


def header(path: Path) -> str:
    """The comment lines a conf file opens with, as one sentence."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("# ").rstrip())
    return " ".join(lines)


def key_comments(path: Path) -> dict[str, str]:
    """{top-level key: its inline comment} of one conf file, following its `defaults` to the files it extends."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    comments: dict[str, str] = {}
    for parent in raw.get("defaults", []):
        if isinstance(parent, str) and parent != "_self_":
            comments.update(key_comments(path.parent / f"{parent}.yaml"))
    for line in path.read_text(encoding="utf-8").splitlines():
        match = KEY.match(line)
        if match and match[1] != "defaults" and match["comment"]:
            comments[match[1]] = match["comment"]
    return comments


def render(root: Path = REPO) -> str:
    """The Markdown page."""
    from pipeline.core.config import compose

    defaults = yaml.safe_load((root / "conf/config.yaml").read_text(encoding="utf-8"))["defaults"]
    chosen = {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items() if v is not None}
    composed = compose(root / "conf")
    lines = [
        "# Configuration reference",
        "",
        "Generated from `conf/` by `python -m tools.config_reference` (a test fails when this page drifts from the",
        "files). Set any key with `dvc exp run -S GROUP.KEY=VALUE`, pick a choice with `-S GROUP=CHOICE`, an",
        "experiment with `-S experiment=NAME`; `make params` writes the composition to `params.yaml`.",
        "",
    ]
    for group in (g for g in chosen if g != "experiment"):
        choices = sorted(p.stem for p in (root / "conf" / group).glob("*.yaml"))
        default = chosen[group]
        lines += [f"## `{group}`", "", header(root / "conf" / group / f"{default}.yaml"), ""]
        others = ", ".join(f"`{c}` ({header(root / 'conf' / group / f'{c}.yaml')})" for c in choices if c != default)
        lines += [f"Choices: `{default}` (default)" + (f"; {others}" if others else ""), ""]
        comments = key_comments(root / "conf" / group / f"{default}.yaml")
        lines += ["| key | default | meaning |", "|---|---|---|"]
        for key, value in composed[group].items():
            shown = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip().removesuffix("...")
            meaning = comments.get(key, "").replace("|", "\\|")
            lines.append(f"| `{group}.{key}` | `{shown.strip()}` | {meaning} |")
        lines.append("")
    lines += ["## `experiment`", "", "Bundles that list only what differs from the defaults.", ""]
    for path in sorted((root / "conf/experiment").glob("*.yaml")):
        lines.append(f"- `{path.stem}`: {header(path)}")
    return "\n".join(lines) + "\n"


def missing_comments(root: Path = REPO) -> list[str]:
    """Keys of the default choices that have no comment to explain them."""
    from pipeline.core.config import compose

    defaults = yaml.safe_load((root / "conf/config.yaml").read_text(encoding="utf-8"))["defaults"]
    chosen = {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items() if v is not None}
    composed = compose(root / "conf")
    missing = []
    for group, default in chosen.items():
        comments = key_comments(root / "conf" / group / f"{default}.yaml")
        missing += [f"{group}.{key}" for key in composed[group] if key not in comments]
    return missing


if __name__ == "__main__":
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(render(), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)}; keys without a comment: {missing_comments() or 'none'}")
    sys.exit(0)
