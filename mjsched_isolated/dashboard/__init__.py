"""The web dashboard (``mjsched dashboard``, the ``dashboard`` extra): jobs, runs and supervisors of one
database, live; run now, pause, resume and edit; safe by default.

:mod:`.app` (routes, actions, live updates), :mod:`.data` (what each page shows), :mod:`.auth` (roles,
sessions, CSRF), :mod:`.charts` (SVG), :mod:`.openapi` (the API's schema), :mod:`.server` (the process).
Reads go through :mod:`mjsched_isolated.store.dashboard_views` and the :class:`Store`; actions through
:mod:`mjsched_isolated.ops`, like the CLI.
"""
