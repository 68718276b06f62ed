"""Test plugins that report facts about the worker they run in (modules, RSS), or misuse its stdout.

Kept free of heavy imports: the module list and RSS they report are a worker's own."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import psutil

from mjsched_isolated import BaseScheduledJob, JobContext, ScheduledJobResult


class Empty(msgspec.Struct, forbid_unknown_fields=True):
    pass


class ReportModules(BaseScheduledJob[Empty]):
    job_type = "report_modules"
    description = "reports sys.modules, its pid and RSS"

    def execute(self, context: JobContext[Empty]) -> ScheduledJobResult:
        proc = psutil.Process()
        return ScheduledJobResult(success=True, details={
            "modules": sorted(sys.modules), "pid": os.getpid(), "rss_bytes": proc.memory_info().rss,
            "main": getattr(sys.modules.get("__mp_main__") or sys.modules["__main__"], "__file__", None)})


class PrintStdout(BaseScheduledJob[Empty]):
    job_type = "print_stdout"
    description = "writes to stdout three ways: print, os.write(1) and a subprocess inheriting fd 1"

    def execute(self, context: JobContext[Empty]) -> ScheduledJobResult:
        print("PLUGIN-PRINT {not json", flush=True)
        os.write(1, b"PLUGIN-FD1 ]\n")
        subprocess.run(["echo", "PLUGIN-SUBPROCESS"], check=True)
        return ScheduledJobResult(success=True, details={"printed": True})
