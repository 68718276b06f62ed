"""A run's captured output in the ``run_output`` table (and ``plugins reload`` requests,
:class:`PluginReloads`): ordered chunks of text, written as the worker
sends them (about once a second while the run writes), read back in order by ``runs logs`` and
:meth:`mjsched_isolated.client.Client.run_logs`.

Each chunk is at most :data:`OUTPUT_CHUNK_BYTES` of UTF-8, well under MariaDB/MySQL's 65,535-byte TEXT;
longer text is split here (on character boundaries) so callers may hand over any length. Rows go with
their run: ``ON DELETE CASCADE`` and, for databases or connections without foreign-key enforcement,
:meth:`RunOutput.delete_for_runs` called by retention and job removal in the same transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from mjsched_isolated.store.records import PluginReloadRow
from mjsched_isolated.store.schema import db_now, plugin_reloads, run_output

OUTPUT_CHUNK_BYTES = 16_000  # of UTF-8 per row: a U+FFFD stands for one bad byte in 3, so raw 16 KB fits too


def split_text(text: str, limit: int = OUTPUT_CHUNK_BYTES) -> list[str]:
    """``text`` cut into pieces of at most ``limit`` UTF-8 bytes each, never inside a character; NUL
    (which PostgreSQL refuses in TEXT) becomes U+FFFD. Empty text gives no piece."""
    text = text.replace("\x00", "\ufffd")
    pieces: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + limit)  # a character is at least one byte: never more than limit chars
        while len(text[start:end].encode("utf-8")) > limit:
            end = start + max(1, (end - start) * 3 // 4)
        pieces.append(text[start:end])
        start = end
    return pieces


class RunOutput:
    """Reads and writes of ``run_output``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def append(self, run_id: int, first_seq: int, texts: Iterable[str], now: dt.datetime) -> int:
        """Store ``texts`` (each split by :func:`split_text`) as rows ``first_seq``, ``first_seq + 1``, ...
        of run ``run_id``, in one transaction. Returns the next free ``seq``. Raises SQLAlchemy errors
        (e.g. ``IntegrityError`` if the run does not exist)."""
        rows = []
        seq = first_seq
        for text in texts:
            for piece in split_text(text):
                rows.append({"run_id": run_id, "seq": seq, "data": piece, "created_at": now})
                seq += 1
        if rows:
            with self.engine.begin() as conn:
                conn.execute(run_output.insert(), rows)
        return seq

    def read(self, run_id: int, after_seq: int = -1) -> list[tuple[int, str]]:
        """``(seq, text)`` of run ``run_id``'s chunks after ``after_seq``, in order (all by default)."""
        query = (sa.select(run_output.c.seq, run_output.c.data)
                 .where(run_output.c.run_id == run_id, run_output.c.seq > after_seq).order_by(run_output.c.seq))
        with self.engine.connect() as conn:
            return [(seq, data) for seq, data in conn.execute(query)]

    @staticmethod
    def delete_for_runs(conn: Connection, run_ids: sa.Select | list[int]) -> None:
        """Delete the output of ``run_ids`` (a list or a subquery of run ids) inside ``conn``'s transaction:
        what the foreign key's cascade does, for connections that do not enforce foreign keys."""
        conn.execute(run_output.delete().where(run_output.c.run_id.in_(run_ids)))


class PluginReloads:
    """``plugins reload`` requests (table ``plugin_reloads``): the CLI adds one, every supervisor reads the
    newest id at its renewal interval and replaces its workers when it grew."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def request(self, requested_by: str) -> PluginReloadRow:
        """Add a request (stamped with the database clock) and delete the older ones; returns it."""
        with self.engine.begin() as conn:
            key = conn.execute(plugin_reloads.insert().values(
                requested_at=db_now(self.engine.dialect.name), requested_by=requested_by[:255])).inserted_primary_key
            assert key is not None
            conn.execute(plugin_reloads.delete().where(plugin_reloads.c.id < key[0]))
            row = conn.execute(sa.select(plugin_reloads).where(plugin_reloads.c.id == key[0])).mappings().one()
        return PluginReloadRow(id=row["id"], requested_at=row["requested_at"], requested_by=row["requested_by"])

    def latest(self) -> int:
        """The newest request's id (0: none yet)."""
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.coalesce(sa.func.max(plugin_reloads.c.id), 0))).scalar_one()
