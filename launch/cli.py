"""One-line errors for the Hydra entry points, with a debug switch that shows the full traceback.

    if __name__ == "__main__":
        cli.run(main, "pretrain")          # main: the @hydra.main-decorated function
    ...
    except (DataError, ValueError) as error:
        cli.fail("pretrain", error)        # inside main: a user error, one line, exit 2

A user error on the command line (an unknown option or key, a value of the wrong type, an override that
does not parse) reaches Hydra's composition, which by default prints several lines (the options, the config
search path, a hint) and exits 1. `run` has Hydra raise instead (HYDRA_FULL_ERROR=1 for Hydra itself) and
prints `<prog>: error: <one line>` to stderr, exit code 2, as the mains do for their own errors (`fail`).
Any other exception is a bug and keeps its traceback.

Debug switch: the override `debug=true` (taken off the command line before Hydra parses it; no config has
that key) or HYDRA_FULL_ERROR=1 set by the user: nothing is condensed, every error raises with its full
traceback. It is kept in the environment, so torchrun's workers and child processes inherit it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

FULL_ERROR = "HYDRA_FULL_ERROR"
# Set beside HYDRA_FULL_ERROR=1 when `run` set it for Hydra only: then it does not mean "debug" (to this
# process's `fail` and to child processes, which inherit both).
CONDENSED = "BERT_LAMB_ONE_LINE_ERRORS"
EXIT_CODE = 2
_DEBUG_OVERRIDE = re.compile(r"\+{0,2}debug=(true|false|1|0|yes|no|on|off)", re.IGNORECASE)
_AVAILABLE = "available options in "
_DROPPED_LINES = re.compile(r"(object_type|reference_type)=|See https?://|.*HYDRA_FULL_ERROR")


def debug_enabled() -> bool:
    """True when errors must keep their traceback: `debug=true`, or HYDRA_FULL_ERROR=1 set by the user."""
    return os.environ.get(FULL_ERROR) == "1" and os.environ.get(CONDENSED) != "1"


def take_debug_switch(argv: list[str]) -> bool | None:
    """Remove `debug=<bool>` overrides from `argv` (in place); the last one's value, or None if none."""
    value: bool | None = None
    for argument in list(argv[1:]):
        match = _DEBUG_OVERRIDE.fullmatch(argument)
        if match:
            argv.remove(argument)
            value = match.group(1).lower() in ("true", "1", "yes", "on")
    return value


def run(main: Callable[[], Any], prog: str) -> None:
    """Call the Hydra-decorated `main` with the command line; a Hydra or OmegaConf error (a user error) is
    one line `<prog>: error: ...` on stderr and exit code 2, unless the debug switch is on."""
    switch = take_debug_switch(sys.argv)
    debug = debug_enabled() if switch is None else switch
    if debug:
        os.environ.pop(CONDENSED, None)
    else:
        os.environ[CONDENSED] = "1"
    os.environ[FULL_ERROR] = "1"  # Hydra raises instead of printing its multi-line report
    try:
        main()
    except (HydraException, OmegaConfBaseException) as error:
        if debug:
            raise
        print(f"{prog}: error: {condense(error)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CODE)


def fail(prog: str, error: BaseException) -> NoReturn:
    """A main's user error (bad config, data or checkpoint): `<prog>: error: <error>` and exit code 2, or,
    with the debug switch on, the error re-raised with its traceback."""
    if debug_enabled():
        raise error
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CODE)


def first_line(error: BaseException) -> str:
    """The error's message's first line, or its type's name when the message is empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def condense(error: BaseException) -> str:
    """One line from a Hydra/OmegaConf error and its causes: without the config search path, the
    HYDRA_FULL_ERROR hint, `object_type=` lines and documentation links; "Available options in 'optim':"
    and its option lines become "available options in 'optim': adamw, lamb" (schemas left out)."""
    head = _lines(str(error))
    causes: list[str] = []
    cause = error.__cause__
    while cause is not None:
        causes += _lines(str(cause))
        cause = cause.__cause__
    lines = [*head[:1], *causes, *head[1:]] or [type(error).__name__]  # a cause explains the first line
    options = [line for line in lines if line.startswith(_AVAILABLE)]
    parts = [line for line in lines if line not in options]
    keys = [line for line in parts if line.startswith("full_key:")]
    parts = [line for line in parts if line not in keys]
    parts += [key for key in keys if not _named(key, " ".join(parts))]
    text = parts[0] if parts else type(error).__name__
    for index, line in enumerate(parts[1:]):
        separator = ": " if index == 0 and (causes or not text.endswith(".")) else "; "
        text = f"{text.rstrip('.')}{separator}{_lower_first(line)}"
    for line in options:
        text = f"{text.rstrip('.')}; {line}"
    override = getattr(error, "override", None)  # OverrideParseException: not always named in its message
    if isinstance(override, str) and override not in text:
        text = f"Error parsing override '{override}': {_lower_first(text)}"
    return text


def _lines(message: str) -> list[str]:
    """The message's meaningful lines, stripped; an options block joined into one line."""
    lines: list[str] = []
    options_of: str | None = None
    options: list[str] = []
    for raw in message.splitlines():
        line = raw.strip()
        if raw.startswith("Config search path:"):
            break
        if options_of is not None and raw.startswith("\t"):
            if not line.endswith("_schema"):
                options.append(line)
            continue
        if options_of is not None:
            lines.append(f"{_AVAILABLE}{options_of}: {', '.join(options)}")
            options_of = None
        match = re.fullmatch(r"Available options in (.*):", line)
        if match:
            options_of, options = match.group(1), []
            continue
        if not line or _DROPPED_LINES.match(line):
            continue
        lines.append(line)
    if options_of is not None:
        lines.append(f"{_AVAILABLE}{options_of}: {', '.join(options)}")
    return lines


def _named(full_key_line: str, text: str) -> bool:
    """Whether a `full_key: a.b[0].c` line repeats a key the text names already (then it is noise)."""
    key = full_key_line.removeprefix("full_key:").strip()
    return not key or re.split(r"[.\[\]]", key.rstrip("]"))[-1] in text


def _lower_first(line: str) -> str:
    """'Key x not in ...' -> 'key x not in ...'; leaves acronyms and names ('EQUAL', 'TrainConfig')."""
    word = line.split(" ", 1)[0]
    if len(word) > 1 and word[0].isupper() and word[1:].islower():
        return line[0].lower() + line[1:]
    return line
