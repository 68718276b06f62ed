"""The supervisor side of the process boundary: the loop, dispatch, recording, the pool of worker
children, the liveness lease, notifications, metrics and retention. It never imports plugin code."""

from mjsched_isolated.supervisor.core import Supervisor, utcnow

__all__ = ["Supervisor", "utcnow"]
