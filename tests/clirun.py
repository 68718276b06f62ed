"""Run ``mjsched`` in this process: ``main(argv)`` with captured output, a clean ``MJSCHED_*`` environment
and the test's folder as working directory (a cold subprocess costs ~1 s of imports per command)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

import pytest

from mjsched_isolated.cli import main


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


class Cli:
    """``cli(*args, expect=0, env=None)`` runs one command and asserts its exit code."""

    def __init__(self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cwd: Path,
                 env: dict[str, str] | None = None) -> None:
        self.capsys, self.monkeypatch = capsys, monkeypatch
        for key in [k for k in os.environ if k.startswith("MJSCHED_")]:
            monkeypatch.delenv(key)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(cwd)

    def __call__(self, *args: str, expect: int | None = 0, env: dict[str, str] | None = None) -> Result:
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level  # main() configures logging: put pytest's back
        self.capsys.readouterr()
        try:
            with self.monkeypatch.context() as patch:
                for key, value in (env or {}).items():
                    patch.setenv(key, value)
                try:
                    code = main(list(args))
                except SystemExit as exc:  # argparse: --help, or a usage error
                    code = int(exc.code or 0)
        finally:
            for handler in list(root.handlers):
                root.removeHandler(handler)
            for handler in handlers:
                root.addHandler(handler)
            root.setLevel(level)
        out, err = self.capsys.readouterr()
        result = Result(code, out, err)
        if expect is not None:
            assert code == expect, result
        return result


def error_line(result: Result) -> str:
    """The one non-empty line of stderr (asserts there is exactly one)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]
