"""Workloads: plugins found through the `commweave.workloads` entry-point group.

Each entry point names a `Workload` subclass (`name = "module:Class"`); the built-in workloads
register through the same group in commweave's own pyproject.toml, so one in another installed
package is found the same way and nothing in commweave names it.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from commweave.contracts.workload import Workload

GROUP = "commweave.workloads"


def _entry_points() -> dict[str, EntryPoint]:
    """The group's entry points by name (the first of a distribution seen twice on sys.path)."""
    found: dict[str, EntryPoint] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        found.setdefault(ep.name, ep)
    return found


def _load(ep: EntryPoint) -> Workload:
    try:
        cls = ep.load()
    except Exception as exc:
        raise ImportError(f"workload plugin {ep.name!r} ({ep.value}) cannot be imported: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Workload)):
        raise TypeError(f"workload plugin {ep.name!r} ({ep.value}) is not a Workload subclass")
    workload = cls()
    if workload.name != ep.name:
        raise ValueError(f"workload plugin {ep.name!r} ({ep.value}) builds a workload named {workload.name!r}")
    return workload


def registry() -> dict[str, Workload]:
    """Every registered workload by its command-line name (the entry point's name)."""
    return {name: _load(ep) for name, ep in _entry_points().items()}


def get_workload(name: str) -> Workload:
    """One registered workload (only its plugin is imported)."""
    known = _entry_points()
    if not known:
        raise KeyError(f"no workloads are registered, so {name!r} is unknown: workloads are found through the "
                       f"installed package's entry points ({GROUP}); install commweave (pip install -e .)")
    if name not in known:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(known))}")
    return _load(known[name])


__all__ = ["GROUP", "get_workload", "registry"]
