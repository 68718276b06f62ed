"""mjsched_isolated: a cron-job scheduler whose plugins run in pooled, killable child processes.

Public names for plugin authors and embedders. Importing this package never imports plugins.
"""

from .api import BaseScheduledJob, JobContext, NotificationContent, ScheduledJobResult
from .cron import next_run_time
from .errors import ConfigurationError, CronError, InputError, MjschedError

__version__ = "0.1.0"

__all__ = [
    "BaseScheduledJob",
    "ConfigurationError",
    "CronError",
    "InputError",
    "JobContext",
    "MjschedError",
    "NotificationContent",
    "ScheduledJobResult",
    "next_run_time",
    "__version__",
]
