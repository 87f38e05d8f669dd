"""Test-session setup: the example plugin under tests/plugin_site is registered as an installed
package would be (its dist-info's `commweave.workloads` entry point on sys.path), so every test
that iterates the registry also runs a workload that lives outside commweave; child processes
(worker pools, the CLI) inherit it through PYTHONPATH. The session also runs in a temp folder of
its own and fails when a test leaves commweave's temporary folders behind (then removes it)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

PLUGIN_SITE = str(Path(__file__).parent / "plugin_site")
_SESSION_TMP = pytest.StashKey[Path]()

if PLUGIN_SITE not in sys.path:
    sys.path.insert(0, PLUGIN_SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PLUGIN_SITE, os.environ.get("PYTHONPATH", "")) if p)


# -- no test leaves temporary folders behind -----------------------------------------------------
#: what commweave's pools, judges and program processes make in the temp folder
LEFTOVERS = ("cw_pool_*", "cw_judge_*", "cw_candidates_*/cand_*", "cw_candidates_*/rdzv_*")


def pytest_configure(config) -> None:
    """The session gets a temp folder of its own (TMPDIR, inherited by every worker, judge and CLI
    process a test starts), so what is left in it at the end is this session's doing alone."""
    folder = tempfile.mkdtemp(prefix="cw_tests_")
    config.stash[_SESSION_TMP] = Path(folder)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # re-read TMPDIR


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the run when a test left commweave's temporary folders behind (the folders named)."""
    folder = session.config.stash.get(_SESSION_TMP, None)
    if folder is None:
        return
    left = sorted(str(p.relative_to(folder)) for pattern in LEFTOVERS for p in folder.glob(pattern))
    if left:
        session.config.get_terminal_writer().line(
            f"error: tests left {len(left)} temporary folder(s) behind in {folder}: {', '.join(left[:10])}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config) -> None:
    """Remove the session's temp folder (pytest's tmp_path folders were made inside it too), also
    when commweave cannot be imported (a run before `pip install -e .` made the folder too)."""
    folder = config.stash.get(_SESSION_TMP, None)
    if folder is None or not folder.exists():
        return
    try:
        from commweave.runtime.confine import remove_tree
    except ImportError:
        shutil.rmtree(folder, ignore_errors=True)
        return
    remove_tree(folder)
