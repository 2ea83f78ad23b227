"""MkDocs hook: current figures read from results/bench/*.json at build time, never copied by hand.

A page writes `{{ figure("fidelity", "final_mlm_loss_ratio_onebit_lamb_n2_s32", "ratio", ".3f") }}`:
the record of that name in results/bench/fidelity.json, its field (`value`, `ratio`, `peer_value`, or
`config.<key>`), formatted with the Python format spec. Alternatives separated by `|` name the same figure
under an older or newer record name (the first that exists wins). `invert=True` prints 1/x (e.g. "x times
fewer bytes" from a bytes ratio). A record or field that does not exist fails the build (mkdocs.yml wires
this file in as `hooks:`), so a page cannot show a figure that the committed JSON no longer holds.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

try:
    from mkdocs.exceptions import PluginError
except ImportError:  # the tests read figures through this module without the docs extra installed

    class PluginError(Exception):  # type: ignore[no-redef]
        """What mkdocs raises to fail a build."""


BENCH = Path(__file__).resolve().parent.parent / "results" / "bench"
FIGURE = re.compile(r"\{\{\s*figure\((?P<args>.*?)\)\s*\}\}")
_cache: dict[str, dict[str, dict[str, Any]]] = {}


def _records(bench: str) -> dict[str, dict[str, Any]]:
    if bench not in _cache:
        path = BENCH / f"{bench}.json"
        if not path.is_file():
            raise PluginError(f"figure: {path} does not exist")
        _cache[bench] = {record["name"]: record for record in json.loads(path.read_text())}
    return _cache[bench]


def figure(bench: str, names: str, field: str = "value", fmt: str = ".3g", invert: bool = False) -> str:
    records = _records(bench)
    name = next((n for n in names.split("|") if n in records), None)
    if name is None:
        raise PluginError(f"figure: no record {names!r} in results/bench/{bench}.json")
    record = records[name]
    container, key = (
        (record.get("config") or {}, field[len("config.") :])
        if field.startswith("config.")
        else (record, field)
    )
    if container.get(key) is None:
        raise PluginError(f"figure: record {name!r} in results/bench/{bench}.json has no {field!r}")
    value = container[key]
    if isinstance(value, (int, float)):
        return format(1.0 / value if invert else value, fmt)
    return str(value)


def render(arguments: str) -> str:
    """The figure for the text between `figure(` and `)`: Python literals, positional or by keyword."""
    call = ast.parse(f"figure({arguments})", mode="eval").body
    assert isinstance(call, ast.Call)
    args = [ast.literal_eval(arg) for arg in call.args]
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    return figure(*args, **kwargs)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    try:
        return FIGURE.sub(lambda match: render(match.group("args")), markdown)
    except PluginError as error:
        raise PluginError(f"{page.file.src_path}: {error}") from None
