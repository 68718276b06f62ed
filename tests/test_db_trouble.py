"""Database trouble that must not go unnoticed: a database that refuses writes (a read-only SQLite file or
URL, a PostgreSQL session whose transactions are read-only, as on a hot standby). ``serve`` says why, once,
and exits 1 instead of doing nothing and exiting 0; ``status`` warns.

(A SQLite file deleted under a running supervisor, and a failing poll logged once, are in test_supervisor.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa
from clirun import Cli
from conftest import FIXTURE_PLUGINS, add_job, isolated_database

from mjsched_isolated.store import Store


def _read_only(backend: str, url: str, tmp_path) -> str:
    if backend == "sqlite":
        return f"sqlite:///file:{tmp_path / 'mjsched.db'}?mode=ro&uri=true"
    parsed = sa.engine.make_url(url)
    options = parsed.query.get("options", "")
    return parsed.update_query_dict({"options": f"{options} -cdefault_transaction_read_only=on".strip()}
                                    ).render_as_string(hide_password=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_read_only_database_is_reported_by_serve_and_status(backend, tmp_path, capsys, monkeypatch):
    with isolated_database(backend, tmp_path) as url:
        with Store.open(url) as store:
            add_job(store, "due", "ok", "* * * * * *")
            assert store.read_only_reason() is None
        ro = _read_only(backend, url, tmp_path)
        with Store.open(ro) as store:
            reason = store.read_only_reason()
            assert reason is not None and ("readonly" in reason or "read-only" in reason)
        cli = Cli(capsys, monkeypatch, tmp_path)
        result = cli("status", "--db", ro)
        assert "WARNING the database refuses writes" in result.stdout
        proc = subprocess.run([sys.executable, "-m", "mjsched_isolated", "serve", "--db", ro, "--plugins",
                               FIXTURE_PLUGINS, "--run-for", "3"], capture_output=True, text=True, timeout=45,
                              cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert proc.stderr.count("lease renewal failed (the database refuses writes (read-only)") == 1
        assert "stopped without ever registering with the database" in proc.stderr
        assert "started: job" not in proc.stderr  # nothing ran
