"""Which dense trace a sweep replays: the shipped sample, a synthetic real-shape trace, or a path.

``--trace auto`` (the default) uses the sample trace shipped with the repository
(``traces/samples/default/``) when it exists and otherwise a synthetic trace of a real model's
shape (:func:`traces.synthetic.generate_dense_trace`), generated once into
``runs/sim/traces/<name>-<hash>/`` and reused (the hash covers every generation parameter).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_SYNTHETIC_SHAPE = "qwen3-30b-a3b"


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of the synthetic trace a sweep generates (see ``traces.synthetic``).

    Tree geometry and routing / acceptance parameters left ``None`` come from the shape's
    calibration to public figures (:mod:`traces.synthcal`: EAGLE-3's tree, depth 7, 60 nodes,
    top-10 per level; docs/reference-figures.md) when ``calibrated``, else from the generator's
    defaults.
    """

    shape: str = DEFAULT_SYNTHETIC_SHAPE
    num_requests: int = 2
    positions_per_request: int = 96
    prompt_len: int = 32
    tree_depth: int | None = None
    tree_topk: int | None = None
    max_nodes: int | None = None
    seed: int = 0
    calibrated: bool = True

    def key(self) -> str:
        """Directory name: ``synthetic-<shape>-<12 hex of the parameters' hash>``."""
        blob = json.dumps(asdict(self), sort_keys=True)
        return f"synthetic-{self.shape}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def sample_trace_dir() -> Path:
    """``traces/samples/default`` of the installed ``traces`` package (may not exist)."""
    import traces

    return Path(traces.__file__).resolve().parent / "samples" / "default"


def synthetic_trace(spec: SyntheticSpec, root: Path) -> Path:
    """Path of the synthetic trace ``spec`` under ``root``, generating it if absent.

    Generation writes to a temporary sibling and renames it, so concurrent sweeps never see a
    half-written trace.

    Raises:
        ValueError: bad parameter or unknown shape name (from ``traces.synthetic``).
    """
    from traces.synthetic import generate_dense_trace, resolve_config

    out = root / spec.key()
    if (out / "manifest.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{spec.key()}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    params = asdict(spec)
    shape, calibrated = params.pop("shape"), params.pop("calibrated")
    cfg = resolve_config(shape, calibrated, **params)
    generate_dense_trace(tmp, shape, command_line=["sim.sweep", "--trace", f"synthetic:{shape}"], **asdict(cfg))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_trace(spec: str, *, synthetic: SyntheticSpec, root: Path) -> tuple[Path, str]:
    """Resolve ``--trace`` to a run directory and a one-line description of where it came from.

    Args:
        spec: ``"auto"``, ``"sample"``, ``"synthetic"``, ``"synthetic:<shape>"`` or a run directory.
        synthetic: generation parameters for the synthetic cases (its shape is replaced by the
            ``synthetic:<shape>`` suffix when given).
        root: where synthetic traces are generated (``runs/sim/traces``).

    Raises:
        ValueError: ``"sample"`` without a shipped sample, or a path without ``manifest.json``.
    """
    sample = sample_trace_dir()
    if spec == "auto":
        if (sample / "manifest.json").is_file():
            return sample, f"shipped sample trace {sample}"
        spec = "synthetic"
    if spec == "sample":
        if not (sample / "manifest.json").is_file():
            raise ValueError(f"--trace: no sample trace shipped at {sample}")
        return sample, f"shipped sample trace {sample}"
    if spec == "synthetic" or spec.startswith("synthetic:"):
        shape = spec.partition(":")[2] or synthetic.shape
        chosen = SyntheticSpec(**{**asdict(synthetic), "shape": shape})
        path = synthetic_trace(chosen, root)
        calibrated = "calibrated to public figures, traces/synthcal.py" if chosen.calibrated else "uncalibrated"
        return path, (
            f"synthetic {shape} trace {path} ({calibrated}; {chosen.num_requests} "
            f"request{'' if chosen.num_requests == 1 else 's'} x "
            f"{chosen.positions_per_request} positions, seed {chosen.seed})"
        )
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"--trace: {path} does not exist (expected a trace run directory, sample or synthetic[:SHAPE])")
    if not (path / "manifest.json").is_file():
        raise ValueError(f"--trace: {path} is not a trace run directory (no manifest.json)")
    return path, f"trace {path}"
