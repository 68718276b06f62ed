"""Per-run resource accounting: the CPU time and peak memory a run used, measured by its real worker
child (mjsched_isolated.worker.accounting), recorded with the run and shown by `runs show`, `runs list
--json`, the Client and the dashboard's run page. Figures are CPU time and memory, never wall time."""

from __future__ import annotations

import json

import pytest
from clirun import Cli
from conftest import FIXTURE_PLUGINS, add_job
from worker_helpers import OneWorker

from mjsched_isolated import protocol
from mjsched_isolated.client import Client

YEARLY = "0 0 1 1 *"


def _finished(one: OneWorker, **config: object) -> protocol.RunFinished:
    finished = one.run("burn", json.dumps(config))[-1]
    assert isinstance(finished, protocol.RunFinished) and finished.success, finished
    return finished


def test_a_run_records_its_cpu_time_and_peak_memory_and_the_next_run_starts_from_zero():
    with OneWorker(FIXTURE_PLUGINS) as one:
        heavy = _finished(one, cpu_s=0.3, alloc_mb=100)
        assert heavy.cpu_s is not None and heavy.cpu_s >= 0.2
        assert heavy.max_rss_mb is not None and heavy.max_rss_mb >= 90
        light = _finished(one)  # same worker: the peak and the CPU count were reset for this run
        assert light.cpu_s is not None and light.cpu_s < 0.2
        assert light.max_rss_mb is not None and light.max_rss_mb < heavy.max_rss_mb - 50
        failed = one.run("boom")[-1]  # a plugin that raises: its run is measured all the same
        assert isinstance(failed, protocol.RunFinished) and not failed.success
        assert failed.cpu_s is not None and failed.max_rss_mb is not None


def test_a_waited_for_child_commands_cpu_and_peak_memory_count_for_the_run():
    with OneWorker(FIXTURE_PLUGINS) as one:
        _finished(one)  # the worker's own peak stays low in the measured run
        finished = _finished(one, child_cpu_s=0.3, child_alloc_mb=150)
        assert finished.cpu_s is not None and finished.cpu_s >= 0.2
        assert finished.max_rss_mb is not None and finished.max_rss_mb >= 140


@pytest.fixture
def cli(db_url, tmp_path, capsys, monkeypatch) -> Cli:
    return Cli(capsys, monkeypatch, tmp_path, {"MJSCHED_DATABASE_URL": db_url, "MJSCHED_PLUGINS_DIR": FIXTURE_PLUGINS})


def test_the_figures_are_recorded_with_the_run_and_shown_everywhere(store, driver_factory, db_url, cli):
    d = driver_factory(max_concurrent_jobs=1)
    add_job(store, "burner", "burn", YEARLY, configuration=json.dumps({"cpu_s": 0.3, "alloc_mb": 100}))
    d.until(lambda: any(r["status"] != "Running" for r in store.list_runs(job_name="burner")))
    (run,) = store.list_runs(job_name="burner")
    assert run["status"] == "Completed", run
    assert run["cpu_s"] >= 0.2 and run["max_rss_mb"] >= 90

    listed = json.loads(cli("runs", "list", "--job", "burner", "--json").stdout)
    assert (listed[0]["cpu_s"], listed[0]["max_rss_mb"]) == (run["cpu_s"], run["max_rss_mb"])
    shown = cli("runs", "show", str(run["id"])).stdout
    assert any(line.split()[:1] == ["cpu_s"] and float(line.split()[-1]) == pytest.approx(run["cpu_s"], abs=0.05)
               for line in shown.splitlines()), shown
    assert any(line.split()[:1] == ["max_rss_mb"] for line in shown.splitlines()), shown
    with Client(db_url, plugins_dir=FIXTURE_PLUGINS) as client:
        got = client.get_run(run["id"])
    assert (got.cpu_s, got.max_rss_mb) == (run["cpu_s"], run["max_rss_mb"])


def test_the_dashboards_run_page_shows_the_figures(store, driver_factory):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from mjsched_isolated.config import build_settings
    from mjsched_isolated.dashboard.app import create_app

    d = driver_factory(max_concurrent_jobs=1)
    add_job(store, "burner", "burn", YEARLY, configuration=json.dumps({"alloc_mb": 100}))
    add_job(store, "quiet", "ok", YEARLY)
    d.until(lambda: all(r["status"] != "Running" for name in ("burner", "quiet")
                        for r in store.list_runs(job_name=name)) and len(store.list_runs()) == 2)
    burner, = store.list_runs(job_name="burner")
    settings = build_settings({"database_url": d.settings.database_url, "plugins_dir": FIXTURE_PLUGINS})
    with TestClient(create_app(settings, store, poll_s=0.05), base_url="http://127.0.0.1") as client:
        page = client.get(f"/runs/{burner['id']}").text
    assert f"{burner['cpu_s']:.2f} s CPU, peak {burner['max_rss_mb']:.0f} MB" in page
