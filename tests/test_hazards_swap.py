"""The package stage's swap of bundle/ (issue 28, item 9): the old and the new bundle trade
places in one atomic exchange; where there is none, a kill between the two renames leaves
the old bundle aside and the next run puts it back, never removes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from pipeline import artifacts


def _bundle(folder, text):
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_text(text)


def test_replacing_a_folder_is_one_exchange(tmp_path, monkeypatch):
    final = tmp_path / "bundle"
    _bundle(final, "old")
    renames = []
    real_rename = os.rename
    monkeypatch.setattr(artifacts.os, "rename", lambda a, b: (renames.append((a, b)), real_rename(a, b))[1])
    with artifacts.atomic_directory(final, replace=True) as staged:
        (staged / "model.onnx").write_text("new")
    assert (final / "model.onnx").read_text() == "new"
    assert renames == []  # no moment without a bundle/: renameat2 swapped them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
from pipeline import artifacts
final = Path(sys.argv[1])
artifacts.exchange = lambda first, second: False  # a file system without an atomic exchange
real_rename = os.rename
def rename(a, b):
    if Path(b) == final:  # the old bundle is aside, the new one not in yet: kill -9
        os.kill(os.getpid(), signal.SIGKILL)
    real_rename(a, b)
artifacts.os.rename = rename
with artifacts.atomic_directory(final, replace=True) as staged:
    (staged / "model.onnx").write_text("new")
"""


def test_a_kill_between_the_renames_leaves_the_old_bundle_to_be_put_back(tmp_path):
    """No exchange (another file system): the old bundle is renamed aside, and the process
    is killed (SIGKILL) before the new one is renamed in. The next run's cleanup puts the
    old one back."""
    final = tmp_path / "bundle"
    _bundle(final, "old")
    result = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(final)], capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not final.exists()
    asides = list(tmp_path.glob(".bundle.old.*"))
    assert len(asides) == 1 and (asides[0] / "model.onnx").read_text() == "old"
    artifacts.remove_stale_temps(final)
    assert (final / "model.onnx").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_an_interrupted_swap_puts_the_old_bundle_back_at_once(tmp_path, monkeypatch):
    final = tmp_path / "bundle"
    _bundle(final, "old")
    monkeypatch.setattr(artifacts, "exchange", lambda first, second: False)
    real_rename = os.rename

    def interrupted(a, b):
        if b == final and ".old." not in str(a):
            raise KeyboardInterrupt  # Ctrl-C between the two renames
        real_rename(a, b)

    monkeypatch.setattr(artifacts.os, "rename", interrupted)
    try:
        with artifacts.atomic_directory(final, replace=True) as staged:
            (staged / "model.onnx").write_text("new")
    except KeyboardInterrupt:
        pass
    assert (final / "model.onnx").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
