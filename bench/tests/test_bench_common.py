"""bench.common's commit(): the header every benchmark log starts with names the code it ran."""

import subprocess

from bench.common import commit


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_a_changed_tree_is_named_by_the_commit_it_would_be(tmp_path, monkeypatch):
    """A device's copy of the tree may carry an older commit's git metadata; the id of the tree as it is names the
    commit that holds it, and git's own index is left as it was."""
    monkeypatch.delenv("FXQUANT_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    git("init", "-q", cwd=tmp_path)
    for key, value in (("user.email", "bench@fxquant"), ("user.name", "bench")):
        git("config", key, value, cwd=tmp_path)
    (tmp_path / ".gitignore").write_text("ignored.txt\n")
    (tmp_path / "kernel.py").write_text("old\n")
    git("add", "--all", cwd=tmp_path)
    git("commit", "-q", "-m", "old", cwd=tmp_path)
    old = git("rev-parse", "--short", "HEAD", cwd=tmp_path)
    assert commit() == old
    (tmp_path / "kernel.py").write_text("new\n")
    (tmp_path / "added.py").write_text("untracked, not ignored\n")
    (tmp_path / "ignored.txt").write_text("not part of the code\n")
    named = commit()
    assert git("diff", "--cached", "--name-only", cwd=tmp_path) == ""  # nothing staged in git's own index
    git("add", "--all", cwd=tmp_path)
    git("commit", "-q", "-m", "new", cwd=tmp_path)
    assert named == f"{old}-dirty (tree {git('rev-parse', 'HEAD^{tree}', cwd=tmp_path)})"
    monkeypatch.setenv("FXQUANT_COMMIT", "abc1234")
    assert commit() == "abc1234"
