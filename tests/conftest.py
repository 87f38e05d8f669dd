"""Test-session setup: the example plugin under tests/plugin_site is registered as an installed
package would be (its dist-info's `commweave.workloads` entry point on sys.path), so every test
that iterates the registry also runs a workload that lives outside commweave; child processes
(worker pools, the CLI) inherit it through PYTHONPATH."""

from __future__ import annotations

import os
import sys
from pathlib import Path

PLUGIN_SITE = str(Path(__file__).parent / "plugin_site")

if PLUGIN_SITE not in sys.path:
    sys.path.insert(0, PLUGIN_SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PLUGIN_SITE, os.environ.get("PYTHONPATH", "")) if p)
