"""The built-in job types: ``shell``, ``http_check``, ``file_retention``, ``sqlite_backup`` and
``python_callable`` (documented in this folder's README.md).

Every worker child loads them (:func:`mjsched_isolated.worker.loader.load_plugins`), with or without a
local plugins folder; a local plugin may override one by ``job_type``, with a warning. Only worker
children import these modules: importing this package imports none of them.
"""
