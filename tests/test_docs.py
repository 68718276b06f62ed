"""The README's links and commands, and the manual's plugin example, checked cheaply.

``mkdocs build --strict`` (run by ``.ci/run``, not here: it is slow) checks every link, anchor and API
reference of the manual itself.
"""

from __future__ import annotations

import http.server
import re
import socket
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from mjsched_isolated import JobContext, ScheduledJobResult
from mjsched_isolated.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose(markdown: str) -> str:
    """``markdown`` without its fenced code blocks."""
    return re.sub(r"(?ms)^```.*?^```", "", markdown)


def relative_links(markdown: str) -> list[str]:
    """The relative link targets (no URL scheme, no bare anchor) outside code blocks."""
    return [t for t in LINK.findall(prose(markdown)) if not SCHEME.match(t) and not t.startswith("#")]


def test_relative_links_finds_links_and_ignores_code_and_urls() -> None:
    text = "[a](docs/a.md#x) ![p](img.png) [u](https://x.org) [h](#top)\n```\n[c](code.md)\n```\n"
    assert relative_links(text) == ["docs/a.md#x", "img.png"]


def test_every_relative_link_in_the_readme_points_at_a_file() -> None:
    links = relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert links, "the README links into the manual"
    missing = [t for t in links if not (ROOT / t.partition("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_ci_runs_the_readmes_install_and_test_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    install = ci[ci.index("# README: install") + 1].strip()
    test = ci[ci.index("# README: test") + 2].strip()  # after the export of MJSCHED_REQUIRE_SERVERS
    assert install in readme and "docs" in install
    assert test in readme
    assert any("mkdocs build --strict" in line for line in ci)


def test_the_readmes_runs_list_samples_have_the_real_columns_and_its_logs_read_the_hello_run() -> None:
    """Fresh-clone review: the ``runs list`` samples lacked the ``attempt`` column, and ``runs logs 1`` read
    a sample job's run, not hello's (the sample jobs run first)."""
    from mjsched_isolated.cli.commands.runs import LIST_COLUMNS

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headers = [line.split() for line in readme.splitlines() if line.startswith("id  job_name")]
    assert headers and all(header == LIST_COLUMNS for header in headers), headers
    [ran] = re.findall(r"^run (\d+): Completed", readme, flags=re.MULTILINE)
    listing = readme.split("$ mjsched runs list --job hello")[1].split("$ ")[0]
    [hello_run] = re.findall(r"^(\d+) +hello ", listing, flags=re.MULTILINE)
    assert re.findall(r"^\$ mjsched runs logs (\d+)", readme, flags=re.MULTILINE) == [ran] == [hello_run]


# --- the plugin example of docs/plugins/writing.md ----------------------------------------------------

def example_module() -> types.ModuleType:
    """The first Python block under "## An example" in the plugin guide, executed as a module."""
    page = (ROOT / "docs" / "plugins" / "writing.md").read_text(encoding="utf-8")
    section = page.split("## An example", 1)[1]
    code = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    module = types.ModuleType("ping_example")
    exec(compile(code, "docs/plugins/writing.md", "exec"), module.__dict__)
    return module


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the overridden method's name
        pass


@pytest.fixture
def server_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def closed_url() -> str:
    with socket.socket() as sock:  # a port that was just free: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def run_example(url: str, retries: int) -> tuple[ScheduledJobResult, int]:
    """Run the example's ``execute`` once; return its result and how many heartbeats it sent."""
    module = example_module()
    plugin = module.Ping()
    configuration = plugin.parse_configuration(f'{{"url": "{url}", "retries": {retries}, "timeout_s": 5}}')
    plugin.validate_configuration(configuration)
    beats: list[None] = []
    context = JobContext(run_id=1, job_id=1, job_name="api", job_type="ping", configuration=configuration,
                         heartbeat=lambda: beats.append(None))
    result: ScheduledJobResult = plugin.execute(context)
    return result, len(beats)


def test_plugin_example_succeeds_with_no_retries(server_url: str) -> None:
    result, beats = run_example(server_url, retries=0)
    assert result.success and result.details == {"attempts": 1, "status": 200}
    assert beats == 1


@pytest.mark.parametrize("retries", [0, 2])
def test_plugin_example_fails_after_the_first_try_and_its_retries(closed_url: str, retries: int) -> None:
    result, beats = run_example(closed_url, retries=retries)
    assert not result.success and result.details == {"attempts": retries + 1}
    assert result.error_message and "refused" in result.error_message.lower()
    assert beats == retries + 1


def test_plugin_example_refuses_negative_retries() -> None:
    plugin = example_module().Ping()
    with pytest.raises(ConfigurationError, match=r"^configuration\.retries: must be >= 0$"):
        plugin.validate_configuration(plugin.parse_configuration('{"url": "http://x/", "retries": -1}'))


def test_the_configuration_guides_sample_file_is_a_valid_configuration(tmp_path: Path) -> None:
    """A new user's finding: the sample listed a key twice, so copied as a file it was refused."""
    from mjsched_isolated import config

    text = (ROOT / "docs" / "operating" / "configuration.md").read_text()
    sample = re.search(r"```toml\n(# mjsched.toml.*?)```", text, re.S)
    assert sample is not None
    path = tmp_path / "mjsched.toml"
    path.write_text(sample.group(1))
    config.build_settings(config.read_config_file(str(path)))
