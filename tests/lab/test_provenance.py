"""Code versions: what makes two runs the same code."""

import subprocess
from pathlib import Path

from gac_jax.lab import provenance
from gac_jax.lab.provenance import describe, same_code


def _commit(repo: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "add", "-A"], check=True, capture_output=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True, capture_output=True)


def test_the_code_tree_follows_the_code_files_not_the_commit(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.setattr(provenance, "REPO_ROOT", repo.resolve())

    def version():
        provenance.code_version.cache_clear()
        return provenance.code_version()

    _commit(repo, {"gac_jax/a.py": "x = 1\n", "pyproject.toml": "", "README.md": "one"})
    first = version()
    _commit(repo, {"README.md": "two", "tests/test_a.py": "", "experiments/lab.py": ""})
    notes = version()
    assert notes["commit"] != first["commit"] and notes["tree"] == first["tree"]
    assert same_code(first, notes) and not notes["dirty"]
    (repo / "gac_jax/a.py").write_text("x = 2\n")  # Uncommitted: dirty, with its digest.
    dirty = version()
    assert dirty["dirty"] and dirty["diff"] and not same_code(first, dirty)
    _commit(repo, {})
    changed = version()
    assert changed["tree"] != first["tree"] and not same_code(first, changed)
    _commit(repo, {"pyproject.toml": "[project]"})
    assert version()["tree"] != changed["tree"]
    provenance.code_version.cache_clear()


def test_code_versions_compare_by_code_files_changes_and_libraries():
    clean = {
        "commit": "a" * 40,
        "tree": "t1",
        "dirty": False,
        "diff": None,
        "jax": "1",
        "flax": "2",
        "optax": "3",
    }
    dirty = {**clean, "dirty": True, "diff": "d1"}
    assert same_code(clean, dict(clean))
    assert same_code(dirty, dict(dirty))  # The same uncommitted changes on the same commit.
    assert not same_code(dirty, {**dirty, "diff": "d2"})
    assert not same_code(clean, dirty) and not same_code(dirty, clean)
    # Another commit with the same code files (only tests or notes changed) is the same code.
    assert same_code(clean, {**clean, "commit": "b" * 40})
    assert describe(clean) == describe({**clean, "commit": "b" * 40})
    assert not same_code(clean, {**clean, "tree": "t2"})
    assert not same_code(clean, {**clean, "jax": "9"})
    older = {**clean, "tree": None}  # Recorded before trees: compared by commit.
    assert same_code(older, clean) and not same_code(older, {**clean, "commit": "b" * 40})
    assert not same_code({**dirty, "diff": None}, {**dirty, "diff": None})  # Unreadable.
    assert not same_code(None, clean)  # Written before versions were recorded.
    no_git = {**clean, "commit": None, "dirty": None}
    assert not same_code(no_git, no_git)  # Nothing shows that the code is the same.
