"""Trace format v3: the manifest, the cycle record and the column specs of every table.

Version 2 added the optional ``nodes`` column ``last_level`` (dense trees are the union of the
draft's per-level trees); version 3 stores ``transfers`` in a compact, lossless form
(:mod:`traces.compact`: per-copy values the reader rebuilds bit for bit are left out). Version-1
and -2 runs still read (``SUPPORTED_FORMAT_VERSIONS``).

One run directory holds ``manifest.json`` and one folder per table (``requests``, ``prefill``,
``nodes``, ``cycles``, ``transfers``), each a sequence of Parquet part files. The column specs
below are the single source of truth: the writer builds its Arrow schemas from them, the reader
checks files against them and ``docs/trace-format.md`` documents them column by column (a test
keeps the page and :data:`TABLES` in step).

Expert ids are stored as ``uint8`` when ``num_experts <= 256`` and ``int16`` otherwise; router
weights as ``float16``; both as one fixed-length list of ``L * K`` values per row (layer-major:
slot ``l * K + k`` is layer ``l``, k-th choice).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import platform
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

FORMAT_NAME = "specfit-trace"
FORMAT_VERSION = 3
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3)  # what the reader accepts; the writer writes FORMAT_VERSION
MANIFEST_FILE = "manifest.json"
TABLE_NAMES = ("requests", "prefill", "nodes", "cycles", "transfers")
RUN_MODES = ("dense", "policy")
H2D_MEMORY_KINDS = ("pinned", "pageable", "emulated", "none")
MAX_EXPERTS_INT16 = 2**15 - 1


# --------------------------------------------------------------------------------------------
# Manifest dataclasses
# --------------------------------------------------------------------------------------------


def _positive_int(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: expected a positive integer, got {value!r}")


def _optional_positive_float(where: str, value: Any) -> None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise ValueError(f"{where}: expected a number > 0 or null, got {value!r}")


def _check_type(where: str, value: Any, hint: Any) -> Any:
    """Check/convert one JSON value against a dataclass field's type hint; return the value."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(where, value, option)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{where}: unexpected value {value!r}")
    if dataclasses.is_dataclass(hint):
        return _dataclass_from_dict(hint, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: expected a list of strings, got {value!r}")
        return tuple(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported field type {hint!r}")  # programming error


def _dataclass_from_dict(cls: Any, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from a JSON object, naming ``where.field`` on any error."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        name = f"{where}.{f.name}"
        if f.name not in data:
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if has_default:
                continue
            raise ValueError(f"{name}: missing field")
        kwargs[f.name] = _check_type(name, data[f.name], hints[f.name])
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


@dataclass(frozen=True)
class ModelSpec:
    """The target MoE model as far as the trace is concerned.

    Attributes:
        name: model name or preset (``"qwen3-30b-a3b"``, a checkpoint path, ...).
        architecture: Hugging Face architecture (``"Qwen3MoeForCausalLM"``) or ``"synthetic"``.
        num_layers: MoE layers ``L``; num_experts: routed experts per layer ``E``; top_k: ``K``.
        hidden_size, expert_intermediate_size: widths (elements).
        dtype: weight dtype name (``"bfloat16"``); bytes_per_expert: bytes of one expert (one H2D copy).

    Raises:
        ValueError: non-positive size, ``top_k > num_experts`` or ``num_experts > 32767``.
    """

    name: str
    architecture: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    dtype: str
    bytes_per_expert: int

    def __post_init__(self) -> None:
        try:  # the size fields are checked once, by specfit's ModelShape
            self.to_shape()
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("ModelShape.")) from None
        if self.num_experts > MAX_EXPERTS_INT16:
            raise ValueError(f"num_experts: expected <= {MAX_EXPERTS_INT16}, got {self.num_experts}")

    @classmethod
    def from_shape(cls, shape: Any, *, architecture: str = "synthetic", dtype: str = "bfloat16") -> ModelSpec:
        """Build from a ``specfit.shapes.ModelShape`` (duck-typed: same field names)."""
        return cls(
            name=shape.name,
            architecture=architecture,
            num_layers=shape.num_layers,
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            hidden_size=shape.hidden_size,
            expert_intermediate_size=shape.expert_intermediate_size,
            dtype=dtype,
            bytes_per_expert=shape.bytes_per_expert,
        )

    def to_shape(self) -> Any:
        """The matching ``specfit.shapes.ModelShape``."""
        from specfit.shapes import ModelShape

        return ModelShape(
            name=self.name,
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            expert_intermediate_size=self.expert_intermediate_size,
            bytes_per_expert=self.bytes_per_expert,
        )


@dataclass(frozen=True)
class HardwareSpec:
    """Where the run happened and how experts crossed to the device.

    Attributes:
        device_name: e.g. ``"NVIDIA H100 80GB HBM3"``, ``"cpu"`` or ``"synthetic"``.
        link_kind: ``"cuda-copy-stream"``, ``"cpu-memcpy"``, ``"cpu-emulated"``, ``"synthetic"``, ...
        h2d_memory: host memory of the experts: ``"pinned"``, ``"pageable"``, ``"emulated"`` or
            ``"none"`` (no transfers happened, e.g. synthetic traces).
        emulated_bandwidth_bytes_per_s: link bandwidth when emulated (required then), else ``None``.
        emulated_s_per_transfer: per-transfer latency when emulated (seconds) or ``None``.

    Raises:
        ValueError: unknown ``h2d_memory``, or an emulated link without a positive bandwidth.
    """

    device_name: str
    link_kind: str
    h2d_memory: str
    emulated_bandwidth_bytes_per_s: float | None = None
    emulated_s_per_transfer: float | None = None

    def __post_init__(self) -> None:
        if self.h2d_memory not in H2D_MEMORY_KINDS:
            raise ValueError(f"h2d_memory: expected one of {list(H2D_MEMORY_KINDS)}, got {self.h2d_memory!r}")
        if self.h2d_memory == "emulated" and self.emulated_bandwidth_bytes_per_s is None:
            raise ValueError("emulated_bandwidth_bytes_per_s: required when h2d_memory is 'emulated'")
        _optional_positive_float("emulated_bandwidth_bytes_per_s", self.emulated_bandwidth_bytes_per_s)
        if self.emulated_s_per_transfer is not None and (
            not math.isfinite(self.emulated_s_per_transfer) or self.emulated_s_per_transfer < 0
        ):
            raise ValueError(f"emulated_s_per_transfer: expected >= 0, got {self.emulated_s_per_transfer!r}")


@dataclass(frozen=True)
class DraftSpec:
    """The draft model and the maximal tree it drafts.

    Attributes:
        model: draft model name/path, or ``"synthetic"``.
        tree_depth: maximum draft depth (levels); tree_topk: children per expanded node;
        max_nodes: maximum nodes per tree including the root.
        kind: the drafter: ``"causal-lm"`` (a small LM), ``"eagle3"`` (an EAGLE-3 head drafting
            from the target's hidden states), ``"synthetic"`` or ``"none"``; ``"unknown"`` in
            manifests written before the field existed.
    """

    model: str
    tree_depth: int
    tree_topk: int
    max_nodes: int
    kind: str = "unknown"

    def __post_init__(self) -> None:
        for name in ("tree_depth", "tree_topk", "max_nodes"):
            _positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class RunConfig:
    """What the run did.

    Attributes:
        mode: ``"dense"`` (whole maximal tree verified at every position) or ``"policy"``.
        prompt_source: where prompts came from (``"default"``, ``"mtbench"``, a path, ``"synthetic"``).
        tree_policy: policy name in policy mode (required there), else ``None``.
        cache_policy: expert cache policy (``"lru"``, ...) or ``None`` (required in policy mode).
        cache_capacity_per_layer: experts cached per layer or ``None`` (required in policy mode).
        predictor: expert predictor used by the planner, or ``None``.
    """

    mode: str
    prompt_source: str
    tree_policy: str | None = None
    cache_policy: str | None = None
    cache_capacity_per_layer: int | None = None
    predictor: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in RUN_MODES:
            raise ValueError(f"mode: expected one of {list(RUN_MODES)}, got {self.mode!r}")
        if self.mode == "policy":
            for name in ("tree_policy", "cache_policy", "cache_capacity_per_layer"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}: required in policy mode")
        if self.cache_capacity_per_layer is not None and (
            isinstance(self.cache_capacity_per_layer, bool) or self.cache_capacity_per_layer < 0
        ):
            raise ValueError(
                f"cache_capacity_per_layer: expected >= 0, got {self.cache_capacity_per_layer!r}"
            )


def software_versions() -> dict[str, str]:
    """Versions of Python and the libraries a trace depends on (torch only if already imported)."""
    import numpy

    versions = {"python": platform.python_version(), "numpy": numpy.__version__, "pyarrow": pa.__version__}
    try:
        from importlib.metadata import version

        versions["specfit-offload"] = version("specfit-offload")
    except Exception:  # not installed as a distribution
        versions["specfit-offload"] = "unknown"
    for name in ("torch", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = str(getattr(module, "__version__", "unknown"))
    return versions


def utc_now_iso() -> str:
    """Current UTC time, ISO 8601 with seconds (``2026-11-30T05:30:00Z``)."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: everything needed to interpret and reproduce a run.

    Build one with :meth:`create` (fills time, command line and versions); the writer sets
    ``complete`` and ``resumed_at``. ``to_dict``/``from_dict`` round-trip through JSON;
    ``from_dict`` raises ``ValueError`` naming the field (``manifest.model.top_k: ...``).

    Attributes:
        model, hardware, draft, run: the nested specs.
        seed: the run's random seed (``None`` if the run used none).
        command_line: ``sys.argv`` of the recording process.
        created_at: UTC ISO time the run started; software: library versions.
        format_version: :data:`FORMAT_VERSION`; complete: set true by ``close(complete=True)``.
        resumed_at: UTC ISO times the run was re-opened with resume.
        config: the resolved configuration (free-form JSON object).
        table_counts: ``{table: {"parts": P, "rows": R}}`` of every table, recorded by
            ``TraceWriter.close`` (``None`` while the run is being written, and in traces written
            before this field existed); the reader checks the files against it.
    """

    model: ModelSpec
    hardware: HardwareSpec
    draft: DraftSpec
    run: RunConfig
    seed: int | None
    command_line: tuple[str, ...]
    created_at: str
    software: dict[str, Any]
    format_version: int = FORMAT_VERSION
    complete: bool = False
    resumed_at: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)
    table_counts: dict[str, Any] | None = None

    @classmethod
    def create(
        cls,
        model: ModelSpec,
        hardware: HardwareSpec,
        draft: DraftSpec,
        run: RunConfig,
        *,
        seed: int | None,
        command_line: Sequence[str] | None = None,
        config: dict[str, Any] | None = None,
    ) -> Manifest:
        """A new manifest stamped with the current time, ``sys.argv`` and software versions."""
        return cls(
            model=model,
            hardware=hardware,
            draft=draft,
            run=run,
            seed=seed,
            command_line=tuple(sys.argv if command_line is None else command_line),
            created_at=utc_now_iso(),
            software=software_versions(),
            config=dict(config or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict, with ``format`` and ``format_version`` first."""
        data = {"format": FORMAT_NAME}
        data.update(_to_jsonable(self))
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Parse and validate a manifest object.

        Raises:
            ValueError: not an object, wrong ``format``/``format_version`` or any bad/missing
                field, naming it (``manifest.hardware.h2d_memory: ...``).
        """
        if not isinstance(data, dict):
            raise ValueError(f"manifest: expected a JSON object, got {type(data).__name__}")
        if data.get("format", FORMAT_NAME) != FORMAT_NAME:
            raise ValueError(f"manifest.format: expected {FORMAT_NAME!r}, got {data.get('format')!r}")
        version = data.get("format_version")
        if version not in SUPPORTED_FORMAT_VERSIONS or isinstance(version, bool):
            raise ValueError(
                f"manifest.format_version: this reader supports versions {list(SUPPORTED_FORMAT_VERSIONS)}, "
                f"got {version!r}"
            )
        return _dataclass_from_dict(cls, {k: v for k, v in data.items() if k != "format"}, "manifest")

    def replace(self, **changes: Any) -> Manifest:
        """``dataclasses.replace`` shortcut."""
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------
# Cycle record
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CycleRecord:
    """One executed verification cycle (both modes), one row of the ``cycles`` table.

    Per-layer fields are sequences of length ``L`` (any int/float sequence or numpy array).
    Times are seconds, bytes are bytes. ``num_accepted`` excludes the bonus token;
    ``num_committed = num_accepted + 1`` unless EOS or the length limit cut it.
    ``predicted_*`` and ``decision_s`` are ``None`` when no planner chose the subtree.
    ``committed_token_ids`` (extension beyond docs/contracts.md, optional) holds the tokens the
    cycle committed, in order. ``layer_stall_s`` (optional; ``None`` writes null): per layer, the
    seconds the compute stream waited for H2D copies (all of ``layer_h2d_s`` without overlap).
    ``num_prefetch_issued``/``_used``/``_wasted`` and ``prefetch_wasted_bytes`` (optional):
    experts prefetched this cycle, prefetched experts hit before leaving the cache, and those
    evicted first (``specfit.prefetch.PrefetchLedger``); without prefetch the live engine records
    0 (its ledger always counts), the simulator ``None``.
    ``layer_accessed`` (int[L]) and ``accessed_experts`` (the ids, layer by layer, ascending)
    record the expert-cache accesses of the verification forward (one access per layer: the union
    of the verified nodes' experts), so a resumed run can replay them into its cache; ``None``
    when not recorded (both or neither). ``reached_depth`` (optional): the depth verification
    tested along the accepted path, ``num_accepted + 1`` when the last accepted node (the root when
    none) had a verified child and the path did not end on an accepted end-of-sequence token, else
    ``num_accepted``; it is what per-depth acceptance conditions on for a verified subtree that is not
    the whole tree (``traces.stats.cycle_reached_depths``); ``None`` when not recorded.
    ``layer_pre_router_s`` (optional): per layer, the part of ``layer_compute_s`` before the
    layer's router had chosen its experts (attention, norms, router), after which its copies are
    enqueued (``CycleCostModel.pre_router_fraction`` is fitted from it); ``None`` when not recorded.
    """

    request_id: int
    cycle_index: int
    position: int
    context_len: int
    policy: str
    num_draft_levels: int
    num_nodes_verified: int
    verified_nodes: Sequence[int]
    num_accepted: int
    num_committed: int
    draft_s: float
    verify_s: float
    h2d_s: float
    cycle_s: float
    layer_misses: Sequence[int]
    layer_h2d_bytes: Sequence[int]
    layer_h2d_s: Sequence[float]
    layer_compute_s: Sequence[float]
    cache_hits: int
    cache_misses: int
    predicted_expected_committed: float | None = None
    predicted_cycle_s: float | None = None
    decision_s: float | None = None
    committed_token_ids: Sequence[int] = ()
    layer_stall_s: Sequence[float] | None = None
    num_prefetch_issued: int | None = None
    num_prefetch_used: int | None = None
    num_prefetch_wasted: int | None = None
    prefetch_wasted_bytes: int | None = None
    layer_accessed: Sequence[int] | None = None
    accessed_experts: Sequence[int] | None = None
    reached_depth: int | None = None
    layer_pre_router_s: Sequence[float] | None = None


# --------------------------------------------------------------------------------------------
# Column specs
# --------------------------------------------------------------------------------------------

# kinds: how the reader checks a column's Arrow type (writers may use any type of the kind).
KIND_INT = "int"
KIND_FLOAT = "float"
KIND_BOOL = "bool"
KIND_STRING = "string"
KIND_INT_LIST = "list<int>"
KIND_FLOAT_LIST = "list<float>"
KIND_EXPERT_IDS = "expert_ids"
KIND_ROUTER_WEIGHTS = "router_weights"
KIND_NEXT_LAYER_IDS = "next_layer_expert_ids"


@dataclass(frozen=True)
class ColumnSpec:
    """One column of a table: name, Arrow type written, kind accepted on read, unit, meaning.

    ``arrow_type`` is ``None`` for the per-model columns (expert ids, router weights, next-layer
    guesses), whose type depends on the manifest (see :func:`expert_id_type`).
    """

    name: str
    kind: str
    arrow_type: pa.DataType | None
    unit: str
    meaning: str
    nullable: bool = False
    required: bool = True


def _c(
    name: str, kind: str, arrow_type: pa.DataType | None, unit: str, meaning: str, **kw: Any
) -> ColumnSpec:
    return ColumnSpec(name, kind, arrow_type, unit, meaning, **kw)


_EXPERTS = "one fixed-length list of L*K per row, layer-major (slot l*K+k = layer l, k-th choice)"
_NEXT_LAYER = (
    "the next-layer prefetch guess: for each layer l < L-1, the top-k of layer l+1's router applied "
    "to this token's layer-l MoE input (Pre-gated MoE, Hwang et al., ISCA 2024, with the next "
    "layer's own gate); one fixed-length list of (L-1)*K per row, layer-major (slot l*K+k = the "
    "k-th guess for layer l+1), by descending router score; what live.offload's --prefetch "
    "next-layer copies ahead, replayed by sim.replay (optional column; null when not recorded)"
)

_NEXT_LAYER_COLUMN = _c(
    "next_layer_expert_ids", KIND_NEXT_LAYER_IDS, None, "expert id", _NEXT_LAYER, nullable=True, required=False
)

TABLES: dict[str, tuple[ColumnSpec, ...]] = {
    "requests": (
        _c("request_id", KIND_INT, pa.int64(), "-", "request id, unique in the run"),
        _c("prompt_token_ids", KIND_INT_LIST, pa.list_(pa.int32()), "token ids", "the prompt, tokenized"),
        _c(
            "generated_token_ids",
            KIND_INT_LIST,
            pa.list_(pa.int32()),
            "token ids",
            "the greedy output, in order (excludes the prompt)",
        ),
        _c("source", KIND_STRING, pa.string(), "-", "where the prompt came from (dataset/file and item)"),
        _c(
            "category",
            KIND_STRING,
            pa.string(),
            "-",
            "the prompt's category (MT-bench layout `category`, e.g. `summarization`; null without one; "
            "optional column)",
            nullable=True,
            required=False,
        ),
    ),
    "prefill": (
        _c("request_id", KIND_INT, pa.int64(), "-", "request id (in `requests`)"),
        _c("token_index", KIND_INT, pa.int32(), "index", "index of the prompt token, 0-based"),
        _c("expert_ids", KIND_EXPERT_IDS, None, "expert id", "top-k experts per layer; " + _EXPERTS),
        _c(
            "router_weights",
            KIND_ROUTER_WEIGHTS,
            None,
            "probability",
            "router weight of each chosen expert, same layout as expert_ids",
        ),
        _NEXT_LAYER_COLUMN,
    ),
    "nodes": (
        _c("request_id", KIND_INT, pa.int64(), "-", "request id (in `requests`)"),
        _c(
            "position",
            KIND_INT,
            pa.int32(),
            "tokens",
            "generated tokens already committed when the tree was drafted; depth-d node proposes "
            "generated token position+d-1",
        ),
        _c("context_len", KIND_INT, pa.int32(), "tokens", "prompt length + position"),
        _c("node_id", KIND_INT, pa.int32(), "-", "node index in its tree, 0..N-1 in order; 0 is the root"),
        _c("parent", KIND_INT, pa.int32(), "-", "parent node id; -1 for the root; parent < node_id"),
        _c("depth", KIND_INT, pa.int16(), "levels", "0 at the root; depth = parent depth + 1"),
        _c("token_id", KIND_INT, pa.int32(), "token id", "the node's token (root: last committed token)"),
        _c(
            "draft_logprob",
            KIND_FLOAT,
            pa.float64(),
            "nats",
            "log-prob of the token under the draft given its parent; 0 at the root",
        ),
        _c(
            "path_logprob",
            KIND_FLOAT,
            pa.float64(),
            "nats",
            "sum of draft_logprob along the path; 0 at the root",
        ),
        _c(
            "target_token", KIND_INT, pa.int32(), "token id", "the target's greedy next token after this node"
        ),
        _c(
            "accepted",
            KIND_BOOL,
            pa.bool_(),
            "-",
            "token_id == target_token of the parent (true at the root); path accepted = all ancestors accepted",
        ),
        _c("expert_ids", KIND_EXPERT_IDS, None, "expert id", "top-k experts per layer; " + _EXPERTS),
        _c(
            "router_weights",
            KIND_ROUTER_WEIGHTS,
            None,
            "probability",
            "router weight of each chosen expert, same layout as expert_ids",
        ),
        _NEXT_LAYER_COLUMN,
        _c(
            "last_level",
            KIND_INT,
            pa.int16(),
            "levels",
            "the last draft level whose EAGLE-2 reranked tree held this node: dense trees are the union "
            "of the draft's per-level trees (live.spec.draft, level_union), the tree after level k is the "
            "nodes with depth <= k <= last_level, the final tree those with last_level = the levels drafted "
            "(the root's); what sim.replay asks the stopping rule on (format v2; optional column: null or "
            "absent in traces recorded before it, which sim.replay then approximates by the final tree cut "
            "at depth k)",
            nullable=True,
            required=False,
        ),
    ),
    "cycles": (
        _c("request_id", KIND_INT, pa.int64(), "-", "request id (in `requests`)"),
        _c("cycle_index", KIND_INT, pa.int32(), "-", "0-based index of the cycle within its request"),
        _c("position", KIND_INT, pa.int32(), "tokens", "generated tokens committed before the cycle"),
        _c("context_len", KIND_INT, pa.int32(), "tokens", "prompt length + position"),
        _c("policy", KIND_STRING, pa.string(), "-", "tree policy that chose the verified subtree"),
        _c("num_draft_levels", KIND_INT, pa.int32(), "levels", "draft levels run this cycle"),
        _c("num_nodes_verified", KIND_INT, pa.int32(), "nodes", "|S|, nodes verified including the root"),
        _c(
            "verified_nodes",
            KIND_INT_LIST,
            pa.list_(pa.int32()),
            "node ids",
            "S: ids of the verified nodes in the drafted tree (sorted, contains 0)",
        ),
        _c("num_accepted", KIND_INT, pa.int32(), "tokens", "accepted draft tokens, excluding the bonus"),
        _c(
            "num_committed",
            KIND_INT,
            pa.int32(),
            "tokens",
            "tokens committed = num_accepted + 1 unless EOS/length limit",
        ),
        _c("draft_s", KIND_FLOAT, pa.float64(), "s", "drafting time"),
        _c("verify_s", KIND_FLOAT, pa.float64(), "s", "target verification forward time"),
        _c("h2d_s", KIND_FLOAT, pa.float64(), "s", "host-to-device expert transfer time"),
        _c("cycle_s", KIND_FLOAT, pa.float64(), "s", "wall time of the whole cycle"),
        _c("layer_misses", KIND_INT_LIST, pa.list_(pa.int32()), "experts", "per layer (L): cache misses"),
        _c(
            "layer_h2d_bytes", KIND_INT_LIST, pa.list_(pa.int64()), "bytes", "per layer (L): bytes copied H2D"
        ),
        _c("layer_h2d_s", KIND_FLOAT_LIST, pa.list_(pa.float64()), "s", "per layer (L): H2D time"),
        _c("layer_compute_s", KIND_FLOAT_LIST, pa.list_(pa.float64()), "s", "per layer (L): compute time"),
        _c("cache_hits", KIND_INT, pa.int64(), "expert accesses", "expert cache hits over all layers"),
        _c("cache_misses", KIND_INT, pa.int64(), "expert accesses", "expert cache misses over all layers"),
        _c(
            "predicted_expected_committed",
            KIND_FLOAT,
            pa.float64(),
            "tokens",
            "planner's E[committed | S] (null without a planner)",
            nullable=True,
        ),
        _c(
            "predicted_cycle_s",
            KIND_FLOAT,
            pa.float64(),
            "s",
            "planner's predicted T_cycle(S) (null without a planner)",
            nullable=True,
        ),
        _c(
            "decision_s",
            KIND_FLOAT,
            pa.float64(),
            "s",
            "planner's own decision time (null without one)",
            nullable=True,
        ),
        _c(
            "committed_token_ids",
            KIND_INT_LIST,
            pa.list_(pa.int32()),
            "token ids",
            "tokens the cycle committed, in order (optional column)",
            required=False,
        ),
        _c(
            "layer_stall_s",
            KIND_FLOAT_LIST,
            pa.list_(pa.float64()),
            "s",
            "per layer (L): compute stream waiting for H2D copies (= layer_h2d_s without overlap; "
            "optional column, null when not measured)",
            required=False,
            nullable=True,
        ),
        *(
            _c(name, KIND_INT, pa.int64(), unit, meaning + " (optional column, null without prefetch)", required=False, nullable=True)
            for name, unit, meaning in (
                ("num_prefetch_issued", "experts", "experts copied ahead of need this cycle (draft / next-layer prefetch)"),
                ("num_prefetch_used", "experts", "prefetched experts hit before leaving the cache"),
                ("num_prefetch_wasted", "experts", "prefetched experts evicted before any hit"),
                ("prefetch_wasted_bytes", "bytes", "bytes of the wasted prefetches"),
            )
        ),
        _c(
            "layer_accessed",
            KIND_INT_LIST,
            pa.list_(pa.int32()),
            "experts",
            "per layer (L): distinct experts the verification forward accessed in the expert cache "
            "= hits + misses (optional column; null when not recorded)",
            required=False,
            nullable=True,
        ),
        _c(
            "accessed_experts",
            KIND_INT_LIST,
            pa.list_(pa.int16()),
            "expert ids",
            "the experts accessed, layer by layer (layer_accessed[l] ids of layer l, ascending): the "
            "cache's access sequence, replayed by live.record --resume (optional column; null when not recorded)",
            required=False,
            nullable=True,
        ),
        _c(
            "reached_depth",
            KIND_INT,
            pa.int32(),
            "levels",
            "depth verification tested along the accepted path: num_accepted + 1 when the last accepted "
            "node (root if none) has a verified child and is not an accepted EOS, else num_accepted; "
            "per-depth acceptance conditions on it (optional column; null when not recorded)",
            required=False,
            nullable=True,
        ),
        _c(
            "layer_pre_router_s",
            KIND_FLOAT_LIST,
            pa.list_(pa.float64()),
            "s",
            "per layer (L): the part of layer_compute_s before the layer's router had chosen its experts "
            "(attention, norms, router), after which its H2D copies are enqueued (optional column; null "
            "when not recorded)",
            required=False,
            nullable=True,
        ),
    ),
    "transfers": (
        _c("request_id", KIND_INT, pa.int64(), "-", "request id (in `requests`)"),
        _c("cycle_index", KIND_INT, pa.int32(), "-", "cycle of the transfer (`cycles.cycle_index`)"),
        _c("layer", KIND_INT, pa.int16(), "-", "MoE layer, 0..L-1"),
        _c("expert", KIND_INT, pa.int16(), "expert id", "expert copied, 0..E-1"),
        _c("bytes", KIND_INT, pa.int64(), "bytes", "bytes copied"),
        _c("h2d_s", KIND_FLOAT, pa.float64(), "s", "duration of this one copy"),
        *(
            _c(
                name,
                KIND_FLOAT,
                pa.float64(),
                "s",
                f"{what}, from the start of the cycle's verification forward (optional column, "
                "null when not measured)",
                required=False,
                nullable=True,
            )
            for name, what in (
                ("enqueued_at_s", "copy enqueued on the copy stream (its layer's router has run)"),
                ("started_at_s", "copy started on the copy stream"),
                ("landed_at_s", "copy landed in device memory"),
                (
                    "placed_at_s",
                    "the copy's host memcpy ended on the CPU copy stream (the compute stream's placing "
                    "after the enqueue; null for synchronous copies, on CUDA and in traces written before it)",
                ),
            )
        ),
    ),
}


def expert_id_type(num_experts: int) -> pa.DataType:
    """Arrow type of stored expert ids: ``uint8`` when ``num_experts <= 256``, else ``int16``.

    Raises:
        ValueError: ``num_experts`` outside ``1..32767``.
    """
    if not 1 <= num_experts <= MAX_EXPERTS_INT16:
        raise ValueError(f"num_experts: expected 1..{MAX_EXPERTS_INT16}, got {num_experts}")
    return pa.uint8() if num_experts <= 256 else pa.int16()


def next_layer_slots(model: ModelSpec) -> int:
    """Values per row of a ``next_layer_expert_ids`` list: ``(L-1)*K`` (0 for one MoE layer)."""
    return (model.num_layers - 1) * model.top_k


def arrow_schema(table: str, model: ModelSpec) -> pa.Schema:
    """The Arrow schema the writer uses for ``table`` under ``model`` (all columns, required first).

    Raises:
        KeyError: unknown table name.
    """
    slots = model.num_layers * model.top_k
    fields = []
    for spec in TABLES[table]:
        if spec.kind == KIND_EXPERT_IDS:
            arrow_type = pa.list_(expert_id_type(model.num_experts), slots)
        elif spec.kind == KIND_NEXT_LAYER_IDS:
            arrow_type = pa.list_(expert_id_type(model.num_experts), next_layer_slots(model))
        elif spec.kind == KIND_ROUTER_WEIGHTS:
            arrow_type = pa.list_(pa.float16(), slots)
        else:
            arrow_type = spec.arrow_type
        fields.append(pa.field(spec.name, arrow_type, nullable=spec.nullable or not spec.required))
    return pa.schema(fields, metadata={b"specfit_trace_format_version": str(FORMAT_VERSION).encode()})
