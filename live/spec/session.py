"""One ``python -m live.record`` run: load, offload, decode every prompt, write the trace.

Kept apart from the argument parsing in :mod:`live.record` so tests and benchmarks can drive a
run from a :class:`live.record.RecordConfig`. Errors a user can fix (a cache larger than the
experts per layer, an empty prompt file, an unsupported architecture, missing tokenizer) raise
:class:`SessionError` naming the flag; the CLI turns it into exit status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from live.spec.draft import ModelDrafter, TreeShape
from live.spec.engine import AutoregressiveChooser, FullTreeChooser, SpecDecoder, SubtreeChooser
from live.spec.names import PLANNED_POLICIES
from live.spec.recording import RunTotals, cycle_record, write_transfers, write_tree
from live.spec.routing import RouterCapture
from live.spec.verify import TreeVerifier
from specfit.prefetch import uses_draft, uses_next_layer

REQUEST_TOTALS_NAME = "request_totals.json"
"""Per-request run totals beside the trace, so a --resume summary covers the whole run."""
PLANNER_STATE_NAME = "planner_state.json"
"""What the planner learned up to the last finished request, so --resume continues with it."""


class SessionError(Exception):
    """A bad flag value found while opening a run; ``flag`` names it, ``message`` says what was expected."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


def _model_dirs(config) -> tuple[Path, Path | None]:
    if config.model == "default" or config.draft == "default":
        from live.assets import default_draft_path, default_model_paths

        try:
            default_target, _ = default_model_paths()
            default_draft = default_draft_path()
        except FileNotFoundError as exc:
            raise SessionError("--model", str(exc)) from exc
    target = default_target if config.model == "default" else Path(config.model)
    draft = (
        None if config.draft is None else (default_draft if config.draft == "default" else Path(config.draft))
    )
    return target, draft


def _max_positions(*dirs: Path | None) -> int | None:
    """Smallest ``max_position_embeddings`` in the ``config.json`` of ``dirs`` (target, draft; read
    by ``live.loader.checkpoint_config``); ``None`` when none states one."""
    from live.loader import checkpoint_config

    found = [
        checkpoint_config(folder).get("max_position_embeddings") for folder in dirs if folder is not None
    ]
    found = [v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(found, default=None)


def _load_tokenizer(*dirs: Path | None):
    from transformers import AutoTokenizer

    for folder in dirs:
        if folder is not None and (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    raise SessionError("--model", f"no tokenizer files (tokenizer.json) in {dirs[0]}")


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.config, "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids = [*ids, tokenizer.eos_token_id]
    return sorted({int(t) for t in ids})


def _expert_frequency(model, prompt_ids: list[list[int]], num_experts: int) -> np.ndarray:
    """float[L, E] expert counts over the prompts' tokens (for the static cache policy)."""
    capture = RouterCapture(model)
    counts = None
    with torch.inference_mode():
        for ids in prompt_ids:
            model(input_ids=torch.tensor([ids], device=next(model.parameters()).device))
            experts, _ = capture.take()
            layer_counts = np.stack(
                [
                    np.bincount(experts[:, layer].ravel(), minlength=num_experts)
                    for layer in range(experts.shape[1])
                ]
            )
            counts = layer_counts if counts is None else counts + layer_counts
    capture.close()
    return counts.astype(np.float64)


def _weights_sha256(folder: Path | None) -> str | None:
    """SHA-256 of a checkpoint's ``model.safetensors`` (provenance of a trace), None when absent."""
    if folder is None or not (Path(folder) / "model.safetensors").is_file():
        return None
    import hashlib

    digest = hashlib.sha256()
    with open(Path(folder) / "model.safetensors", "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_predictor_tables(path: str, num_layers: int, num_experts: int) -> dict[str, np.ndarray]:
    """Predictor tables for the planner, read without pickle.

    ``path`` is either a ``predictor_tables.npz`` of ``calibration.fit`` or a dense trace run
    directory, whose trees give the ``union_size`` table exactly as ``sim.replay`` fits it for a
    replay of that trace (:func:`specfit.predictors.union_size_from_node_arrays` over every tree, nodes
    ranked by draft path probability, up to the largest tree), so a live run and a replay of the
    same dense trace price trees with the same table.

    Raises:
        SessionError: unreadable file or trace, no ``union_size`` array / no dense trees, or a
            trace of a model with other layer/expert counts (names ``--predictor-tables``).
    """
    if Path(path).is_dir():
        return {"union_size": union_size_from_dense_trace(path, num_layers, num_experts)}
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:  # np.load's own text may invite allow_pickle: not shown
        raise SessionError(
            "--predictor-tables",
            f"{path}: not a readable .npz archive of arrays ({type(exc).__name__}); expected "
            "predictor_tables.npz written by python -m calibration.fit, or a dense trace run directory",
        ) from None
    if "union_size" not in arrays:
        raise SessionError(
            "--predictor-tables", f"{path}: no 'union_size' array (expected calibration.fit output)"
        )
    return arrays


def union_size_from_dense_trace(path: str | Path, num_layers: int, num_experts: int) -> np.ndarray:
    """float64[L, M+1] union-size table of the dense trace in ``path`` (see :func:`_load_predictor_tables`).

    Raises:
        SessionError: not a readable dense trace of an L-layer, E-expert model (names ``--predictor-tables``).
    """
    from specfit.predictors import union_size_from_node_arrays
    from traces.reader import open_run

    try:
        run = open_run(path)
        arrays = run.node_arrays()
    except (OSError, ValueError, KeyError) as exc:
        raise SessionError("--predictor-tables", f"{path}: cannot read the dense trace: {exc}") from exc
    model = run.manifest.model
    if (model.num_layers, model.num_experts) != (num_layers, num_experts):
        raise SessionError(
            "--predictor-tables",
            f"{path}: trace of a model with {model.num_layers} MoE layers x {model.num_experts} experts, "
            f"the target has {num_layers} x {num_experts}",
        )
    if arrays.num_trees == 0:
        raise SessionError("--predictor-tables", f"{path}: no dense trees (record it with --mode dense)")
    return union_size_from_node_arrays(arrays, num_experts)


def _load_drafter(draft_dir: Path, target_dir: Path, target, config):
    """(drafter, target feature tap or None): an EAGLE-3 head when its config says so, else a causal LM.

    Prints one header line naming the drafter kind. Raises :class:`SessionError` on ``--draft``
    for anything that cannot draft for this target (before any decoding or writing).
    """
    from live.eagle3 import is_eagle3_checkpoint

    try:
        if is_eagle3_checkpoint(draft_dir):
            from live.eagle3 import load_head
            from live.eagle3_draft import Eagle3Drafter, features_for
            from live.loader import check_device, resolve_dtype

            head = load_head(
                draft_dir,
                target,
                check_device(config.device),
                resolve_dtype(config.dtype),
                target_dir=target_dir,
            )
            features = features_for(head, target)
            sys.stderr.write(
                f"draft: EAGLE-3 head {draft_dir} (hidden {head.config.hidden_size}, draft vocabulary "
                f"{head.config.draft_vocab_size}, target layers tapped {list(features.layer_ids)})\n"
            )
            return Eagle3Drafter(head, features), features
        from live.loader import load_draft

        drafter = ModelDrafter(load_draft(draft_dir, config.device, config.dtype))
        sys.stderr.write(f"draft: causal LM {draft_dir}\n")
        return drafter, None
    except (ValueError, FileNotFoundError) as exc:
        raise SessionError("--draft", str(exc)) from exc


@contextlib.contextmanager
def heap_frozen():
    """Freeze the objects alive now (imports, the loaded models: :func:`gc.freeze`) for the
    decoding (:meth:`RecordSession.run` decodes inside it), and unfreeze them after it (so that an in-process caller such as
    ``analysis.validate`` can still free a finished run's models), unless something already
    froze the heap (then nothing is changed).

    Why: CPython's cyclic collector runs a full (generation-2) collection whenever the objects
    that survived younger collections grow by a quarter, and each one traverses every tracked
    object: ~424,000 once torch and transformers are imported, 0.5-1.4 s per collection on this
    project's 2-core VM. During a run those land inside cycles (measured: 7 of them, 7.2 s in all,
    in a 94 s ``--mode policy --policy specfit --num-prompts 2 --max-new-tokens 24`` run at load
    8), adding up to a second to a cycle's recorded time that no cost model explains. Frozen
    objects are skipped by collections; what the run allocates is collected as before.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class RecordSession:
    """A loaded engine plus the run directory writer; build with :meth:`open`, then :meth:`run`."""

    def __init__(self) -> None:  # use open()
        raise TypeError("use RecordSession.open(config)")

    @classmethod
    def open(cls, config) -> RecordSession:
        """Load models, prompts and tokenizer, offload the experts, build the policy and the writer.

        Raises:
            SessionError: naming the flag whose value cannot work (see module docstring).
        """
        from live.loader import UnsupportedArchitectureError, describe_moe, load_target
        from live.offload import make_link, offload_model
        from live.prompts import (
            UnknownCategoryError,
            fit_prompts_to_positions,
            load_prompts,
            parse_categories,
            prompt_budget,
        )
        from live.spec.attention import attention_layout

        self = object.__new__(cls)
        self.config = config
        torch.manual_seed(config.seed)
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        target_dir, draft_dir = _model_dirs(config)
        if draft_dir is not None:
            from live.loader import check_draft_vocab

            try:
                check_draft_vocab(target_dir, draft_dir)
            except (ValueError, FileNotFoundError) as exc:
                raise SessionError("--draft", str(exc)) from exc
        max_positions = _max_positions(target_dir, draft_dir)
        if max_positions is not None:
            try:
                prompt_budget(max_positions, config.max_new_tokens, config.depth)
            except ValueError as exc:
                raise SessionError("--max-new-tokens", str(exc)) from exc
        try:
            prompts = load_prompts(config.prompts, parse_categories(getattr(config, "category", None)))
        except UnknownCategoryError as exc:
            raise SessionError("--category", str(exc)) from exc
        except (ValueError, FileNotFoundError) as exc:
            raise SessionError("--prompts", str(exc)) from exc
        self.prompts = prompts[: config.num_prompts]
        if len(prompts) < config.num_prompts:
            sys.stderr.write(
                f"--num-prompts {config.num_prompts}: only {len(prompts)} prompts in {config.prompts!r}; "
                f"using {len(prompts)}\n"
            )
        try:
            target = load_target(target_dir, config.device, config.dtype)
        except UnsupportedArchitectureError as exc:
            raise SessionError("--model", str(exc)) from exc
        except (ValueError, FileNotFoundError) as exc:
            raise SessionError("--model", str(exc)) from exc
        try:  # sliding windows are reproduced by the tree masks; other layer types are refused
            attention_layout(target.config)
        except ValueError as exc:
            raise SessionError("--model", f"{target_dir}: {exc}") from exc
        self.tokenizer = _load_tokenizer(target_dir, draft_dir)
        self.prompt_ids = [list(self.tokenizer.encode(p.text)) for p in self.prompts]
        for i, ids in enumerate(self.prompt_ids):
            if not ids:
                raise SessionError("--prompts", f"prompt {i} ({self.prompts[i].source}) tokenizes to nothing")
        self.prompt_ids = fit_prompts_to_positions(
            self.prompt_ids, config.max_new_tokens, config.depth, max_positions
        )
        spec = describe_moe(target)
        cache_experts = config.cache_experts
        if cache_experts is not None and cache_experts > spec.num_experts:
            raise SessionError(
                "--cache",
                f"expected 0..{spec.num_experts} (the experts per layer of this model), got {cache_experts}",
            )
        frequency = None
        if config.cache_policy == "static":
            if not str(config.device).startswith("cpu"):
                raise SessionError(
                    "--cache-policy",
                    "static is not available with a CUDA device yet: its expert frequencies are "
                    "counted by a forward pass before offloading, while the experts are still on the "
                    "host and the rest of the model on the device; use lru or lfu",
                )
            frequency = _expert_frequency(target, self.prompt_ids, spec.num_experts)
        try:
            link = make_link(config.device, config.bandwidth_gb_per_s, config.latency_s)
            self.offload = offload_model(
                target,
                cache_experts=cache_experts,
                cache_policy=config.cache_policy,
                link=link,
                frequency=frequency,
                overlap=config.overlap == "on",
                prefetch=config.prefetch,
                # dense traces carry the next-layer guesses, so sim.replay can replay that prefetch
                record_next_layer=config.mode == "dense",
            )
        except ValueError as exc:
            raise SessionError("--cache" if "cache" in str(exc) else "--device", str(exc)) from exc
        self.spec = spec
        self.drafter, features = None, None
        if draft_dir is not None:
            self.drafter, features = _load_drafter(draft_dir, target_dir, target, config)
        self.verifier = TreeVerifier(
            target,
            eos_token_ids=_eos_ids(target, self.tokenizer),
            features=features,
            float32_logits=getattr(config, "verify_logits", "model") == "float32",
        )
        self.shape = TreeShape(config.depth, config.topk, config.max_nodes)
        self.decoder = SpecDecoder(self.verifier, self.drafter, stats=self.offload)
        self.chooser = self._make_chooser()
        self.target_dir, self.draft_dir = target_dir, draft_dir
        self.writer = self._open_writer()
        self.resume_info = self._rebuild_cache() if config.resume else {}
        return self

    def _make_chooser(self) -> SubtreeChooser:
        config = self.config
        if config.policy == "ar":
            return AutoregressiveChooser()
        if config.policy == "full":
            # dense mode records the union of the level trees (what a policy run's stopping rule sees)
            return FullTreeChooser(self.drafter, self.shape, level_union=config.mode == "dense")
        from live.spec.planning import PlannedChooser

        if config.cost is not None:
            from specfit.cost import CycleCostModel

            try:
                cost = CycleCostModel.load(config.cost)
            except (ValueError, OSError) as exc:
                raise SessionError("--cost", str(exc)) from exc
            for field, model_value in (
                ("num_layers", self.offload.num_layers),
                ("expert_bytes", self.offload.bytes_per_expert),
            ):
                if getattr(cost, field) != model_value:
                    raise SessionError(
                        "--cost",
                        f"{config.cost}: field {field!r} is {getattr(cost, field)} but the model has "
                        f"{model_value}; this cost model was fitted for another model (refit with "
                        "`python -m calibration.fit` on runs of this one)",
                    )
        elif (cost := self._recorded_cost_model()) is not None:
            pass  # --resume: the cost model the run's planner used (not a new, differently timed estimate)
        else:
            from live.spec.costs import estimate_cost_model

            cost = estimate_cost_model(
                self.verifier, self.drafter, self.offload, self.shape, self.prompt_ids[0]
            )
            self.offload.reset_cache()
            self.offload.reset_stats()
        if config.overlap == "on":  # the planner prices copies as this engine overlaps them
            cost = dataclasses.replace(cost, overlap_h2d=True, overlap_mode="on")
        prefetch = (uses_draft(config.prefetch), uses_next_layer(config.prefetch))
        if prefetch != (cost.draft_prefetch, cost.next_layer_prefetch):  # ... and as it prefetches them
            cost = dataclasses.replace(cost, draft_prefetch=prefetch[0], next_layer_prefetch=prefetch[1])
        self.cost = cost
        calibration = None
        if config.acceptance is not None:
            import json

            from specfit.acceptance import AcceptanceCalibration

            try:
                calibration = AcceptanceCalibration.from_dict(json.loads(Path(config.acceptance).read_text()))
            except (ValueError, KeyError, TypeError, OSError) as exc:
                raise SessionError("--acceptance", f"{config.acceptance}: {exc}") from exc
        tables = (
            _load_predictor_tables(config.predictor_tables, self.spec.num_layers, self.spec.num_experts)
            if config.predictor_tables
            else None
        )
        try:
            return PlannedChooser(
                self.drafter,
                self.shape,
                config.policy,
                config.predictor,
                cost,
                self.spec.num_experts,
                calibration=calibration,
                tables=tables,
                stopping=getattr(config, "stopping", None),
            )
        except ValueError as exc:
            raise SessionError("--stopping" if "stopping" in str(exc) else "--policy", str(exc)) from exc

    def _recorded_cost_model(self):
        """On ``--resume``, the ``CycleCostModel`` recorded in the run's manifest (``config.cost_model``;
        the quick estimate of the first call), else ``None``."""
        if not self.config.resume:
            return None
        from specfit.cost import CycleCostModel
        from traces.reader import read_manifest

        try:
            recorded = read_manifest(self.config.out).config.get("cost_model")
            return (
                None if recorded is None else CycleCostModel.from_dict(recorded, where="manifest cost_model")
            )
        except (OSError, ValueError, TypeError) as exc:
            raise SessionError(
                "--resume", f"{self.config.out}: unreadable recorded cost model: {exc}"
            ) from None

    def _rebuild_cache(self) -> dict[str, Any]:
        """``--resume``: bring the expert cache to the state an uninterrupted run has here.

        Replays, through the same ``specfit.cache`` object and in the order they ran (request id
        order: a run decodes its prompts in order and a resume re-decodes only the unfinished
        ones), every recorded access of the finished requests: each prefill forward (the union of
        its tokens' experts per layer, from ``prefill``) and each cycle's verification forward
        (``cycles.layer_accessed`` / ``accessed_experts``). The cache's policy state and its
        statistics (the miss-fraction averages the union-size predictor prices with) then equal
        an uninterrupted run's, and the device pool is filled to match (uncounted warm copies).
        A run recorded without those columns starts with a cold cache (``cache`` says so).

        Returns:
            The resume facts for the summary and the manifest: ``resumed_from_request`` (first
            request decoded now, None when none is left), ``requests_finished_before``,
            ``cache`` (``"rebuilt"``, ``"rebuilt-without-prefetches"`` with ``--prefetch``, whose
            warms are not recorded, or ``"cold"``), ``cache_cycles_replayed``, ``planner_state``
            (:meth:`_restore_planner_state`: what the planner learned, e.g. SpecFit's running
            root-acceptance estimate, from ``planner_state.json``).
        """
        from live.spec.recording import split_accesses
        from traces.reader import open_run

        done = sorted(self.writer.recorded_request_ids())
        finished = set(done)
        todo = [i for i in range(len(self.prompts)) if i not in finished]
        cache = self.offload.cache
        run = open_run(self.config.out, validate=False)
        cycles = run.arrow("cycles").select(
            ["request_id", "cycle_index", "layer_accessed", "accessed_experts"]
        )
        frame = cycles.to_pandas().sort_values(["request_id", "cycle_index"], kind="stable")
        prefill_ids = set(run.arrow("prefill").column("request_id").to_numpy().tolist())
        by_request = dict(iter(frame.groupby("request_id", sort=True)))
        replayed, rebuilt = 0, True
        for request_id in done:
            if request_id in prefill_ids:
                experts = run.prefill_experts(request_id)
                for layer in range(experts.shape[1]):
                    cache.access(layer, experts[:, layer, :])
            rows = by_request.get(request_id)
            if rows is None:
                continue
            if rows["layer_accessed"].isna().any():
                rebuilt = False
                break
            for counts, ids in zip(rows["layer_accessed"], rows["accessed_experts"]):
                for layer, layer_ids in enumerate(split_accesses(counts, ids)):
                    cache.access(layer, layer_ids)
                replayed += 1
        if rebuilt:
            self.offload.set_cache(cache)  # the pool holds what the cache holds
        else:
            self.offload.reset_cache()
        planner = self._restore_planner_state(done[-1] if done else None)
        # prefetch warms (--prefetch) are not recorded: the replay leaves them out
        approx = rebuilt and getattr(self.config, "prefetch", "none") != "none"
        info = {
            "resumed_from_request": todo[0] if todo else None,
            "requests_finished_before": len(done),
            "cache": ("rebuilt-without-prefetches" if approx else "rebuilt") if rebuilt else "cold",
            "cache_cycles_replayed": replayed if rebuilt else 0,
            "planner_state": planner,
        }
        cache_text = (
            f"expert cache rebuilt from {replayed} recorded cycles and their prefills"
            + (" (without the prefetches, which are not recorded: it may differ)" if approx else "")
            if rebuilt
            else "expert cache starts cold (cycles recorded without their cache accesses)"
        )
        planner_text = {
            "restored": "; planner state restored",
            "reset": f"; planner state starts afresh (no {PLANNER_STATE_NAME} of request {done[-1] if done else '-'})",
            "none": "",
        }[planner]
        where = f"continuing at request {todo[0]}" if todo else "no request left to decode"
        sys.stderr.write(
            f"resuming {self.config.out}: {len(done)} of {len(self.prompts)} requests finished; {where}; "
            f"{cache_text}{planner_text}\n"
        )
        from traces.schema import utc_now_iso

        resumes = list(self.writer.manifest.config.get("resumes", []))
        self.writer.update_config(resumes=[*resumes, {"at": utc_now_iso(), **info}])
        return info

    def _manifest(self):
        from traces.schema import DraftSpec, HardwareSpec, Manifest, ModelSpec, RunConfig

        config, spec, info = self.config, self.spec, self.offload.link.info
        memory = "emulated" if info.kind == "cpu-emulated" else ("pinned" if info.pinned else "pageable")
        model = ModelSpec(
            name="default" if config.model == "default" else str(config.model),
            architecture=type(self.verifier.lm.model).__name__,
            num_layers=spec.num_layers,
            num_experts=spec.num_experts,
            top_k=spec.top_k,
            hidden_size=spec.hidden_size,
            expert_intermediate_size=spec.expert_intermediate_size,
            dtype=spec.dtype,
            bytes_per_expert=spec.bytes_per_expert,
        )
        hardware = HardwareSpec(
            device_name=info.device,
            link_kind=info.kind,
            h2d_memory=memory,
            emulated_bandwidth_bytes_per_s=info.bandwidth_bytes_per_s if memory == "emulated" else None,
            emulated_s_per_transfer=info.latency_s if memory == "emulated" else None,
        )
        draft = DraftSpec(
            model=str(self.config.draft or "none"),
            kind=getattr(self.drafter, "kind", "none"),
            tree_depth=max(config.depth, 1),
            tree_topk=config.topk,
            max_nodes=max(config.max_nodes, 2),
        )
        run = RunConfig(
            mode=config.mode,
            prompt_source=config.prompts,
            tree_policy=config.policy if config.mode == "policy" else None,
            cache_policy=config.cache_policy,
            cache_capacity_per_layer=self.offload.capacity_per_layer,
            predictor=config.predictor if config.policy in PLANNED_POLICIES else None,
        )
        from dataclasses import asdict

        resolved = asdict(config) | {
            "target_dir": str(self.target_dir),
            "draft_dir": self.draft_dir and str(self.draft_dir),
        }
        resolved["weights_sha256"] = {
            name: _weights_sha256(folder)
            for name, folder in (("target", self.target_dir), ("draft", self.draft_dir))
        }
        if getattr(self, "cost", None) is not None:
            resolved["cost_model"] = self.cost.to_dict()
        return Manifest.create(
            model, hardware, draft, run, seed=config.seed, command_line=sys.argv, config=resolved
        )

    def _open_writer(self):
        from traces.writer import TraceWriter

        try:
            return TraceWriter(self.config.out, self._manifest(), resume=self.config.resume)
        except (FileExistsError, FileNotFoundError, ValueError) as exc:
            raise SessionError("--resume" if self.config.resume else "--out", str(exc)) from exc

    def _request_totals_path(self) -> Path:
        return Path(self.config.out) / REQUEST_TOTALS_NAME

    def _load_request_totals(self) -> dict[int, RunTotals]:
        """Per-request totals of earlier calls on this run (``request_totals.json``; empty when absent)."""
        path = self._request_totals_path()
        if not path.is_file():
            return {}
        try:
            raw = json.loads(path.read_text())
            return {int(k): RunTotals.from_state(v) for k, v in raw.items()}
        except (ValueError, TypeError, AttributeError) as exc:
            raise SessionError(
                "--resume", f"{path}: unreadable per-request totals ({exc}); delete it to go on"
            ) from None

    def _save_request_totals(self, per_request: dict[int, RunTotals]) -> None:
        """Write ``request_totals.json`` atomically (a kill never leaves half a file)."""
        path = self._request_totals_path()
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({str(k): v.to_state() for k, v in sorted(per_request.items())}))
        os.replace(tmp, path)

    def _save_planner_state(self, request_id: int) -> None:
        """Write ``planner_state.json`` (atomic): the chooser's learned state after ``request_id``
        beside the one after the request before it. Called before the request's row is written,
        so whenever a run is killed the file holds the state after its last finished request."""
        state_dict = getattr(self.chooser, "state_dict", None)
        if state_dict is None:
            return
        path = Path(self.config.out) / PLANNER_STATE_NAME
        previous = self._read_planner_states()
        kept = {k: v for k, v in previous.items() if int(k) in self.writer.recorded_request_ids()}
        latest = dict(sorted(kept.items(), key=lambda kv: int(kv[0]))[-1:])
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"after_request": {**latest, str(int(request_id)): state_dict()}}))
        os.replace(tmp, path)

    def _read_planner_states(self) -> dict[str, Any]:
        """``planner_state.json``'s states by request id (empty when absent or unreadable)."""
        try:
            states = json.loads((Path(self.config.out) / PLANNER_STATE_NAME).read_text())["after_request"]
            return dict(states) if isinstance(states, dict) else {}
        except (OSError, ValueError, TypeError, KeyError):
            return {}

    def _restore_planner_state(self, last_done: int | None) -> str:
        """``--resume``: load the chooser's state saved after the last finished request; returns
        ``"restored"``, ``"none"`` (nothing to learn: no planner, or no finished request) or
        ``"reset"`` (no such state, e.g. a run recorded before ``planner_state.json`` existed:
        the planner starts afresh)."""
        load = getattr(self.chooser, "load_state_dict", None)
        if load is None or last_done is None:
            return "none"
        state = self._read_planner_states().get(str(int(last_done)))
        if state is None:
            return "reset"
        try:
            load(state)
        except ValueError:
            return "reset"
        return "restored"

    def run(self, progress: bool = True) -> RunTotals:
        """Decode every prompt not yet recorded; stream trees and cycles to the trace; return the
        totals of this call. Afterwards ``run_totals`` holds the whole run's totals (this call's
        requests plus earlier calls' from ``request_totals.json``) and ``run_totals_cover`` is
        ``(requests with totals, requests recorded)``.

        Raises:
            SessionError: ``request_totals.json`` of an earlier call is unreadable (flag --resume).
        """
        from tqdm import tqdm

        config = self.config
        done = self.writer.recorded_request_ids()
        todo = [i for i in range(len(self.prompts)) if i not in done]
        totals = RunTotals()
        dense = config.mode == "dense"
        bar = tqdm(
            total=len(todo) * config.max_new_tokens,
            unit="tok",
            desc=f"live.record {config.mode}",
            disable=not progress,
            file=sys.stderr,
        )
        # Python's cyclic GC, left alone, now and then runs a full collection inside a cycle that
        # traverses every object the loaded models (and, in a process that recorded runs before,
        # their garbage) hold: pauses of 0.1-1 s on this CPU, landing in whatever draft or verify
        # was timing, which the simulator rightly does not model. Collect once and freeze the
        # survivors (the models, the engine) so collections while decoding walk only the
        # cycles' own young objects; unfreeze after, so the models can be freed (heap_frozen).
        gc.collect()
        with heap_frozen():
            # the machine-speed gauge (live.speed_probe): before the first request and after each
            # one, never inside a cycle, so no recorded timing includes it
            from live.speed_probe import SpeedProbe

            # (the target's own attention + router on a fixed input, and a fixed matrix chain)
            self.speed_probe = SpeedProbe(device=str(config.device), model=self.verifier.lm.model)
            try:
                if todo:
                    self.speed_probe.measure()
                per_request = {k: v for k, v in self._load_request_totals().items() if k in done}
                for request_id in todo:

                    def on_cycle(event, request_id=request_id):
                        if dense:
                            write_tree(self.writer, request_id, event)
                        self.writer.add_cycle(cycle_record(request_id, event, config.policy))
                        write_transfers(self.writer, request_id, event)
                        bar.update(len(event.committed))

                    ids = self.prompt_ids[request_id]
                    result = self.decoder.generate(
                        ids, config.max_new_tokens, self.chooser, dense=dense, on_cycle=on_cycle
                    )
                    bar.update(config.max_new_tokens - len(result.generated_ids))
                    if len(result.prefill_expert_ids):  # a one-token prompt has no prefill forward
                        self.writer.add_prefill(
                            request_id,
                            result.prefill_expert_ids,
                            result.prefill_router_weights,
                            result.prefill_next_layer_ids,
                        )
                    prompt = self.prompts[request_id]
                    self._save_planner_state(request_id)  # before the request is on disk: see the method
                    self.writer.add_request(request_id, ids, result.generated_ids, prompt.source, prompt.category)
                    totals.add(result)
                    per_request[request_id] = RunTotals()
                    per_request[request_id].add(result)
                    self._save_request_totals(per_request)
                    self.speed_probe.measure()
                self.writer.close(complete=True)
            except BaseException:
                self.writer.close(complete=False)
                raise
            finally:
                bar.close()
        # the whole run: this call's requests and those of earlier calls that kept their totals
        self.run_totals = RunTotals()
        for request_totals in per_request.values():
            self.run_totals.merge(request_totals)
        self.run_totals_cover = (len(per_request), len(set(done) | set(todo)))
        return totals

    def write_summary(self, summary: dict[str, Any], config: dict[str, Any]) -> Path:
        """Write ``summary.json`` (figures + resolved config) into the run directory."""
        from live.record import dump_json

        path = Path(self.config.out) / "summary.json"
        dump_json(path, {"summary": summary, "config": config, "link": self.offload.link.info.to_dict()})
        return path

    def print_table(self, summary: dict[str, Any], stream=None) -> None:
        """Human-readable summary table (stdout). In dense mode the figures are labelled as what
        they are (the whole tree verified at every position, one token committed per cycle) and
        a closing note says how to get a policy's tau and tokens/s."""
        from specfit.units import bytes_to_gb, s_to_ms

        stream = stream or sys.stdout
        dense = summary["mode"] == "dense"
        if dense:
            speed = (
                "tokens/s (recording dense trace)",
                f"{summary['tokens_per_s']:.2f}  (not a policy's throughput)",
            )
            taus = [
                ("tau of the full tree", f"{summary['full_tree_tau']:.3f}  (accepted path + bonus)"),
                ("committed per cycle", f"{summary['tau']:.3f}  (1 by design in dense mode)"),
            ]
        else:
            speed = ("tokens/s (decode)", f"{summary['tokens_per_s']:.2f}")
            taus = [
                ("tau (committed per cycle)", f"{summary['tau']:.3f}"),
                ("tau of the verified tree", f"{summary['full_tree_tau']:.3f}"),
            ]
        busy = summary["expert_compute_s"] + summary["h2d_s"]
        split = (
            f"{summary['expert_compute_s'] / busy:.0%} / {summary['h2d_s'] / busy:.0%}" if busy > 0 else "-"
        )
        rows = [
            ("run directory", summary["run_dir"]),
            ("mode / policy", f"{summary['mode']} / {summary['policy']}"),
            ("drafter", getattr(self.drafter, "kind", "none")),
            ("requests", summary["num_requests"]),
            *(
                [
                    (
                        "summary covers",
                        f"{summary['summary_covers']} ({summary['num_requests_recorded']} recorded in all)",
                    )
                ]
                if summary.get("summary_covers") and summary.get("num_requests_recorded") is not None
                else []
            ),
            ("tokens generated", summary["num_tokens"]),
            speed,
            *taus,
            ("mean nodes verified", f"{summary['mean_nodes_verified']:.2f}"),
            ("expert cache hit rate", f"{summary['hit_rate']:.3f}"),
            ("H2D GB", f"{bytes_to_gb(summary['h2d_bytes']):.4f}"),
            (
                "time: draft / verify / H2D s",
                f"{summary['draft_s']:.2f} / {summary['verify_s']:.2f} / {summary['h2d_s']:.2f}",
            ),
            ("expert compute / H2D split", split),
            (
                "decision per cycle (planner)",
                f"{s_to_ms(summary['decision_s_per_cycle']):.3f} ms"
                + (
                    f"; deadline hit in {summary['planner_deadline_hits']} cycles, mean gap {summary['planner_mean_gap']:.2%}"
                    if summary.get("planner_deadline_hits")
                    else ""
                ),
            ),
        ]
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            stream.write(f"{key:<{width}}  {value}\n")
        if dense:
            stream.write(
                "dense mode verifies the whole drafted tree at every position and commits one token per "
                "cycle, to record every node's routing; for a policy's tau and tokens/s run "
                f"--mode policy, or replay this trace: python -m sim.sweep --trace {summary['run_dir']}\n"
            )
