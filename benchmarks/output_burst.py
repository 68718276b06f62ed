"""The supervisor's memory around a run that prints a burst (issue 14: "a plugin printing 100 MB leaves
the supervisor's RSS within 5 MB of its baseline"). Not a test: prints one JSON object.

Starts ``serve`` on a fresh SQLite file with one worker and a plugin that writes ``--mb`` MB to fd 1, runs a
quiet job first (every code path warmed), reads the supervisor's RSS, runs the burst, reads it again.

    python benchmarks/output_burst.py [--mb 100]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from mjsched_isolated.store import Store

PLUGIN = '''
import os
import msgspec
from mjsched_isolated import BaseScheduledJob, ScheduledJobResult


class Config(msgspec.Struct, kw_only=True):
    mb: int = 0


class Burst(BaseScheduledJob[Config]):
    job_type = "burst"

    def execute(self, context):
        line = b"x" * 1023 + b"\\n"
        for _ in range(context.configuration.mb * 1024):
            os.write(1, line)
        return ScheduledJobResult(success=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plugins = Path(tmp, "plugins")
        plugins.mkdir()
        (plugins / "burst.py").write_text(PLUGIN)
        url = f"sqlite:///{tmp}/m.db"
        store = Store.open(url)
        proc = subprocess.Popen([sys.executable, "-m", "mjsched_isolated", "serve", "--db", url, "--plugins",
                                 str(plugins), "--max-concurrent-jobs", "1"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        lines: list[str] = []

        def wait_for(pattern: str) -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(line)
                if re.search(pattern, line):
                    return
            raise SystemExit(f"serve ended before {pattern!r}:\n{''.join(lines[-20:])}")

        def run(name: str, mb: int) -> float:
            now = dt.datetime.now(dt.UTC)
            store.add_job({"name": name, "job_type": "burst", "cron_expression": "0 0 1 1 *", "status": "Active",
                           "next_run_at": now, "configuration": json.dumps({"mb": mb})}, now)
            started = time.monotonic()
            wait_for(rf"run \d+ finished: job {name} ")
            return time.monotonic() - started

        try:
            wait_for("job types available")
            supervisor = psutil.Process(proc.pid)
            run("warm", 1)
            run("warm2", 1)
            before = supervisor.memory_info().rss
            burst_s = run("burst", args.mb)
            after = supervisor.memory_info().rss
            run_id = store.list_runs(job_name="burst")[0]["id"]
            stored = sum(len(text.encode()) for _, text in store.run_output(run_id))
        finally:
            proc.terminate()
            proc.wait(30)
            store.close()
        leaked = [line for line in lines if "xxxxxxxx" in line]
        print(json.dumps({"burst_mb": args.mb, "supervisor_rss_before_mb": round(before / 2**20, 2),
                          "supervisor_rss_after_mb": round(after / 2**20, 2),
                          "rss_delta_mb": round((after - before) / 2**20, 2), "burst_run_s": round(burst_s, 2),
                          "stored_output_bytes": stored, "supervisor_log_lines_with_output": len(leaked),
                          "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
