"""Plugins for the dashboard's tests: one whose error and details carry script, one that sleeps."""

import time

import msgspec

from mjsched_isolated import BaseScheduledJob, ScheduledJobResult

PAYLOAD = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"


class Hostile(BaseScheduledJob):
    job_type = "hostile"
    description = "fails with script in its error message and details"

    def execute(self, context):
        return ScheduledJobResult(success=False, error_message=PAYLOAD, details={"html": PAYLOAD})


class NapConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    seconds: float = 0.5


class Nap(BaseScheduledJob):
    job_type = "nap"
    configuration_type = NapConfig
    description = "succeeds after sleeping `seconds`"

    def execute(self, context):
        time.sleep(context.configuration.seconds)
        return ScheduledJobResult(success=True, details={"slept_s": context.configuration.seconds})
