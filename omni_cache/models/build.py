"""The one build step every embedded-model builder shares, and what a model directory is.

A builder (:func:`omni_cache.models.qwen3.build_qwen3_omni`, the Gemma and full-size ones)
names its sizes (:func:`check_size`), a fingerprint of everything that determines its output
and a ``write`` function; :func:`build_once` does the rest the same way for all of them: skip
the build when the directory's stamp records the same fingerprint, else write the files and
then the stamp (last, so an interrupted build is rebuilt next time). Seeded weights are made
one way (:func:`save_seeded`).

Also here: where models go by default (:func:`models_home`), the notice a user of an embedded
model is shown, and :func:`model_kind` (embedded or a checkpoint), which reads the stamps.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

from omni_cache import settings

#: the seed of every embedded model's weights
SEED = 1234
#: the build stamp a builder writes into its directory (JSON; ``fingerprint`` + the builder's fields)
STAMP = "omni_cache_model.json"
#: the stamp of a Gemma pipeline directory (a Qwen3-Omni with a KV-shared thinker in ``thinker/``)
PIPELINE_STAMP = "omni_cache_gemma_omni.json"
#: Build stamps the embedded model builders write (:func:`model_kind` looks for them).
EMBEDDED_STAMPS = (STAMP, PIPELINE_STAMP)
#: What a user of the embedded model must be told before listening to it (``omni-cache
#: make-model`` / ``run`` print it; the README says the same).
EMBEDDED_MODEL_NOTICE = (
    "note: this model was built by 'omni-cache make-model' and has no trained weights (seeded "
    "random ones; none for --size full, which runs on vLLM's dummy weights). Its text is not "
    "language and its audio is near-silent noise; it exists to run and test the real pipeline and "
    "the cache without downloads. For real answers pass --model DIR with a real Qwen3-Omni "
    "checkpoint (e.g. Qwen/Qwen3-Omni-30B-A3B-Instruct) and a GPU stage config (--stage-config "
    "qwen3_omni_30b_a3b_gpu.yaml; README, 'On GPUs')."
)


def fingerprint(payload: object) -> str:
    """A 16-hex-digit digest of ``payload`` (anything JSON-able: configs, seed, format version).

    Raises:
        TypeError: ``payload`` is not JSON-able.
    """
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def is_up_to_date(stamp: Path, fp: str) -> bool:
    """Whether the build stamp file ``stamp`` records the fingerprint ``fp``; False when it is
    missing or unreadable."""
    try:
        return json.loads(stamp.read_text()).get("fingerprint") == fp
    except (OSError, ValueError):
        return False


def check_size(size: str, sizes: Container[str], what: str) -> None:
    """Raise ``KeyError`` naming the choices when ``size`` is not one of ``sizes`` (``what``:
    the builder, e.g. ``"gemma4 thinker"``)."""
    if size not in sizes:
        raise KeyError(f"unknown {what} size {size!r}; choose one of {sorted(sizes)}")


def build_once(out_dir: str | os.PathLike, fp: str, write: Callable[[Path], dict], *, force: bool = False,
               stamp: str = STAMP, needs: tuple[str, ...] = ()) -> Path:
    """Build a model directory unless it already holds this exact build.

    Args:
        out_dir: the model directory (created).
        fp: the build's fingerprint (:func:`fingerprint`).
        write: writes the files into the directory; returns the stamp's fields (JSON-able;
            ``fingerprint`` is added).
        force: build even when the stamp records ``fp``.
        stamp: the stamp's file name in the directory.
        needs: files that must also exist for the directory to count as built.

    Returns:
        The model directory.

    Raises:
        Whatever ``write`` raises; the stamp is then not written, so the next call rebuilds.
    """
    out = Path(out_dir)
    path = out / stamp
    if not force and is_up_to_date(path, fp) and all((out / f).exists() for f in needs):
        return out
    out.mkdir(parents=True, exist_ok=True)
    fields = write(out)
    path.write_text(json.dumps({**fields, "fingerprint": fp}, indent=2))
    return out


def save_seeded(out: Path, model_cls: Any, config: Any, *, init: Callable[[Any], object] | None = None) -> None:
    """Construct ``model_cls(config)`` on the CPU with transformers' init under seed
    :data:`SEED`, apply ``init(model)`` (weights transformers leaves unset), and save it as
    safetensors into ``out``.

    Raises:
        Whatever transformers raises for a malformed ``config``.
    """
    import torch

    torch.manual_seed(SEED)
    with torch.device("cpu"):
        model = model_cls(config)
    if init is not None:
        init(model)
    model.save_pretrained(out, safe_serialization=True)


def models_home() -> Path:
    """``$OMNI_CACHE_HOME/models`` (``OMNI_CACHE_HOME`` defaults to ``~/.cache/omni-cache``)."""
    return Path(settings.HOME.get() or Path.home() / ".cache" / "omni-cache") / "models"


class ModelKind(enum.StrEnum):
    """What a model directory holds, as ``omni-cache run`` records it in ``summary.json``."""

    #: built by ``omni-cache make-model`` (:mod:`omni_cache.models`): seeded random weights,
    #: or none (``load_format: dummy``)
    EMBEDDED = "embedded-untrained"
    #: anything else (a downloaded or trained checkpoint, or a model id)
    CHECKPOINT = "checkpoint"


def model_kind(model_dir: str | os.PathLike) -> ModelKind:
    """:attr:`ModelKind.EMBEDDED` if ``model_dir`` carries an embedded builder's stamp
    (:data:`EMBEDDED_STAMPS`), else :attr:`ModelKind.CHECKPOINT` (also for a model id that is
    not a local directory). Never raises."""
    d = Path(model_dir)
    return ModelKind.EMBEDDED if any((d / s).is_file() for s in EMBEDDED_STAMPS) else ModelKind.CHECKPOINT
