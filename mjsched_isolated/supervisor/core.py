"""Where ``Supervisor`` lived before the supervisor was split into parts (see the package docstring).

Kept so existing imports (``from mjsched_isolated.supervisor.core import Supervisor, utcnow``) go on
working; new code imports from :mod:`mjsched_isolated.supervisor`.
"""

from mjsched_isolated.supervisor.clock import utcnow
from mjsched_isolated.supervisor.inflight import InFlight
from mjsched_isolated.supervisor.loop import Supervisor

__all__ = ["InFlight", "Supervisor", "utcnow"]
