"""Compatibility: the store was split into modules (see :mod:`mjsched_isolated.store.facade`). Import
``Store``, ``Claim`` and ``is_permanent_error`` from :mod:`mjsched_isolated.store`."""

from mjsched_isolated.store.errors import is_permanent_error
from mjsched_isolated.store.facade import Store
from mjsched_isolated.store.records import Claim

__all__ = ["Claim", "Store", "is_permanent_error"]
