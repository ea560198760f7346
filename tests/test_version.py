"""The package version is written once (``moeyard.__version__``): pyproject.toml reads it from there, and
CHANGELOG.md's newest entry is that version."""

import re
from pathlib import Path

import pytest
from packaging.version import Version

import moeyard

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_pep440_and_the_changelogs_newest():
    assert str(Version(moeyard.__version__)) == moeyard.__version__
    entries = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert entries and entries[0] == moeyard.__version__, entries[:3]
    assert "__version__" in moeyard.__all__


def test_pyproject_reads_the_version_from_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "moeyard.__version__"}
