"""The commands the README and docs/ show still compose, and the README's figures still match their records.

Every `make prepare …`, `make preflight …`, `make pretrain …` and `make finetune …` line in README.md and
docs/*.md (in a code block or inline code) is turned into the Hydra overrides the Makefile's target builds
from its variables (BATCH, OPT, MODEL, DATA, TASK, ARGS, …) and composed against conf/ with the target's
schema, so a documented override that drifts from the schema fails here. No training, no data needed.
The README's headline figures each carry an HTML comment naming their record; they must equal what
docs/hooks.py (the docs site's figure hook) reads from results/bench/*.json.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass, field

import pytest
from hydra import compose, initialize_config_dir

from data.config import REPO_ROOT

DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
TARGETS = ("prepare", "preflight", "pretrain", "finetune")
# one `make <target> …` command: up to the end of a code span or line, a shell comment, or `[`/`(` prose
COMMAND = re.compile(r"make (?P<target>" + "|".join(TARGETS) + r")\b(?P<rest>[^`\n]*)")
# TASK=glue: the Makefile's GLUE_TASKS, one composition each
MAKEFILE = (REPO_ROOT / "Makefile").read_text()
GLUE_TASKS = re.findall(r"^GLUE_TASKS\s*\?=\s*(\S+)", MAKEFILE, re.M)[0].split(",")
# `CKPT=...`, `NPROC=<world size>`: not a value to compose (a variable takes the Makefile's default, an
# ARGS override is left out)
PLACEHOLDER = re.compile(r"…|\.\.\.|<[^>]*>")


@dataclass
class Documented:
    where: str
    target: str
    variables: dict[str, str]
    args: list[str] = field(default_factory=list)


def _split(rest: str) -> list[str]:
    """The command's words, without a trailing shell comment or prose."""
    words: list[str] = []
    for word in shlex.split(rest, comments=True):
        if not re.fullmatch(r"[A-Z_]+=.*", word):
            break  # `make finetune TASK=squad [CKPT=…]`, `# comment`: the command has ended
        words.append(word)
    return words


FENCE = re.compile(r"^```[^\n]*\n(?P<body>.*?)^```", re.M | re.S)
INLINE = re.compile(r"`(?P<body>[^`]+)`")


def _snippets(text: str) -> list[tuple[int, str]]:
    """(line number, code): each line of the fenced code blocks (backslash continuations joined) and each
    inline code span (which may wrap over lines in the Markdown source)."""
    snippets = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start("body")) + 1
        for offset, line in enumerate(block.group("body").replace("\\\n", " ").splitlines()):
            snippets.append((first + offset, line))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in INLINE.finditer(prose):
        snippets.append((prose.count("\n", 0, span.start()) + 1, span.group("body").replace("\n", " ")))
    return snippets


def documented_commands() -> list[Documented]:
    found = []
    for path in DOCUMENTS:
        for number, code in _snippets(path.read_text()):
            for match in COMMAND.finditer(code):
                where = f"{path.relative_to(REPO_ROOT)}:{number}"
                try:  # a placeholder (`<world size>`) is one word: a value the test does not compose
                    words = _split(re.sub(r"<[^<>]*>", "…", match.group("rest")))
                except ValueError as error:  # an unbalanced quote: a broken command line
                    raise AssertionError(f"{where}: {match.group(0)}: {error}") from None
                where += f": make {match.group('target')} {' '.join(words)}".rstrip()
                variables = dict(word.split("=", 1) for word in words)
                args = shlex.split(variables.pop("ARGS", ""))
                found.append(Documented(where, match.group("target"), variables, args))
    return found


COMMANDS = documented_commands()


def _value(variables: dict[str, str], name: str, default: str | None) -> str | None:
    value = variables.get(name)
    return default if value is None or PLACEHOLDER.search(value) else value


def _overrides(command: Documented) -> list[tuple[str, list[str]]]:
    """(config name, overrides) as the Makefile's target builds them (one per GLUE task for TASK=glue)."""
    v, args = command.variables, [a for a in command.args if not PLACEHOLDER.search(a.split("=", 1)[-1])]
    if command.target == "prepare":
        return [("prepare", [f"data={_value(v, 'DATA', 'sample')}", *args])]
    if command.target in ("pretrain", "preflight"):
        batch = _value(v, "BATCH", "demo")
        demo = batch == "demo"
        model = _value(v, "MODEL", "bert_tiny" if demo else "bert_large")
        data = _value(v, "DATA", "tiny" if demo else "wikipedia_bookcorpus")
        overrides = [f"batch={batch}", f"optim={_value(v, 'OPT', 'lamb')}", f"model={model}"]
        overrides += [f"data_dir=data/prepared/{data}"]
        if command.target == "preflight" and _value(v, "NPROC", None):
            overrides.append(f"dry_run_world_size={v['NPROC']}")
        return [("pretrain", overrides + args)]
    task = _value(v, "TASK", "mrpc")
    tasks = GLUE_TASKS if task == "glue" else [task]
    model_path = _value(v, "CKPT", "results/runs/a-run")
    return [("finetune", [f"task={name}", f"model_path={model_path}", *args]) for name in tasks]


def test_the_documents_show_the_headline_commands():
    targets = {command.target for command in COMMANDS}
    assert {"prepare", "pretrain", "finetune"} <= targets, targets
    readme = [c for c in COMMANDS if c.where.startswith("README.md")]
    assert any(c.target == "pretrain" and c.variables.get("OPT") == "onebit_lamb" for c in readme)


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_a_documented_command_composes(command: Documented):
    from data.config import to_object as prepare_object
    from finetune.config import to_object as finetune_object
    from pretrain.config import to_object as pretrain_object

    unknown = set(command.variables) - {"DATA", "BATCH", "OPT", "MODEL", "NPROC", "TASK", "CKPT", "FT_NPROC"}
    assert not unknown, f"{command.where}: variables the Makefile's target does not read: {sorted(unknown)}"
    to_object = {"prepare": prepare_object, "pretrain": pretrain_object, "finetune": finetune_object}
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        for config_name, overrides in _overrides(command):
            try:
                to_object[config_name](compose(config_name=config_name, overrides=overrides))
            except Exception as error:  # the message names the command that drifted
                raise AssertionError(f"{command.where}: {overrides}: {error}") from error


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO_ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


README_FIGURE = re.compile(r"(?P<shown>[−-]?[\d.,]+%?)(?P<tail>[^<\d]*)<!-- figure\((?P<args>.*?)\) -->")


def test_the_readme_figures_match_their_records():
    hooks = _hooks()
    figures = list(README_FIGURE.finditer((REPO_ROOT / "README.md").read_text()))
    assert len(figures) >= 6
    for match in figures:
        read = hooks.render(match.group("args"))
        shown = match.group("shown").replace("−", "-")  # the README's minus sign is typographic
        assert shown == read, f"README shows {match.group('shown')}, the record holds {read}"
