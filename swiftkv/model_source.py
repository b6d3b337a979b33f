"""Model references, read the same way by every CLI verb, job and benchmark: a local folder,
``bundled`` (the bundled SmolLM2-135M-Instruct), a remote folder (``s3://``, ``gs://``: any fsspec
URI; copied once per node and per upload into ``$SWIFTKV_CACHE/models``) or a Hugging Face hub id."""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

import fsspec
from fsspec.callbacks import TqdmCallback

from swiftkv.bundled import BUNDLED, MODEL_DIR_NAME, cache_root, ensure_bundled_model
from swiftkv.file_modes import make_readable

log = logging.getLogger(__name__)

BUNDLED_SWIFTKV = "bundled-swiftkv"
"""The bundled SmolLM2-135M-Instruct converted to 50% SwiftKV (c=15; initial, undistilled weights)."""

MODEL_HELP = (f"model: local folder, {BUNDLED!r} (the bundled SmolLM2-135M-Instruct), {BUNDLED_SWIFTKV!r} "
              "(its 50%% SwiftKV conversion, undistilled), s3://... folder or hub id")


def checkpoint_stamp(ref: str | Path) -> str:
    """What identifies the current contents of the checkpoint ``ref`` names: for a folder or a
    remote folder URI, the reference plus the write time, size and ETag of its ``config.json``
    (saving or uploading a checkpoint again to the same place changes it); for ``bundled``,
    ``bundled-swiftkv`` and hub ids, the reference itself."""
    ref = str(ref)
    local = Path(ref).expanduser()
    if "://" not in ref and not local.is_dir():
        return ref
    fs, path = fsspec.core.url_to_fs(ref if "://" in ref else str(local))
    config = f"{path.rstrip('/')}/config.json"
    if not fs.exists(config):
        raise FileNotFoundError(f"model {ref!r} has no config.json: not a Hugging Face checkpoint folder")
    info = fs.info(config)  # the ETag too: object stores stamp writes to the second only
    return f"{ref}@{fs.modified(config).isoformat()}/{info.get('size')}/{info.get('ETag', '')}"


def _download(uri: str) -> Path:
    """Copy a remote checkpoint folder once per node into the local cache (atomically: a folder
    appears whole or not at all, so concurrent workers on one node never read a partial copy). The
    copy is keyed by :func:`checkpoint_stamp`, so a model uploaded again to the same place is copied
    again rather than served stale."""
    key = checkpoint_stamp(uri)
    fs, path = fsspec.core.url_to_fs(uri)
    local = cache_root() / "models" / hashlib.sha1(key.encode()).hexdigest()[:16]
    if (local / "config.json").is_file():
        return local
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=local.parent))
    log.info("copying model %s to %s", uri, local)
    try:
        fs.get(path.rstrip("/") + "/", str(tmp), recursive=True,
               callback=TqdmCallback(tqdm_kwargs={"desc": f"copying {uri}", "unit": "file"}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no partial copy is left in the cache
        raise
    make_readable(tmp)
    try:
        tmp.rename(local)
    except OSError:  # another process on this node finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return local


def _check_hub_id(ref: str) -> None:
    """Fetch the hub model's config.json (which ``from_pretrained`` reads first anyway), so that a
    mistyped folder or an unreachable hub is one clear error here, not a loader's traceback."""
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(ref, "config.json")
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(
            f"model {ref!r} is not a local folder, {BUNDLED!r}, {BUNDLED_SWIFTKV!r}, a remote folder URI "
            "(s3://...) or a hub id "
            f"this machine can load ({reason})"
        ) from err


def _bundled_swiftkv() -> Path:
    """Convert the bundled model to 50% SwiftKV once per node (under a lock: replicas starting
    together on one node convert it once)."""
    from filelock import FileLock

    from swiftkv.convert import convert_checkpoint

    out = cache_root() / f"{MODEL_DIR_NAME}-swiftkv-50"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").is_file():
            convert_checkpoint(str(ensure_bundled_model()), out, cutoff=0.5, overwrite=True)
    return out


def resolve_model(ref: str | Path) -> str:
    """A local folder (or a loadable hub id) for the model reference ``ref``."""
    ref = str(ref)
    if ref == BUNDLED:
        return str(ensure_bundled_model())
    if ref == BUNDLED_SWIFTKV:
        return str(_bundled_swiftkv())
    if "://" in ref:
        return str(_download(ref))
    path = Path(ref).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise FileNotFoundError(f"model {ref} is a file; a model is a checkpoint folder")
    if ref.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model folder {ref} does not exist")
    _check_hub_id(ref)
    return ref
