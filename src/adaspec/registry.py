"""One registry of the components adaspec is built from, and the one parser of their specs.

Drafters, selectors, length policies and target backends are each registered once
(``REGISTRY.register``) under the name their spec starts with, with a parameter dataclass
(a ``Params``) whose fields are what the spec may set. A spec ``NAME[:key=value,...]``
(``model:REF`` for a component whose spec text is one value: ``positional``) is parsed into
that dataclass by ``Registry.parse``: the name must be registered, every key a field, every
value of the field's type, and the dataclass's own ``check`` runs (a required value, files
that must exist). Parsing builds nothing, so a command validates its specs in milliseconds
before it loads a model; ``Registry.build`` then builds the component from a parsed spec and
what it needs at run time (the target, for drafters built from its weights or tokenizer).

A component class registered without a parameter dataclass gets one derived from its
``__init__`` signature (``params_of``: every parameter of a plain type, following ``**kwargs``
to the base classes), and is built with the parameters its spec sets. Lists that were kept by
hand are read from the entries instead: their capability records (``Entry.caps``, the class's
``caps``) and flags (``Entry.default``).

Errors name the spec, the parameter and the fix: an unknown name lists the registered ones, an
unknown key the allowed keys, a bad value the type it must have.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, UnknownNameError

#: the kinds of component, and how a message names each
KINDS = {"drafter": "drafter", "selector": "selector", "length": "length policy", "backend": "backend"}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Params:
    """Base of a component's parameter dataclass. ``check`` validates a parsed spec without
    building anything (raise ``ConfigError`` naming the parameter and the fix); ``needs_target``
    says whether building needs the loaded target (its weights or tokenizer): replay and the
    serving proposer build only components that do not."""

    def check(self) -> None:
        """Validate the values together (default: nothing)."""

    @property
    def needs_target(self) -> bool:
        return False


@dataclass(frozen=True)
class Entry:
    """One registered component. ``build(spec, **context)`` makes it from a parsed ``Spec``;
    ``params``: its ``Params`` dataclass; ``aliases``: other names of its spec; ``usage``: how
    its spec is written in lists (default the name); ``caps``: its class's declared capability
    record (``drafters.base.DrafterCaps``, ``selection.base.SelectorCaps``,
    ``length.base.LengthCaps``; None for backends); ``positional``: the field the text after
    ``NAME:`` fills as it is (``model:REF``); ``default``: a drafter the engine drafts with when
    none are given, on every backend (True) or on those named."""

    kind: str
    name: str
    build: Callable[..., Any]
    params: type
    aliases: tuple[str, ...] = ()
    usage: str = ""
    caps: Any = None
    positional: str | None = None
    default: bool | tuple[str, ...] = False

    @property
    def fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.params)]

    def is_default(self, backend: str) -> bool:
        return self.default is True or (isinstance(self.default, tuple) and backend in self.default)


@dataclass(frozen=True)
class Spec:
    """A parsed spec: its entry, its parameters and which of them the spec set (``given``)."""

    entry: Entry
    params: Any
    given: frozenset[str]
    text: str

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def needs_target(self) -> bool:
        return self.params.needs_target

    def with_values(self, **values: Any) -> Spec:
        """This spec with more parameters set (a caller's default, e.g. static's ``k``)."""
        return dataclasses.replace(self, params=dataclasses.replace(self.params, **values),
                                   given=self.given | frozenset(values))


class Registry:
    """Components by kind and name (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self._names: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
        #: text added to an unknown-name error of a kind (an example spec)
        self.hints: dict[str, str] = {}

    def register(self, kind: str, name: str, component: Callable[..., Any], *, params: type | None = None,
                 aliases: Sequence[str] = (), usage: str = "", caps: Any = None, positional: str | None = None,
                 default: bool | tuple[str, ...] = False, replace: bool = False) -> Entry:
        """Register ``component`` under ``name``: a class (built with the parameters its spec
        sets; ``params`` default: ``params_of(component)``; ``caps`` default: the class's), or a
        factory ``f(spec, **context)`` (then ``params`` is required). ``replace``: take the place
        of a component of that name (else a second registration is an error)."""
        if kind not in KINDS:
            raise ConfigError(f"unknown component kind {kind!r}: use one of {', '.join(KINDS)}")
        key = _key(name)
        if not key or ":" in key or "," in key:
            raise ConfigError(f"a {KINDS[kind]} name must be a non-empty word without ':' or ',', got {name!r}")
        if isinstance(component, type):
            cls = component
            params = params or params_of(cls)
            caps = caps if caps is not None else getattr(cls, "caps", None)  # the class's declared record

            def build(spec: Spec, **_: Any) -> Any:
                return cls(**{f: getattr(spec.params, f) for f in spec.given})
        else:
            if params is None:
                raise ConfigError(f"{KINDS[kind]} {name!r}: a factory needs its params dataclass (params=...)")
            build = component
        if not (dataclasses.is_dataclass(params) and issubclass(params, Params)):
            raise ConfigError(f"{KINDS[kind]} {name!r}: params must be a dataclass deriving from registry.Params")
        keys = [key, *(_key(a) for a in aliases)]
        taken = [k for k in keys if k in self._names[kind] and self._names[kind][k] != key]
        if taken or (key in self._entries[kind] and not replace):
            raise ConfigError(f"a {KINDS[kind]} named {(taken or [key])[0]!r} is registered already: pick another "
                              "name, or pass replace=True")
        entry = Entry(kind, key, build, params, tuple(_key(a) for a in aliases), usage or key, caps,
                      positional, default)
        self._entries[kind][key] = entry
        for k in keys:
            self._names[kind][k] = key
        return entry

    def unregister(self, kind: str, name: str) -> None:
        """Remove a component (a test's own, after the test)."""
        key = self._names[kind].pop(_key(name), None)
        entry = self._entries[kind].pop(key, None) if key is not None else None
        if entry is not None:
            for alias in entry.aliases:
                self._names[kind].pop(alias, None)

    def entries(self, kind: str) -> list[Entry]:
        """The components of a kind, in the order they were registered."""
        return list(self._entries[kind].values())

    def names(self, kind: str) -> list[str]:
        """Every name a spec of this kind may start with, aliases included, in registration order."""
        return list(self._names[kind])

    def find(self, kind: str, name: str) -> Entry | None:
        key = self._names[kind].get(_key(name))
        return None if key is None else self._entries[kind][key]

    def entry(self, kind: str, name: str, spec: str | None = None) -> Entry:
        """The component registered as ``name``; an unknown name lists the registered ones
        (``spec``: how the message quotes what was asked for, default ``repr(name)``)."""
        found = self.find(kind, name)
        if found is None:
            usages = ", ".join(e.usage for e in self.entries(kind))
            label = spec if spec is not None else repr(name)
            raise UnknownNameError(f"unknown {KINDS[kind]} {label}: use one of {usages}{self.hints.get(kind, '')}")
        return found

    def parse(self, kind: str, spec: str) -> Spec:
        """``spec`` parsed and checked against its component's parameters, nothing built."""
        what = KINDS[kind]
        if not isinstance(spec, str) or not spec.strip():
            usages = ", ".join(e.usage for e in self.entries(kind))
            raise UnknownNameError(f"empty {what} spec: use one of {usages}")
        name, _, rest = spec.strip().partition(":")
        entry = self.entry(kind, name.strip(), spec=repr(spec) if kind == "drafter" else repr(name.strip()))
        if entry.positional is not None:
            raw = {entry.positional: rest.strip()}
        else:
            raw = parse_params(rest, f"{what} {spec!r}")
        fields = {f.name: f for f in dataclasses.fields(entry.params)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            allowed = ", ".join(fields) or "(none)"
            raise ConfigError(f"unknown parameter(s) {unknown} for {what} {entry.name!r}: allowed: {allowed}")
        hints = typing.get_type_hints(entry.params)
        values = {k: v if k == entry.positional else convert(v, hints.get(k, Any), k) for k, v in raw.items()}
        missing = [f.name for f in fields.values() if f.name not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{what} {entry.name!r} needs {', '.join(f'{m}=...' for m in missing)}: write "
                              f"{entry.name}:{','.join(f'{m}=VALUE' for m in missing)}")
        params = entry.params(**values)
        params.check()
        return Spec(entry, params, frozenset(raw), spec)

    def build(self, kind: str, spec: str | Spec, **context: Any) -> Any:
        """The component a spec names, built with ``context`` (e.g. ``target=`` for drafters)."""
        parsed = spec if isinstance(spec, Spec) else self.parse(kind, spec)
        return parsed.entry.build(parsed, **context)


def read_flags(cls: type, flags: dict[str, str]) -> dict[str, Any]:
    """The capability-record fields a class sets as the boolean class attributes of earlier
    versions (``{attribute: field}``), read into its record when the class is created."""
    return {field: cls.__dict__[attr] for attr, field in flags.items()
            if attr in cls.__dict__ and isinstance(cls.__dict__[attr], bool)}


def _key(name: str) -> str:
    return str(name).strip().lower()


def parse_params(text: str, what: str) -> dict[str, str]:
    """Parse ``key=value,key=value`` (empty string -> {}); ``-`` in a key reads as ``_``."""
    params: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ConfigError(f"bad parameter {part!r} in {what}: write key=value")
        key, value = part.split("=", 1)
        params[key.strip().replace("-", "_")] = value.strip()
    return params


def parse_number(text: str) -> int | float | str:
    """'3' -> 3, '0.5' -> 0.5, anything else stays a string."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case); else ``ValueError``."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


def convert(text: str, hint: Any, key: str) -> Any:
    """A spec value as the type of its field: ``bool`` (1/true/yes/on, 0/false/no/off),
    ``int``, ``float`` (an integer stays an int), ``str`` / ``Path`` as written; a union tries
    a number first, then a boolean word, then the text where the union takes a string; an
    unannotated field takes a number or the text. A value of no allowed type is an error
    naming the parameter and the type."""
    members = _members(hint)
    if members is None:  # Any / unannotated
        return parse_number(text)
    if members == [bool]:
        try:
            return parse_bool(text)
        except ValueError:
            raise ConfigError(f"parameter {key}={text!r} is not a valid bool: write true or false") from None
    if members in ([str], [Path]):
        return text
    value = parse_number(text)
    if isinstance(value, str) and bool in members and text.strip().lower() in _TRUE + _FALSE:
        return parse_bool(text)
    if isinstance(value, int) and (int in members or float in members):
        return value
    if isinstance(value, float) and float in members:
        return value
    if str in members or Path in members:
        return text
    names = " or ".join(t.__name__ for t in members)
    raise ConfigError(f"parameter {key}={text!r} is not a valid {names}")


def _members(hint: Any) -> list[type] | None:
    """The plain types a field takes (None left out), or None for any value."""
    if hint is Any or hint is inspect.Parameter.empty:
        return None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        out = [t for t in typing.get_args(hint) if t is not type(None)]
        return out if all(t in _PLAIN for t in out) else None
    return [hint] if hint in _PLAIN else None


_PLAIN = (bool, int, float, str, Path)


def params_of(cls: type, skip: Sequence[str] = ("self",)) -> type:
    """A ``Params`` dataclass of the parameters of ``cls.__init__`` that a spec can set (those of
    plain types: numbers, booleans, strings, paths, unions of them, or unannotated), following
    ``**kwargs`` to the base classes' ``__init__`` (whose parameters without a default the
    class passes itself); defaults as in the signatures."""
    fields: list[tuple[str, Any, Any]] = []
    seen = set(skip)
    first = True
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: read as unannotated
            hints = {}
        more = False
        for p in inspect.signature(init).parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                more = True
                continue
            if p.kind is inspect.Parameter.VAR_POSITIONAL or p.name in seen:
                continue
            seen.add(p.name)
            if not first and p.default is inspect.Parameter.empty:
                continue  # a base's required parameter: the class passes it itself
            hint = hints.get(p.name, Any)
            if _members(hint) is None and hint is not Any and p.annotation is not inspect.Parameter.empty:
                continue  # an object (a controller, a model): not settable from a spec
            if p.default is inspect.Parameter.empty:
                spec_field = dataclasses.field()
            elif isinstance(p.default, (list, dict, set)):
                spec_field = dataclasses.field(default_factory=lambda d=p.default: type(d)(d))
            else:
                spec_field = dataclasses.field(default=p.default)
            fields.append((p.name, hint, spec_field))
        if not more:
            break
        first = False
    return dataclasses.make_dataclass(f"{cls.__name__}Params", fields, bases=(Params,), frozen=True, kw_only=True)


#: the registry every package registers its components in (drafters, selection, length, backends)
REGISTRY = Registry()

__all__ = ["Entry", "KINDS", "Params", "REGISTRY", "Registry", "Spec", "convert", "params_of", "parse_bool",
           "parse_number", "parse_params", "read_flags"]
