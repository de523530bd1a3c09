"""The one error type of the trace reader and validator."""

from __future__ import annotations

from pathlib import Path


class TraceError(ValueError):
    """A run directory, file, table or row that breaks trace format v1.

    The message always names where the problem is, e.g.
    ``runs/x/nodes/part-00003.parquet: table 'nodes' row 17: expert id 130 >= experts per layer 128``.

    Attributes:
        file: the offending file (or the run directory when no single file is at fault).
        table: table name (``"manifest"``, ``"requests"``, ``"prefill"``, ``"nodes"``, ``"cycles"``,
            ``"transfers"``) or ``None``.
        row: 0-based row index inside ``file`` or ``None`` when the problem is not a single row.
        message: what is wrong and what was expected.
    """

    def __init__(self, file: str | Path, table: str | None, row: int | None, message: str) -> None:
        self.file = str(file)
        self.table = table
        self.row = None if row is None else int(row)
        self.message = message
        where = self.file
        if table is not None:
            where += f": table '{table}'"
        if self.row is not None:
            where += f" row {self.row}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # keep the exception picklable across process pools
        return (type(self), (self.file, self.table, self.row, self.message))
