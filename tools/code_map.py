"""The layout describes itself: every module of pipeline/ is named on its package's front page (the `__init__`
docstring), and the README's code map is generated from those front pages (as docs/configuration.md is from conf/).

    python -m tools.code_map       # rewrites the code map between the README's markers; lists modules no page names
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- code map: generated from the packages' front pages by `python -m tools.code_map` -->"
END = "<!-- end of the code map -->"
NAMED = re.compile(r"`(\w+)`")
WIDTH = 120


def front_page(package: Path) -> str:
    """The docstring of `package`'s __init__.py ("" where there is none)."""
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""


def packages(root: Path = REPO) -> list[Path]:
    """pipeline/ and its packages, in the order of pipeline's layers (tools/layers.py)."""
    from tools.layers import ORDER

    return [root / "pipeline"] + [root / "pipeline" / name for name in ORDER]


def modules(package: Path) -> list[str]:
    """The modules of `package` (its .py files but __init__), by name."""
    return sorted(p.stem for p in package.glob("*.py") if p.name != "__init__.py")


def named(package: Path) -> list[str]:
    """The modules `package`'s front page names (as `module`), in the order it names them."""
    known = set(modules(package))
    return list(dict.fromkeys(n for n in NAMED.findall(front_page(package)) if n in known))


def missing(root: Path = REPO) -> list[str]:
    """Every module no front page names, as a path."""
    return [
        str((package / f"{name}.py").relative_to(root))
        for package in packages(root)
        for name in modules(package)
        if name not in named(package)
    ]


def summary(package: Path) -> str:
    """What the package is for: its front page's first clause (up to `;`, `:`, `.` or a parenthesis)."""
    text = " ".join(front_page(package).split())
    first = re.split(r"[;:.](?:\s|$)| \(", text, maxsplit=1)[0]
    return first[0].lower() + first[1:]


def render(root: Path = REPO) -> str:
    """The code map: each package with what it is for and its modules in its front page's order."""
    top, *rest = packages(root)
    lines = ["```", "pipeline/"]
    for package in rest:
        lines.append(f"├── {package.name + '/':<14} {summary(package)}")
        wrapped = textwrap.wrap(" ".join(named(package)), WIDTH - 8)
        lines += [f"│   └── {wrapped[0]}", *(f"│       {more}" for more in wrapped[1:])]
    lines.append(f"└── {' '.join(f'{n}.py' for n in named(top))}  above every package")
    lines.append("```")
    return "\n".join([BEGIN, *lines, END])


def rewrite(readme: Path) -> str:
    """`readme` with its code map generated again."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render(readme.parent) + text[end:]


def main() -> int:
    readme = REPO / "README.md"
    readme.write_text(rewrite(readme), encoding="utf-8")
    unnamed = missing()
    print("\n".join(f"{path}: not on its package's front page" for path in unnamed) or "every module is named")
    return 1 if unnamed else 0


if __name__ == "__main__":
    sys.exit(main())
