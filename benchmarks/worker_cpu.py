"""Worker CPU per trivial run: one real worker child, N runs of a plugin that returns at once; the
worker's own CPU time (user + system, from the kernel) divided by N, minus the plugin's (measured in
the plugin itself is not needed: the plugin does nothing). Prints ms per run and the load average.

    python benchmarks/worker_cpu.py [--runs 500]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from worker_helpers import OneWorker

PLUGIN = '''
from mjsched_isolated.api import BaseScheduledJob, ScheduledJobResult


class Noop(BaseScheduledJob):
    job_type = "bench_noop"

    def execute(self, context):
        return ScheduledJobResult(success=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "noop.py").write_text(PLUGIN)
        with OneWorker(folder) as one:
            proc = psutil.Process(one.worker.pid)
            for _ in range(50):  # warm up
                one.run("bench_noop")
            before = proc.cpu_times()
            wall = time.perf_counter()
            for _ in range(args.runs):
                one.run("bench_noop")
            wall = time.perf_counter() - wall
            after = proc.cpu_times()
    cpu_s = (after.user - before.user) + (after.system - before.system)
    print(f"worker CPU per trivial run: {cpu_s / args.runs * 1000:.3f} ms "
          f"(wall per round trip {wall / args.runs * 1000:.3f} ms, {args.runs} runs, "
          f"load average {os.getloadavg()[0]:.2f}, {len(psutil.pids())} processes on the host)")


if __name__ == "__main__":
    main()
