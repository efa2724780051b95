"""Learnt state as plain JSON data: what ``state_dict`` / ``load_state_dict`` of the drafter and
length policies write and read (the server's state file, ``serve.state``).

A policy's state is its instance attributes, encoded as JSON values: numbers, strings, booleans
and None as they are, lists as lists, dicts with string keys as objects; tagged with ``"$"``:
tuples, dicts with other keys, sets, deques, numpy arrays, scalars and generators, floats JSON
cannot write (inf, nan), enums and objects of the registered state types (``state_type``: the
policies, and the helper classes that hold what they learn), each by its class name. An object
met twice is written once and then referenced (``{"$ref": n}``): the controller that ``auto``'s
selector and length policy share, the decay clock its counts share.

Loading puts the state into fresh objects built from the same spec (``load_state``): every
stored attribute takes the stored value, except that an object of a state type is loaded into
the fresh object's own one in place (so what the fresh object shares stays shared), and a
stored attribute that is now a method or property of the class (a state written by an earlier
version) is dropped. Only registered state types are ever constructed and no code runs: a
state file cannot execute anything, and it does not depend on module paths.

Not stored (``SKIPPED``): the cost model a policy prices rounds on (``costs``: the engine binds
its own) and its capability record (``caps``: from the spec), nor what a class lists in its
``state_skip`` (what its spec loads, e.g. a trained head); functions (per-round closures, rebuilt
by the policy at its next round) are stored as None.
"""

from __future__ import annotations

import enum
import functools
import math
import types
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ConfigError

#: attributes never stored, on any object
SKIPPED = frozenset({"costs", "caps"})

_TYPES: dict[str, type] = {}
_DROPPED: set[type] = set()
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def state_type(cls: type) -> type:
    """Register ``cls`` (by its class name) as a type whose objects may appear in a policy's
    state; returns it (a decorator)."""
    _TYPES[cls.__name__] = cls
    return cls


def dropped_type(cls: type) -> type:
    """Register ``cls`` as standing in for a function (stored as None, as functions are: e.g.
    what an earlier state file kept in a function's place); returns it (a decorator)."""
    _DROPPED.add(cls)
    return cls


def _attrs(obj: Any) -> dict[str, Any]:
    """An object's attributes: its ``__dict__`` and ``__slots__`` (over its classes)."""
    out = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for klass in type(obj).__mro__:
        for name in klass.__dict__.get("__slots__", ()):
            if hasattr(obj, name) and name not in out:
                out[name] = getattr(obj, name)
    return out


def _skipped(obj: Any) -> frozenset[str]:
    return SKIPPED | frozenset(getattr(type(obj), "state_skip", ()))


class _Encoder:
    def __init__(self) -> None:
        self.ids: dict[int, int] = {}
        self.keep: list[Any] = []  # the objects numbered, alive while encoding

    def object(self, obj: Any) -> dict[str, Any]:
        name = type(obj).__name__
        if _TYPES.get(name) is not type(obj):
            raise TypeError(f"cannot store a {type(obj).__module__}.{type(obj).__qualname__} in a learnt state: "
                            "register its class with adaspec.persist.state_type")
        n = self.ids[id(obj)] = len(self.ids)
        self.keep.append(obj)
        if isinstance(obj, tuple):  # a named tuple
            return {"$": "obj", "type": name, "id": n, "items": [self.value(v) for v in obj]}
        skip = _skipped(obj)
        return {"$": "obj", "type": name, "id": n,
                "attrs": {k: self.value(v) for k, v in _attrs(obj).items() if k not in skip}}

    def value(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, enum.Enum):
            return {"$": "enum", "type": type(v).__name__, "value": self.value(v.value)}
        if isinstance(v, int) and type(v) is int:
            return v
        if isinstance(v, float) and type(v) is float:
            return v if math.isfinite(v) else {"$": "float", "value": repr(v)}
        if isinstance(v, np.generic):
            return {"$": "scalar", "dtype": str(v.dtype), "value": self.value(v.item())}
        if isinstance(v, np.ndarray):
            return {"$": "ndarray", "dtype": str(v.dtype), "shape": list(v.shape),
                    "data": [self.value(x) for x in v.ravel().tolist()]}
        if isinstance(v, np.random.Generator):
            return {"$": "rng", "state": self.value(v.bit_generator.state)}
        if isinstance(v, _FUNCTIONS) or type(v) in _DROPPED:
            return None  # rebuilt by its policy (a per-round closure)
        if id(v) in self.ids:
            return {"$ref": self.ids[id(v)]}
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, deque):
            return {"$": "deque", "maxlen": v.maxlen, "items": [self.value(x) for x in v]}
        if isinstance(v, (set, frozenset)):
            return {"$": "set" if isinstance(v, set) else "frozenset", "items": [self.value(x) for x in v]}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"$": "tuple", "items": [self.value(x) for x in v]}
        if isinstance(v, dict):
            if type(v) is dict and all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: self.value(x) for k, x in v.items()}
            return {"$": "ordered" if isinstance(v, OrderedDict) else "dict",
                    "items": [[self.value(k), self.value(x)] for k, x in v.items()]}
        return self.object(v)


class _Decoder:
    def __init__(self) -> None:
        self.refs: dict[int, Any] = {}
        self.loaded: set[int] = set()  # objects loaded in place (``load``), by id

    def value(self, v: Any) -> Any:
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "$ref" in v:
            try:
                return self.refs[v["$ref"]]
            except KeyError:
                raise ConfigError(f"a learnt state refers to object {v['$ref']} before storing it") from None
        tag = v.get("$")
        if tag is None:
            return {k: self.value(x) for k, x in v.items()}
        if tag == "obj":
            return self.object(v)
        if tag == "enum":
            return _type(v["type"])(self.value(v["value"]))
        if tag == "float":
            return float(v["value"])
        if tag == "scalar":
            return np.dtype(v["dtype"]).type(self.value(v["value"]))
        if tag == "ndarray":
            return np.array(self.value(v["data"]), dtype=np.dtype(v["dtype"])).reshape(v["shape"])
        if tag == "rng":
            state = self.value(v["state"])
            gen = np.random.Generator(_bit_generator(state["bit_generator"]))
            gen.bit_generator.state = state
            return gen
        items = [self.value(x) for x in v.get("items", [])]
        if tag == "tuple":
            return tuple(items)
        if tag == "deque":
            return deque(items, maxlen=v.get("maxlen"))
        if tag in ("set", "frozenset"):
            return set(items) if tag == "set" else frozenset(items)
        if tag in ("dict", "ordered"):
            pairs = [(_hashable(k), x) for k, x in items]
            return OrderedDict(pairs) if tag == "ordered" else dict(pairs)
        raise ConfigError(f"a learnt state holds an unknown tag {tag!r}")

    def object(self, v: dict[str, Any]) -> Any:
        cls = _type(v["type"])
        if "items" in v:  # a named tuple
            obj = cls(*[self.value(x) for x in v["items"]])
            self.refs[v["id"]] = obj
            return obj
        obj = cls.__new__(cls)
        self.refs[v["id"]] = obj
        for k, x in v["attrs"].items():
            object.__setattr__(obj, k, self.value(x))
        return obj

    def load(self, obj: Any, v: dict[str, Any]) -> None:
        """Load an encoded object into ``obj`` in place (see the module docstring)."""
        if not isinstance(v, dict) or v.get("$") != "obj" or v.get("type") != type(obj).__name__:
            found = v.get("type") if isinstance(v, dict) else type(v).__name__
            raise ConfigError(f"a learnt state of a {found} cannot be loaded into a {type(obj).__name__}")
        self.refs[v["id"]] = obj
        self.loaded.add(id(obj))
        own = _attrs(obj)
        for k, x in v["attrs"].items():
            if k in _skipped(obj) or _is_method(type(obj), k):
                self.value(x)  # read (objects in it may be referred to later), then dropped
                continue
            current = own.get(k)
            if (isinstance(x, dict) and x.get("$") == "obj" and "attrs" in x and current is not None
                    and type(current).__name__ == x.get("type") and id(current) not in self.loaded
                    and not _is_value(current)):
                self.load(current, x)
            else:
                setattr(obj, k, self.value(x))


def _is_value(obj: Any) -> bool:
    """A frozen dataclass is a value: replaced when loaded, never changed in place (it may be
    shared, e.g. ``feedback.NO_CONTEXT``)."""
    params = getattr(type(obj), "__dataclass_params__", None)
    return params is not None and params.frozen


def _is_method(cls: type, name: str) -> bool:
    """Is ``name`` a method or property of ``cls`` (a stored attribute of that name, from an
    earlier version of the class, must not hide it)?"""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return isinstance(klass.__dict__[name], (property, functools.cached_property, types.FunctionType,
                                                     staticmethod, classmethod))
    return False


def _type(name: str) -> type:
    try:
        return _TYPES[name]
    except KeyError:
        raise ConfigError(f"a learnt state holds a {name}, which is not a registered state type") from None


def _bit_generator(name: str) -> Any:
    if name not in ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"):
        raise ConfigError(f"a learnt state holds an unknown random generator {name!r}")
    return getattr(np.random, name)()


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


class Stored:
    """A class whose objects keep what they learn as data: ``state_dict`` / ``load_state_dict``
    (the drafter and length policies' base classes); every subclass is a state type."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        state_type(cls)

    def state_dict(self) -> dict[str, Any]:
        """What the object has learnt, as plain JSON data (its attributes but ``SKIPPED`` and
        its class's ``state_skip``); ``load_state_dict`` puts it into an object built from the
        same spec."""
        return state_of([self])[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s data into this object (built from the same spec)."""
        load_state([self], [state])


def state_of(objs: Sequence[Any]) -> list[dict[str, Any]]:
    """The JSON-able state of ``objs`` (policies), encoded together: an object they share (a
    controller) is stored once and referenced."""
    enc = _Encoder()
    return [enc.object(o) for o in objs]


def load_state(objs: Sequence[Any], data: Sequence[dict[str, Any]]) -> None:
    """Put a stored state (``state_of``) into fresh ``objs`` built from the same specs."""
    if len(objs) != len(data):
        raise ConfigError(f"a learnt state of {len(data)} object(s) cannot be loaded into {len(objs)}")
    dec = _Decoder()
    for obj, v in zip(objs, data):
        dec.load(obj, v)


__all__ = ["SKIPPED", "Stored", "dropped_type", "load_state", "state_of", "state_type"]
