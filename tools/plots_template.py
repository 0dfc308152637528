"""`dvc plots show` offline: DVC's page loads Vega from a CDN, so without the internet it is blank. This writes an HTML
template with Vega, Vega-Lite and Vega-Embed inlined (the versions DVC's page names, from the npm registry, checked
against the registry's sha512) and points DVC at it in .dvc/config.local. `make setup` runs it.

    python -m tools.plots_template
"""

from __future__ import annotations

import base64
import hashlib
import io
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from pipeline.core.environment import with_venv_path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / ".venv" / "dvc_plots_template.html"
LIBRARIES = (  # (name, version, file in the package, sha512 of the package as the registry lists it)
    ("vega", "5.20.2", "build/vega.min.js",
     "qmH7aD9GGPpssVdxL1xgcdxTbQzyRUeRR16Os385ymvQhiwCYQNA6+eXUPAZDTVLfk0RXu6Jzj6kUE5jQ80EVw=="),
    ("vega-lite", "5.2.0", "build/vega-lite.min.js",
     "Yxcg8MvYfxHcG6BbkaKT0oVCIMIcE19UvqIsEwBmyd/7h2nzW7oRnID81T8UrY7hpDrIr6wa2JADOT2dhGNErw=="),
    ("vega-embed", "6.18.2", "build/vega-embed.min.js",
     "wcDyQPE4J5aiCDc3/suH5RQDvrKkjuLkhzUcbOLwEkNF8/+pp17tS0JghzEvAPNRg+5aG1/N2ydixq8Lk3dOlg=="),
)  # fmt: skip
PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <title>DVC plots (offline)</title>
    SCRIPTS
    <style>table {{ border-spacing: 15px; }}</style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def library(name: str, version: str, member: str, sha512: str) -> str:
    """One library's minified script, from its npm package, checked."""
    url = f"https://registry.npmjs.org/{name}/-/{name}-{version}.tgz"
    with urllib.request.urlopen(url, timeout=60) as response:
        package = response.read()
    if base64.b64encode(hashlib.sha512(package).digest()).decode() != sha512:
        raise ValueError(f"{url}: sha512 differs from the pinned one")
    with tarfile.open(fileobj=io.BytesIO(package)) as archive:
        return archive.extractfile(f"package/{member}").read().decode("utf-8")


def write_template(out: Path = TEMPLATE) -> None:
    scripts = "\n".join(f"<script>{library(*entry)}</script>" for entry in LIBRARIES)
    page = PAGE.replace("{{", "{").replace("}}", "}").replace("SCRIPTS", scripts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    command = ["dvc", "config", "--local", "plots.html_template", str(out)]
    subprocess.run(command, cwd=REPO, check=True, env=with_venv_path())


if __name__ == "__main__":
    try:
        write_template()
    except (OSError, subprocess.CalledProcessError) as err:  # no registry: DVC's own page, drawn from a CDN
        print(f"plots template: not written ({err}); `dvc plots show` will need the internet", file=sys.stderr)
    else:
        print(f"plots template: {TEMPLATE} (dvc plots show works offline)")
