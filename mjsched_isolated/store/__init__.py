"""Every read and write of the database, in SQLAlchemy Core: jobs, runs, leases, supervisors, the
notification outbox. It records facts; it never formats notices or decides schedules."""

from mjsched_isolated.store.core import Claim, Store, is_permanent_error

__all__ = ["Claim", "Store", "is_permanent_error"]
