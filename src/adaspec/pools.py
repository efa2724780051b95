"""Pools of trained drafters: the manifest a pool directory holds, and finding a target's pool.

``adaspec build-pool`` (``adaspec.training.pool``) builds a pool under ``cache_dir()/pool/NAME``
and writes ``pool.json``; this module is the runtime's half of that pair and imports nothing
from the tools. ``find_pool`` finds the pool built for a loaded target, whose drafters
``pool_drafters`` adds to the engine's default drafters (issue 16: ``auto`` runs over
prompt lookup, suffix, ``none`` and the trained pool found in the cache).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .artifacts import cache_dir
from .errors import AdaspecError, ConfigError

log = logging.getLogger(__name__)

POOL_FORMAT = "adaspec.pool/1"
GENERALIST = "generalist"
TRAINABLE_KINDS: tuple[str, ...] = ("feature-head", "tiny-lm")
SPEC_KINDS: tuple[str, ...] = (*TRAINABLE_KINDS, "suffix")


@dataclass
class PoolDrafter:
    """One drafter of the pool: a label for tables (``DOMAIN/KIND``) and its spec string."""

    label: str
    domain: str
    kind: str
    spec: str


@dataclass
class PoolEntry:
    """One domain of the pool (or the generalist): its data, drafter specs, reports and times."""

    domain: str
    data: list[str]
    n_samples: int = 0
    n_output_tokens: int = 0
    specs: dict[str, str] = field(default_factory=dict)  # kind -> spec string
    reports: dict[str, Any] = field(default_factory=dict)  # kind or "distill" -> report dict
    train_keys: dict[str, str] = field(default_factory=dict)  # kind -> data + options hash
    times: dict[str, float] = field(default_factory=dict)  # stage -> seconds


@dataclass
class PoolManifest:
    """``pool.json``: which target the pool serves, how it was built, and its drafters."""

    root: Path
    target: dict[str, Any]
    settings: dict[str, Any]
    entries: dict[str, PoolEntry] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    #: kind -> {"key", "seconds", "rows": {drafter entry: {domain: {"mat_k5", "top1", ...}}}}
    heldout: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    format: str = POOL_FORMAT

    @property
    def path(self) -> Path:
        return self.root / "pool.json"

    def drafters(self, kinds: Sequence[str] | None = None,
                 domains: Sequence[str] | None = None) -> list[PoolDrafter]:
        """Drafters in domain order (the generalist last), kinds in ``kinds`` order."""
        kinds = tuple(kinds) if kinds is not None else SPEC_KINDS
        bad = [k for k in kinds if k not in SPEC_KINDS]
        if bad:
            raise ConfigError(f"unknown pool drafter kind(s) {bad}: use {', '.join(SPEC_KINDS)}")
        names = list(domains) if domains is not None else list(self.entries)
        missing = [d for d in names if d not in self.entries]
        if missing:
            raise ConfigError(f"the pool in {self.root} has no domain(s) {missing}: it has "
                              f"{', '.join(self.entries)}")
        return [PoolDrafter(f"{d}/{k}", d, k, self.entries[d].specs[k])
                for d in names for k in kinds if k in self.entries[d].specs]

    def specs(self, kinds: Sequence[str] | None = None, domains: Sequence[str] | None = None) -> list[str]:
        return [d.spec for d in self.drafters(kinds, domains)]

    def default_drafters(self) -> list[PoolDrafter]:
        """The drafters an engine adds by default (``pool_drafters``): every trained drafter, and
        of the datastores only the generalist's when there is one. A domain's datastore indexes
        a subset of the generalist's answers, so its matches are never longer, while looking at
        every datastore costs policy time each round."""
        trained = [d for d in self.drafters() if d.kind != "suffix"]
        stores = self.drafters(("suffix",))
        generalist = [d for d in stores if d.domain == GENERALIST]
        return trained + (generalist or stores)

    def default_specs(self) -> list[str]:
        return [d.spec for d in self.default_drafters()]

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "target": self.target, "root": str(self.root), "created": self.created,
                "settings": self.settings, "times": self.times, "heldout": self.heldout,
                "domains": {k: asdict(v) for k, v in self.entries.items()}}

    def save(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name("pool.json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, default=_json_default) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
        return self.path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # tensors and arrays
        return obj.tolist()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def load_manifest(path: str | Path) -> PoolManifest:
    """Read ``pool.json`` (or the pool directory holding it). A moved pool directory still works:
    paths inside the specs are re-rooted at the manifest's location."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "pool.json"
    if not path.is_file():
        raise AdaspecError(f"no pool manifest at {path}: build the pool with `adaspec build-pool`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise AdaspecError(f"{path} is not valid JSON ({exc}): rebuild the pool") from exc
    if not isinstance(raw, dict) or raw.get("format") != POOL_FORMAT:
        raise AdaspecError(f"{path} is not a pool manifest (format {POOL_FORMAT!r}): rebuild the pool")
    root = path.parent.resolve()
    old_root = str(raw.get("root", root))
    entries: dict[str, PoolEntry] = {}
    for name, e in raw.get("domains", {}).items():
        entry = PoolEntry(**e)
        if old_root != str(root):
            entry.specs = {k: _reroot(v, old_root, str(root)) for k, v in entry.specs.items()}
            entry.data = [_reroot(d, old_root, str(root)) for d in entry.data]
        entries[name] = entry
    return PoolManifest(root=root, target=raw["target"], settings=raw.get("settings", {}), entries=entries,
                        times=raw.get("times", {}), heldout=raw.get("heldout", {}), created=raw.get("created", ""))


def _reroot(text: str, old: str, new: str) -> str:
    """A path (or a spec ``kind:key=PATH``) under the old pool root, moved under the new one."""
    if text.startswith(old):
        return new + text[len(old):]
    return text.replace(f"={old}", f"={new}")


def pool_specs(manifest_or_path: PoolManifest | str | Path, kinds: Sequence[str] | None = None,
               domains: Sequence[str] | None = None) -> list[str]:
    """Drafter spec strings of a pool (all kinds by default: feature-head, tiny-lm, suffix), for
    ``SpeculativeEngine(..., drafters=...)`` or ``adaspec bench -d``."""
    manifest = manifest_or_path if isinstance(manifest_or_path, PoolManifest) else load_manifest(manifest_or_path)
    return manifest.specs(kinds, domains)


def default_pool_root(target: Any, quick: bool = False) -> Path:
    """``cache_dir()/pool/NAME`` (``NAME-quick`` for the smoke version); ``target`` is a name or
    a loaded target."""
    name = target if isinstance(target, str) else target.name
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(str(name)).name or str(name)).strip("-") or "target"
    return cache_dir() / "pool" / (f"{safe}-quick" if quick else safe)


def find_pool(target: Any) -> PoolManifest | None:
    """The pool built for ``target`` in the cache (``default_pool_root``), or None when there is
    none, it is unreadable, or it was built for another model (logged: a stale pool is skipped,
    not used). Only Hugging Face targets are fingerprinted; other backends get None."""
    root = default_pool_root(target)
    if not (root / "pool.json").is_file() or not hasattr(getattr(target, "model", None), "config"):
        return None
    try:
        manifest = load_manifest(root)
    except AdaspecError as exc:
        log.warning("skipping the pool in %s: %s", root, exc)
        return None
    from .models import check_fingerprint  # hashes the target's weights: only when a pool exists

    try:
        check_fingerprint(manifest.target, target, f"the pool in {root}")
    except AdaspecError as exc:
        log.warning("skipping a pool built for another model: %s", exc)
        return None
    return manifest


def pool_drafters(target: Any, pool: str | Path | bool | None, default: bool) -> list[str]:
    """Spec strings of the pool ``SpeculativeEngine(pool=...)`` names: None, the pool built for
    ``target`` in the cache when ``default`` (no drafters were given) and nothing otherwise;
    ``"auto"`` or True, that pool or an error; a directory, that pool; False, nothing. Of a
    pool, its ``PoolManifest.default_drafters`` (the trained ones and the generalist datastore)."""
    if pool is False or (pool is None and not default):
        return []
    if pool is None:
        manifest = find_pool(target)
        if manifest is None:
            return []
        specs = manifest.default_specs()
        log.info("adding %d drafters of the pool in %s (pool=False: without them)", len(specs), manifest.root)
        return specs
    if pool is True or pool == "auto":
        manifest = find_pool(target)
        if manifest is None:
            raise AdaspecError(f"no pool built for {getattr(target, 'name', target)!r} in "
                               f"{default_pool_root(target)}: build it with `adaspec build-pool`, or pass "
                               "a pool directory")
        return manifest.default_specs()
    if isinstance(pool, (str, Path)):
        return load_manifest(pool).default_specs()
    raise ConfigError(f"pool must be None, False, 'auto' or a pool directory, got {pool!r}")
