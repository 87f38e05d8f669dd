"""Workloads: plugins found through the `commweave.workloads` entry-point group.

Each entry point names a `Workload` subclass (`name = "module:Class"`); the built-in workloads
register through the same group in commweave's own pyproject.toml, so one in another installed
package is found the same way and nothing in commweave names it.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from commweave.contracts.workload import Workload

GROUP = "commweave.workloads"


def registry() -> dict[str, Workload]:
    """Every registered workload by its command-line name (the entry point's name)."""
    found: dict[str, Workload] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        if ep.name in found:
            continue  # the same distribution seen twice on sys.path (an editable install plus a copy)
        try:
            cls = ep.load()
        except Exception as exc:
            raise ImportError(f"workload plugin {ep.name!r} ({ep.value}) cannot be imported: {type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Workload)):
            raise TypeError(f"workload plugin {ep.name!r} ({ep.value}) is not a Workload subclass")
        workload = cls()
        if workload.name != ep.name:
            raise ValueError(f"workload plugin {ep.name!r} ({ep.value}) builds a workload named {workload.name!r}")
        found[ep.name] = workload
    return found


def get_workload(name: str) -> Workload:
    known = registry()
    if not known:
        raise KeyError(f"no workloads are registered, so {name!r} is unknown: workloads are found through the "
                       f"installed package's entry points ({GROUP}); install commweave (pip install -e .)")
    if name not in known:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


__all__ = ["GROUP", "get_workload", "registry"]
