"""Every read and write of the database, in SQLAlchemy Core: jobs, runs, leases, supervisors, the
notification outbox, behind the :class:`Store` facade (:mod:`.facade` says which module owns what). It
records facts; it never formats notices or decides schedules."""

from mjsched_isolated.store.errors import is_permanent_error
from mjsched_isolated.store.facade import Store
from mjsched_isolated.store.records import (
                                            AbandonedRun,
                                            Claim,
                                            InflightRun,
                                            JobRow,
                                            LateResult,
                                            NextDueJob,
                                            NotificationRow,
                                            OutboxRow,
                                            PluginReloadRow,
                                            RecentFailure,
                                            RunOutputRow,
                                            RunRow,
                                            RunView,
                                            SupervisorRow,
                                            SupervisorStatus,
)

__all__ = ["AbandonedRun", "Claim", "InflightRun", "JobRow", "LateResult", "NextDueJob", "NotificationRow", "OutboxRow",
           "PluginReloadRow", "RecentFailure", "RunOutputRow", "RunRow", "RunView", "Store", "SupervisorRow",
           "SupervisorStatus", "is_permanent_error"]
