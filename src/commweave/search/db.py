"""The program database: one SQLite file per run (WAL), one committed transaction per program.

Every evaluated program is committed before the search proposes the next, so a `kill -9` at any
moment loses at most the evaluation in flight; reopening continues the run (ids and generations
go on from where they stopped). Tables:

- `run`: the run's metadata as key -> JSON (workload, shape, gpus, budget, seed, created_at, ...)
- `programs`: code, its hash, directive set (JSON) and its key, parent ids (JSON), island,
  generation, status ('ok' | 'failed'), fitness, failure class and message, timings
  (JSON: candidate/baseline medians, floor, compile and evaluation seconds), proposer, cost ($),
  created_at
- `migrations`: a program copied to another island (it is not evaluated again)
- `llm_calls`: one row per LLM request attempt (`commweave.llm.CallRecord`: model, purpose,
  outcome, tokens, cost, latency, error message), plus one row per response the search could not
  use (outcome 'malformed:<kind>' with the parse error; its tokens and cost are on the attempt's
  own 'ok' row) or rejected as a duplicate; `program_id` links a proposal's rows to the program it
  produced. Each insert also sets the run's `llm_spent_usd` to the table's sum, in one transaction.

Writes are serialised by a lock: LLM calls are recorded from the threads that make them.
Tables are created if missing, so databases of older runs open unchanged. Readers (report,
export) open the file read-only (`readonly=True`): nothing is written, and a file that is not a
run database is a ValueError naming it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS programs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    code TEXT NOT NULL,
    code_hash TEXT NOT NULL,
    directives TEXT,
    directive_key TEXT,
    parents TEXT NOT NULL DEFAULT '[]',
    island INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    status TEXT NOT NULL,
    fitness REAL NOT NULL DEFAULT 0,
    failure TEXT,
    message TEXT NOT NULL DEFAULT '',
    timings TEXT NOT NULL DEFAULT '{}',
    proposer TEXT NOT NULL DEFAULT '',
    cost REAL NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS programs_island ON programs (island);
CREATE INDEX IF NOT EXISTS programs_code ON programs (code_hash);
CREATE TABLE IF NOT EXISTS migrations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    program_id INTEGER NOT NULL REFERENCES programs (id),
    from_island INTEGER NOT NULL,
    to_island INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS llm_calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    purpose TEXT NOT NULL,
    outcome TEXT NOT NULL,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cost REAL NOT NULL DEFAULT 0,
    latency_s REAL NOT NULL DEFAULT 0,
    message TEXT NOT NULL DEFAULT '',
    program_id INTEGER REFERENCES programs (id),
    created_at TEXT NOT NULL
);
"""


def code_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class ProgramRecord:
    id: int
    code: str
    code_hash: str
    directives: dict[str, Any] | None
    directive_key: str | None
    parents: list[int]
    island: int
    generation: int
    status: str
    fitness: float
    failure: str | None
    message: str
    timings: dict[str, Any]
    proposer: str
    cost: float
    created_at: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _open_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection to an existing run database (`mode=ro`: the file is never written or
    created); FileNotFoundError if absent, ValueError if it is not SQLite, is corrupt, or lacks the
    run's tables (an empty file is an empty SQLite database: no tables). Without a `-wal` file (no
    writer, or one that closed cleanly) the database is opened `immutable`, so SQLite creates no
    `-wal`/`-shm` files beside it either; a writer that starts meanwhile appends to a new WAL, which
    leaves the main file as read."""
    if not path.is_file():
        raise FileNotFoundError(f"no run database at {path}")
    wal = path.with_name(path.name + "-wal")
    uri = f"{path.resolve().as_uri()}?mode=ro" + ("" if wal.exists() else "&immutable=1")
    conn = sqlite3.connect(uri, uri=True, timeout=30, check_same_thread=False)
    try:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        missing = [t for t in ("run", "programs") if t not in tables]
        if missing:
            raise ValueError(f"{path} is not a commweave run database (no {' or '.join(missing)} table)")
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise ValueError(f"{path} is a corrupt run database ({check})")
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise ValueError(f"{path} is not a commweave run database ({exc})") from None
    except ValueError:
        conn.close()
        raise
    return conn


class ProgramDB:
    """A run's database. One writer (the search); readers (report, export) open it `readonly`,
    concurrently with the writer."""

    def __init__(self, path: str | Path, *, readonly: bool = False):
        self.path = Path(path)
        if readonly:
            self.conn = _open_readonly(self.path)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(str(self.path), timeout=30, isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.executescript(SCHEMA)
        self.conn.row_factory = sqlite3.Row
        self._tables = {row[0] for row in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        self._write = threading.Lock()

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ProgramDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- run metadata ---------------------------------------------------------------------------
    def set_meta(self, **values: Any) -> None:
        with self._write, self.conn:
            self.conn.execute("BEGIN")
            self.conn.executemany("INSERT OR REPLACE INTO run (key, value) VALUES (?, ?)",
                                  [(k, json.dumps(v)) for k, v in values.items()])

    def meta(self) -> dict[str, Any]:
        return {row["key"]: json.loads(row["value"]) for row in self.conn.execute("SELECT key, value FROM run")}

    # -- programs -------------------------------------------------------------------------------
    def add_program(self, *, code: str, directives: dict[str, Any] | None, directive_key: str | None = None,
                    parents: list[int] = (), island: int, generation: int, status: str, fitness: float = 0.0,
                    failure: str | None = None, message: str = "", timings: dict[str, Any] | None = None,
                    proposer: str = "", cost: float = 0.0, meta: dict[str, Any] | None = None) -> int:
        """Insert one program (and optionally update run metadata) in one committed transaction."""
        if status not in ("ok", "failed"):
            raise ValueError(f"status must be ok or failed, not {status!r}")
        with self._write, self.conn:
            self.conn.execute("BEGIN")
            cur = self.conn.execute(
                "INSERT INTO programs (code, code_hash, directives, directive_key, parents, island, generation, status,"
                " fitness, failure, message, timings, proposer, cost, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (code, code_hash(code), json.dumps(directives) if directives is not None else None, directive_key,
                 json.dumps(list(parents)), island, generation, status, float(fitness), failure, message,
                 json.dumps(timings or {}, default=str), proposer, float(cost), _now()))
            if meta:
                self.conn.executemany("INSERT OR REPLACE INTO run (key, value) VALUES (?, ?)",
                                      [(k, json.dumps(v)) for k, v in meta.items()])
            return int(cur.lastrowid)

    def add_migration(self, program_id: int, from_island: int, to_island: int, generation: int) -> None:
        with self._write, self.conn:
            self.conn.execute("BEGIN")
            self.conn.execute("INSERT INTO migrations (program_id, from_island, to_island, generation, created_at)"
                              " VALUES (?, ?, ?, ?, ?)", (program_id, from_island, to_island, generation, _now()))

    # -- LLM calls ------------------------------------------------------------------------------
    def add_llm_call(self, *, model: str, purpose: str, outcome: str, input_tokens: int = 0, output_tokens: int = 0,
                     cost: float = 0.0, latency_s: float = 0.0, message: str = "", program_id: int | None = None) -> int:
        """Insert one call (or unusable response) and set run meta `llm_spent_usd` to the table's sum."""
        with self._write, self.conn:
            self.conn.execute("BEGIN")
            cur = self.conn.execute(
                "INSERT INTO llm_calls (model, purpose, outcome, input_tokens, output_tokens, cost, latency_s, message,"
                " program_id, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (model, purpose, outcome, int(input_tokens), int(output_tokens), float(cost), float(latency_s), message,
                 program_id, _now()))
            spent = self.conn.execute("SELECT COALESCE(SUM(cost), 0) FROM llm_calls").fetchone()[0]
            self.conn.execute("INSERT OR REPLACE INTO run (key, value) VALUES ('llm_spent_usd', ?)", (json.dumps(spent),))
            return int(cur.lastrowid)

    def link_llm_calls(self, call_ids: list[int], program_id: int) -> None:
        """Mark the calls that produced a program."""
        if not call_ids:
            return
        with self._write, self.conn:
            self.conn.execute("BEGIN")
            self.conn.executemany("UPDATE llm_calls SET program_id = ? WHERE id = ?", [(program_id, i) for i in call_ids])

    def llm_calls(self, outcome: str | None = None, program_id: int | None = None) -> list[dict[str, Any]]:
        """Rows of `llm_calls` in order, optionally only one outcome or one program's."""
        if "llm_calls" not in self._tables:  # a run older than the table, opened read-only
            return []
        query, args = "SELECT * FROM llm_calls", []
        where = [(c, v) for c, v in (("outcome", outcome), ("program_id", program_id)) if v is not None]
        if where:
            query += " WHERE " + " AND ".join(f"{c} = ?" for c, _ in where)
            args = [v for _, v in where]
        return [dict(r) for r in self.conn.execute(query + " ORDER BY id", args)]

    def llm_spent(self) -> float:
        """Dollars spent on LLM calls in this run (every invocation of it)."""
        if "llm_calls" not in self._tables:
            return 0.0
        return float(self.conn.execute("SELECT COALESCE(SUM(cost), 0) FROM llm_calls").fetchone()[0])

    @staticmethod
    def _record(row: sqlite3.Row) -> ProgramRecord:
        return ProgramRecord(row["id"], row["code"], row["code_hash"],
                             json.loads(row["directives"]) if row["directives"] else None, row["directive_key"],
                             json.loads(row["parents"]), row["island"], row["generation"], row["status"],
                             row["fitness"], row["failure"], row["message"], json.loads(row["timings"]),
                             row["proposer"], row["cost"], row["created_at"])

    def programs(self, status: str | None = None) -> list[ProgramRecord]:
        if status is None:
            rows = self.conn.execute("SELECT * FROM programs ORDER BY id")
        else:
            rows = self.conn.execute("SELECT * FROM programs WHERE status = ? ORDER BY id", (status,))
        return [self._record(r) for r in rows]

    def get(self, program_id: int) -> ProgramRecord:
        row = self.conn.execute("SELECT * FROM programs WHERE id = ?", (program_id,)).fetchone()
        if row is None:
            raise KeyError(f"no program {program_id} in {self.path}")
        return self._record(row)

    def migrations(self) -> list[dict[str, Any]]:
        if "migrations" not in self._tables:  # a run older than the table, opened read-only
            return []
        return [dict(r) for r in self.conn.execute("SELECT * FROM migrations ORDER BY id")]

    def best(self) -> ProgramRecord | None:
        row = self.conn.execute("SELECT * FROM programs WHERE status = 'ok' ORDER BY fitness DESC, id LIMIT 1").fetchone()
        return self._record(row) if row else None

    def count(self) -> int:
        """Evaluated programs (proposals rejected before evaluation are never stored)."""
        return int(self.conn.execute("SELECT COUNT(*) FROM programs").fetchone()[0])

    def has_code(self, text: str) -> bool:
        return self.conn.execute("SELECT 1 FROM programs WHERE code_hash = ? LIMIT 1", (code_hash(text),)).fetchone() is not None

    def lineage(self, program_id: int) -> list[ProgramRecord]:
        """The program, its first parent, that parent's first parent, ... back to the root."""
        chain, seen = [], set()
        current: int | None = program_id
        while current is not None and current not in seen:
            seen.add(current)
            record = self.get(current)
            chain.append(record)
            current = record.parents[0] if record.parents else None
        return chain
