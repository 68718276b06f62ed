"""Typed for plugin authors: the plugin-writing examples in docs/plugins/writing.md type-check
under mypy, a misspelt configuration field is a mypy error, and the examples run (``retries = 0``
included, which raised UnboundLocalError in the old README example)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import serial
from plugin_helpers import run_job

from mjsched_isolated.worker.loader import load_plugins

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins" / "writing.md"


def _examples() -> dict[str, str]:
    """The guide's python blocks that define a job class, by the class they define."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
              if re.search(r"^class \w+\(BaseScheduledJob", b, re.MULTILINE)]
    assert len(blocks) == 2, blocks
    return {re.search(r"^class (\w+)\(BaseScheduledJob", b, re.MULTILINE).group(1): b for b in blocks}  # type: ignore[union-attr]


# The database and metrics libraries that the package imports are no part of a plugin's types: mypy does not
# follow them (they are Any), which spares it three quarters of its work (over 300 of some 600 modules)
MYPY_CONFIG = "[mypy]\n[mypy-sqlalchemy.*,psycopg.*,alembic.*,prometheus_client.*]\nfollow_imports = skip\n"


def _mypy(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    return subprocess.run(  # default mode; the errors of modules it imports are not this test's business
        [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"), "--follow-imports=silent",
         "--cache-dir", str(tmp_path / ".mypy_cache"), *(str(tmp_path / name) for name in files)],
        capture_output=True, text=True, timeout=55, cwd=ROOT, check=False)


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme_plugins")
    for cls, text in _examples().items():
        (folder / f"{cls.lower()}.py").write_text(text)
    registry = load_plugins(folder, builtins=False)
    assert registry.failures == []
    return registry.classes


@serial  # a whole mypy run takes a core for seconds: not beside a timing test (conftest)
def test_the_examples_type_check_and_a_misspelt_field_is_an_error(tmp_path):
    examples = _examples()
    wrong = re.sub(r"^( +)(config = context.configuration.*)$", r"\1\2\n\1print(config.urll)", examples["Ping"],
                   count=1, flags=re.MULTILINE)
    assert wrong != examples["Ping"]
    proc = _mypy(tmp_path, {"disk_usage.py": examples["DiskUsageJob"], "ping.py": examples["Ping"],
                            "ping_wrong.py": wrong})
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, proc.stdout + proc.stderr  # the two README examples themselves are clean
    assert errors[0].startswith(str(tmp_path / "ping_wrong.py"))
    assert '"Config" has no attribute "urll"' in errors[0]


def test_configuration_type_is_inferred_from_the_generic_parameter(plugins):
    ping = plugins["ping"]
    assert ping.configuration_type is not None and ping.configuration_type.__name__ == "Config"
    assert ping.parse_configuration('{"url": "file:///x", "retries": 0}').retries == 0


def test_the_retrying_example_works_with_no_retries(plugins, tmp_path):
    target = tmp_path / "up.txt"
    target.write_text("up")
    up = run_job(plugins["ping"], {"url": target.as_uri(), "retries": 0})
    down = run_job(plugins["ping"], {"url": (tmp_path / "gone.txt").as_uri(), "retries": 0})
    retried = run_job(plugins["ping"], {"url": (tmp_path / "gone.txt").as_uri(), "retries": 2})
    assert (up.success, up.details["attempts"]) == (True, 1)
    assert (down.success, down.details) == (False, {"attempts": 1}) and "gone.txt" in down.error_message
    assert retried.details == {"attempts": 3}
    json.dumps(retried.details)


def test_the_disk_usage_example_runs(plugins, tmp_path):
    result = run_job(plugins["disk_usage"], {"path": str(tmp_path), "max_used_percent": 100})
    assert result.success and result.details["path"] == str(tmp_path)
