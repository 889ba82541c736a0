"""The code version that makes a run: the code's git tree, uncommitted changes, libraries.

`code_version()` is written into every sweep run's summary, so a sweep can tell a result of
today's code from one of older code (`gac_jax.lab.sweeps`). Only the files that decide
what a run computes count (`CODE_PATHS`): two runs are of the same code when those files
are the same (``tree``, a digest of their committed blobs, and ``diff``, one of their
uncommitted changes), whatever else the commits between them changed (notes, tests, the
experiment scripts: a script decides a run only through its config, which the summary's
config hash pins).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The package's checkout: the directory holding gac_jax/.
REPO_ROOT = Path(__file__).resolve().parents[2]
# The paths whose uncommitted changes make the code dirty (git pathspecs).
CODE_PATHS = ("gac_jax", "pyproject.toml")
GIT_TIMEOUT_SECONDS = 10.0
LIBRARIES = ("jax", "flax", "optax")


def _git(*args: str) -> bytes | None:
    """Stdout of ``git args`` run in `REPO_ROOT`, or None if git is absent, fails or hangs."""
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=GIT_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _is_checkout() -> bool:
    """Whether `REPO_ROOT` is itself the top of a git work tree (not a package installed
    somewhere inside another repository)."""
    top = _git("rev-parse", "--show-toplevel")
    return top is not None and Path(top.decode().strip()).resolve() == REPO_ROOT


def _uncommitted_digest() -> str | None:
    """A digest of the uncommitted changes under `CODE_PATHS` (the diff against HEAD, the
    untracked files' names and bytes); None if git fails."""
    diff = _git("diff", "HEAD", "--binary", "--no-ext-diff", "--", *CODE_PATHS)
    untracked = _git("ls-files", "--others", "--exclude-standard", "-z", "--", *CODE_PATHS)
    if diff is None or untracked is None:
        return None
    digest = hashlib.sha256(diff)
    for name in sorted(n for n in untracked.split(b"\0") if n):
        digest.update(b"\0" + name + b"\0")
        try:
            digest.update((REPO_ROOT / name.decode()).read_bytes())
        except OSError:
            pass  # Deleted between the listing and the read: its name still counts.
    return digest.hexdigest()[:16]


def _committed_tree() -> str | None:
    """A digest of HEAD's blobs under `CODE_PATHS`; None if git fails."""
    listing = _git("ls-tree", "-r", "--full-tree", "HEAD", "--", *CODE_PATHS)
    return None if listing is None else hashlib.sha256(listing).hexdigest()[:16]


def _library_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def code_version() -> dict[str, Any]:
    """The version of the code this process runs, once per process; never raises.

    ``{"commit", "tree", "dirty", "diff", "jax", "flax", "optax"}``: the HEAD commit (None
    outside a git checkout), `_committed_tree`, whether `CODE_PATHS` hold uncommitted
    changes (None without a commit), `_uncommitted_digest` (None when clean), and the
    installed library versions.
    """
    commit = tree = dirty = diff = None
    if _is_checkout():
        head = _git("rev-parse", "HEAD")
        commit = head.decode().strip() if head else None
    if commit is not None:
        tree = _committed_tree()
        status = _git("status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS)
        dirty = None if status is None else bool(status.strip())
        diff = _uncommitted_digest() if dirty else None
    libraries = {name: _library_version(name) for name in LIBRARIES}
    return {"commit": commit, "tree": tree, "dirty": dirty, "diff": diff, **libraries}


def same_code(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> bool:
    """Whether a run recorded as `recorded` was made by the code `current`: the same code
    files (by ``tree``, or by commit for a record without one), uncommitted changes and
    libraries. A record without a commit cannot be shown to be of this code, so it is not.
    """
    if not recorded or recorded.get("commit") is None:
        return False
    if recorded.get("dirty") and recorded.get("diff") is None:
        return False  # Dirty, but the changes could not be read.
    files = "tree" if recorded.get("tree") and current.get("tree") else "commit"
    keys = (files, "dirty", "diff", *LIBRARIES)
    return all(recorded.get(k) == current.get(k) for k in keys)


def describe(version: Mapping[str, Any] | None) -> str:
    """One line naming a `code_version()`, e.g. ``code 5d0c2f7e9a1b3c4d + uncommitted
    changes 3f2a9c0e1d2b4a5f, jax 0.10.2, flax 0.12.8, optax 0.2.8`` (``commit
    9723661c4a1b`` for a record without a tree; ``no recorded version`` for none)."""
    if not version:
        return "no recorded version"
    commit = version.get("commit")
    head = "no git commit" if commit is None else f"commit {commit[:12]}"
    if commit is not None and version.get("tree"):
        head = f"code {version['tree']}"  # Commits of the same code files read the same.
    if version.get("dirty"):
        head += f" + uncommitted changes {version.get('diff') or '(unreadable)'}"
    libraries = ", ".join(f"{name} {version.get(name)}" for name in LIBRARIES)
    return f"{head}, {libraries}"


#: What a sweep does with a finished run made by other code (`settle_stale`): refuse it,
#: retrain it from scratch (``--rerun-stale``), or reuse it (``--allow-stale``).
STALE_RUNS = ("refuse", "rerun", "reuse")


class StaleRunError(ValueError):
    """Finished runs have summaries written by another code version."""


def stale_summaries(paths: Sequence[os.PathLike]) -> list[dict[str, Any]]:
    """The summaries among the ``summary.json`` files `paths` (those that exist) whose
    ``code`` is not this process's code (`same_code`), each with its path as ``"path"``."""
    found = []
    for path in paths:
        if os.path.exists(path):
            summary = json.loads(Path(path).read_text())
            if not same_code(summary.get("code"), code_version()):
                found.append({**summary, "path": str(path)})
    return found


def settle_stale(paths: Sequence[os.PathLike], root: os.PathLike | str, *, stale: str) -> None:
    """Settles the stale runs of the summaries `paths` (`stale_summaries`) as `stale`
    says: "refuse" raises `StaleRunError` naming every one and the code versions, "rerun"
    deletes their run directories (to train them again), "reuse" does nothing."""
    if stale not in STALE_RUNS:
        raise ValueError(f"stale={stale!r} is unknown; expected one of {list(STALE_RUNS)}.")
    found = [] if stale == "reuse" else stale_summaries(paths)
    if found and stale == "refuse":
        made_by = " | ".join(f"{runs} [{v}]" for v, runs in runs_by_version(found).items())
        raise StaleRunError(
            f"{len(found)} finished run(s) under {root} were made by other code than this "
            f"[{describe(code_version())}]: {made_by}. Pass --rerun-stale (stale='rerun') "
            "to retrain them or --allow-stale (stale='reuse') to reuse them."
        )
    for summary in found:
        shutil.rmtree(Path(summary["path"]).parent)


def runs_by_version(summaries: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``{describe(code): "label seeds 0, 1; label seed 2"}``: the runs of sweep
    `summaries` by the code version that made them, in first-seen order."""
    seeds: dict[str, dict[str, list[str]]] = {}
    for s in summaries:
        by_label = seeds.setdefault(describe(s.get("code")), {})
        by_label.setdefault(s["label"], []).append(str(s.get("seed")))
    return {
        version: "; ".join(
            f"{label} seed{'s' if len(x) > 1 else ''} {', '.join(x)}" for label, x in labels.items()
        )
        for version, labels in seeds.items()
    }


def check_one_version(versions: Mapping[str, str], allow_mixed: bool) -> None:
    """Raises ValueError if `versions` (`runs_by_version`) holds two code versions or more,
    unless `allow_mixed`."""
    if len(versions) > 1 and not allow_mixed:
        raise ValueError(
            f"a table would mix runs of {len(versions)} code versions: "
            + " | ".join(f"[{v}]: {runs}" for v, runs in versions.items())
            + ". Retrain the stale runs (--rerun-stale) or pass allow_mixed=True "
            "(--allow-mixed)."
        )
