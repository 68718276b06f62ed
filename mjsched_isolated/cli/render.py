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

# Unicode's format characters (category Cf: bidi overrides and isolates such as U+202E, zero-width ones, the
# soft hyphen, tags) and its line and paragraph separators (Zl, Zp): invisible, yet they reorder or hide what a
# terminal shows (a "Trojan Source" line). As of Unicode 15; tests/test_run_output.py checks the list against
# the running Python's unicodedata.
_FORMAT = ("\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u2028-\u202e"
           "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
           "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f")
# terminal escapes and the like (not tab or newline), and the format characters
_CONTROL = re.compile(f"[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f{_FORMAT}]")


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
    """``text`` with control characters (ANSI escapes, NUL, carriage returns) and Unicode format characters
    (bidi overrides, zero-width ones) replaced by ``?``; tabs and newlines are kept."""
    return _CONTROL.sub("?", text)


_TERMINAL_CONTROL = re.compile(f"\\r(?!\\n)|[\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f-\\x9f{_FORMAT}]")  # CRLF's CR kept


def visible(text: str) -> str:
    r"""A run's output for a terminal: each control character (an ANSI escape's ESC, a lone carriage
    return, a C1 code such as CSI ``\x9b``) shown as a ``\xNN`` escape, as systemd escapes them, so the
    output cannot move the cursor, retitle or reset the terminal; each Unicode format character (a bidi
    override such as U+202E, a zero-width one) or line separator as ``\uNNNN`` (``\UNNNNNNNN``), so it cannot
    reorder or hide text. Newlines, tabs and line-ending carriage returns are kept; every other character
    is left as it is."""
    return _TERMINAL_CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


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
