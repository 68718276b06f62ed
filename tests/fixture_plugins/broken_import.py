"""A plugin module that fails at import: its job type is unavailable, the others keep working."""

from mjsched_isolated import BaseScheduledJob

raise ImportError("this plugin needs a library that is not installed")


class Never(BaseScheduledJob):
    job_type = "never"
