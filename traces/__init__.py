"""Trace format v3: Parquet tables plus a JSON manifest in one run directory.

Column-by-column documentation: docs/trace-format.md. Modules (none has import-time side effects):

- ``traces.schema``: ``FORMAT_VERSION``, ``Manifest`` and its specs, ``CycleRecord``, column specs.
- ``traces.writer``: ``TraceWriter``, the streaming, resumable, SIGKILL-safe writer.
- ``traces.storage`` / ``traces.compact``: part files and their encodings; v3's compact, lossless
  ``transfers`` form. ``python -m traces.rewrite RUN_DIR --out NEW_DIR``: a run in the current format.
- ``traces.reader``: ``open_run`` -> ``TraceRun`` (``iter_trees``, ``node_arrays``, tables).
- ``traces.validate`` / ``traces.checks``: value checks; ``traces.errors.TraceError``.
- ``traces.stats`` and ``python -m traces.inspect RUN_DIR [--validate]``: summaries.
- ``traces.synthetic`` (``python -m traces.synthetic``): synthetic dense traces at any model shape.
"""
