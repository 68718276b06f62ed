"""Output: tables, ``key value`` listings and JSON, with terminal-safe cells.

Anything a plugin or a user wrote (error messages, details, names) passes through :func:`cell` before it
reaches a terminal: control characters become ``?`` so ANSI escape codes cannot repaint it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from mjsched_isolated.isotime import iso

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # terminal escapes and the like (not tab or newline)


def print_json(value: Any) -> None:
    """``value`` as one JSON document on stdout (datetimes ISO-8601 UTC with ``Z``, Structs as objects)."""
    sys.stdout.write(msgspec.json.encode(value, enc_hook=str).decode() + "\n")


def fmt(value: Any) -> str:
    """A value as text: datetimes ``YYYY-MM-DDTHH:MM:SSZ``, floats with one decimal, None as ``-``,
    dicts and lists as compact JSON."""
    if isinstance(value, dt.datetime):
        return iso(value, timespec="seconds")
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)
    return "-" if value is None else str(value)


def safe(text: str) -> str:
    """``text`` with control characters (ANSI escapes, NUL, carriage returns) replaced by ``?``; tabs
    and newlines are kept."""
    return _CONTROL.sub("?", text)


_TERMINAL_CONTROL = re.compile(r"\r(?!\n)|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # CR of a CRLF kept


def visible(text: str) -> str:
    r"""A run's output for a terminal: each control character (an ANSI escape's ESC, a lone carriage
    return, a C1 code such as CSI ``\x9b``) shown as a ``\xNN`` escape, as systemd escapes them, so the
    output cannot move the cursor, retitle or reset the terminal. Newlines, tabs and line-ending carriage
    returns are kept; every other character is left as it is."""
    return _TERMINAL_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def cell(value: Any) -> str:
    """A table cell: one line (a multi-line error shows its lines joined by " | "), tabs as spaces, and no
    control characters (a plugin's ANSI colour codes must not repaint the terminal)."""
    text = safe(fmt(value).replace("\t", " "))
    return " | ".join(line.strip() for line in text.splitlines() if line.strip()) if "\n" in text else text


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Print ``rows`` as aligned columns under a header line."""
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def listing(row: Mapping[str, Any], width: int = 30) -> None:
    """Print one record as ``key value`` lines; every value terminal-safe (multi-line text indented)."""
    for key, value in row.items():
        text = safe(fmt(value))
        print(f"{key:{width}} " + text.replace("\n", "\n" + " " * (width + 1)))


def error(message: str) -> None:
    """One ``error: ...`` line on stderr."""
    print(f"error: {safe(message)}", file=sys.stderr)


def note(message: str) -> None:
    """One ``note: ...`` line on stderr (stdout stays for results and JSON)."""
    print(f"note: {safe(message)}", file=sys.stderr)
