"""What the server learns across requests, and the state file that keeps it across restarts.

Each configuration (drafters, selector, length policy) has one stored pair of learners. A
request checks out a private copy (its prior: everything learnt so far), drafts with it, and
commits it back when it ends, so requests never share a learner object mid-flight; with a
``scope=global`` policy the copy keeps its statistics, and the next request starts from them.
Per-drafter totals over all requests are kept alongside.

The file is plain JSON: the totals, and each configuration's learners as data
(``state_dict``: ``persist.state_of``), loaded into learners built afresh from the
configuration when a request first checks them out (``load_state_dict``), so the file does
not depend on module paths and loading it runs no code. A file of version 2 (the learners as a
pickle, restricted on load to adaspec policy classes and numpy containers) is read once and
migrated: its learners become data, written as version 3 at the next save. A missing, corrupt
or foreign file (other model or drafters) is logged and ignored: the server starts fresh.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import logging
import os
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..length import LengthPolicy
from ..metrics import RequestStats
from ..persist import dropped_type, load_state, state_of
from ..selection import DrafterPolicy

log = logging.getLogger(__name__)

STATE_VERSION = 3  # 3: the learners as JSON data (``persist``)
#: the pickled learners of earlier servers, read once and migrated (2: q calibration in
#: ConfidenceCalibration, auto's counts decaying lazily; older pickles lack both)
PICKLE_VERSION = 2
MAX_CONFIGS = 32  # stored learner pairs (least recently used are dropped)

Learners = tuple[DrafterPolicy, LengthPolicy]
#: (drafter names, selector spec, length spec, k): identifies one configuration's learners
ConfigKey = tuple[tuple[str, ...], str, str, int]


@dataclass
class DrafterTotals:
    """A drafter's rounds and drafts over every request served."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0


@dataclass
class Totals:
    requests: int = 0
    tokens: int = 0
    drafters: dict[str, DrafterTotals] = field(default_factory=dict)

    def add(self, stats: RequestStats) -> None:
        self.requests += 1
        self.tokens += stats.new_tokens
        for r in stats.rounds:
            t = self.drafters.setdefault(r.drafter, DrafterTotals())
            t.rounds += 1
            t.drafted += r.drafted
            t.accepted += r.accepted
            t.emitted += r.emitted

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens": self.tokens,
                "drafters": {name: {**asdict(t), "acceptance_rate": t.accepted / t.drafted if t.drafted else 0.0,
                                    "mat": t.emitted / t.rounds if t.rounds else 0.0}
                             for name, t in self.drafters.items()}}


_SAFE_BUILTINS = {"list", "dict", "set", "frozenset", "tuple", "int", "float", "complex", "bool",
                  "str", "bytes", "bytearray", "slice", "range", "object"}
_SAFE_ADASPEC = ("adaspec.selection.", "adaspec.length.", "adaspec.costs", "adaspec.feedback",
                 "adaspec.config", "adaspec.serve.state")


@dropped_type
class DroppedFunction:
    """Stands in for a function in a learner of a version-2 file (rebuilt by the policy when
    needed; stored as None once migrated)."""


@dataclass(frozen=True)
class StoredLearners:
    """A configuration's learners as data (``persist.state_of`` of the pair), until a request
    checks them out: then loaded into a pair built afresh (``LearntState.checkout``)."""

    data: list[dict[str, Any]]


class _Unpickler(pickle.Unpickler):
    """Loads a version-2 file's learners: only adaspec policy classes, numpy containers and
    plain builtins; the engine's shared cost model was stored as a reference."""

    def __init__(self, file: io.BytesIO, shared: object):
        super().__init__(file)
        self._shared = shared

    def persistent_load(self, pid: Any) -> object:
        if pid != "shared":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._shared

    def find_class(self, module: str, name: str) -> Any:
        ok = ((module == "builtins" and name in _SAFE_BUILTINS)
              or (module in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray")
                  and name in ("dtype", "ndarray", "_reconstruct", "scalar"))
              or module.startswith("numpy.random.")
              or (module, name) in {("copyreg", "_reconstructor"), ("_codecs", "encode"),
                                     ("collections", "OrderedDict"), ("collections", "deque"),
                                     ("collections", "defaultdict")}
              or module.startswith(_SAFE_ADASPEC))
        found = super().find_class(module, name) if ok else None
        if found is None or (module.startswith("adaspec") and not isinstance(found, type)):
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a state file")
        return found


class LearntState:
    """Learners per configuration and totals, shared by all requests (thread-safe)."""

    def __init__(self, shared: object = None, fingerprint: dict[str, Any] | None = None):
        self._shared = shared  # the engine's cost model, never copied
        self.fingerprint = fingerprint or {}
        self.totals = Totals()
        self._learners: OrderedDict[ConfigKey, Learners | StoredLearners] = OrderedDict()
        self._lock = threading.Lock()
        self.since_save = 0

    def checkout(self, key: ConfigKey, build: Callable[[], Learners]) -> Learners:
        """A private copy of the configuration's learners (built fresh the first time; built
        fresh and given the stored data when they come from the file)."""
        with self._lock:
            stored = self._learners.get(key)
            if stored is None:
                return build()
            self._learners.move_to_end(key)
            if isinstance(stored, StoredLearners):
                learners = build()
                load_state(list(learners), stored.data)
                return learners
            return copy.deepcopy(stored, {id(self._shared): self._shared})

    def commit(self, key: ConfigKey, learners: Learners, stats: RequestStats | None) -> None:
        """Store what a request learnt (its copy becomes the next request's prior)."""
        with self._lock:
            self._learners[key] = learners
            self._learners.move_to_end(key)
            while len(self._learners) > MAX_CONFIGS:
                self._learners.popitem(last=False)
            if stats is not None:
                self.totals.add(stats)
            self.since_save += 1

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {**self.totals.summary(), "configurations": len(self._learners)}

    # -- the file ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        with self._lock:
            learners = [{"key": [list(k[0]), *k[1:]],
                         "state": v.data if isinstance(v, StoredLearners) else state_of(list(v))}
                        for k, v in self._learners.items()]
            return {"version": STATE_VERSION, "fingerprint": self.fingerprint,
                    "totals": asdict(self.totals), "learners": learners}

    def save(self, path: str | Path) -> None:
        """Write atomically (temporary file + rename): a crash never leaves half a file."""
        path = Path(path)
        data = json.dumps(self.to_json())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, path)
        self.since_save = 0

    def load(self, path: str | Path) -> bool:
        """Restore from ``path``; on any problem warn, keep the fresh state, return False."""
        path = Path(path)
        if not path.is_file():
            log.warning("no state file at %s: starting with a fresh learnt state", path)
            return False
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") not in (STATE_VERSION, PICKLE_VERSION):
                raise ValueError(f"version {data.get('version')!r}, expected {STATE_VERSION}")
            if data.get("fingerprint") != self.fingerprint:
                raise ValueError("it was written for another model or drafter pool")
            totals = data["totals"]
            restored = Totals(totals["requests"], totals["tokens"],
                              {k: DrafterTotals(**v) for k, v in totals["drafters"].items()})
            if data["version"] == PICKLE_VERSION:
                learners = self._migrate(data["learners"])
            else:
                learners = OrderedDict(
                    ((tuple(e["key"][0]), str(e["key"][1]), str(e["key"][2]), int(e["key"][3])),
                     StoredLearners(list(e["state"]))) for e in data["learners"])
                if not all(len(v.data) == 2 and all(isinstance(x, dict) for x in v.data) for v in learners.values()):
                    raise ValueError("its learners are not a selector and a length policy each")
        except Exception as exc:  # noqa: BLE001 - any corruption means a fresh start, never a crash
            log.warning("ignoring the state file %s (%s): starting with a fresh learnt state", path, exc)
            return False
        with self._lock:
            self.totals, self._learners = restored, learners
        log.info("restored the learnt state from %s (%d requests)", path, restored.requests)
        return True

    def _migrate(self, pickled: str) -> OrderedDict[ConfigKey, StoredLearners]:
        """A version-2 file's pickled learners (restricted unpickling), as data."""
        items = _Unpickler(io.BytesIO(base64.b64decode(pickled)), self._shared).load()
        pairs = OrderedDict((tuple(k), (sel, length)) for k, (sel, length) in items)
        if not all(isinstance(s, DrafterPolicy) and isinstance(ln, LengthPolicy) for s, ln in pairs.values()):
            raise ValueError("it holds objects that are not policies")
        log.info("migrating the pickled learners of a version-%d state file to data", PICKLE_VERSION)
        return OrderedDict((k, StoredLearners(state_of(list(pair)))) for k, pair in pairs.items())
