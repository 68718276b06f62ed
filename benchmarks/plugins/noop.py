"""Benchmark plugin: does nothing and reports when ``execute`` began (epoch seconds, in the worker)."""

import time

from mjsched_isolated import BaseScheduledJob, ScheduledJobResult


class Noop(BaseScheduledJob):
    job_type = "noop"
    description = "does nothing; details.plugin_started_at is when execute began"

    def execute(self, context):
        return ScheduledJobResult(success=True, details={"plugin_started_at": time.time()})
