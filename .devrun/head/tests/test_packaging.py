"""The wheel a user installs: built from a copy of the sources with the project's own build
backend (setuptools, a dev dependency; offline: no build isolation, no index), it carries
the PEP 561 markers of both packages, the packaged data and LICENSE, and its METADATA the
license, classifiers and project URLs of pyproject.toml."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from email.message import Message
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("eplb", "moe")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    src.mkdir()
    # a copy, so the build's build/ and *.egg-info never land in the working tree
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--no-index", "--disable-pip-version-check", "-q", "-w", str(dist), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = dist.glob("eplb-*-py3-none-any.whl")
    with zipfile.ZipFile(path) as z:
        yield z


def metadata(wheel: zipfile.ZipFile) -> Message:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return Parser().parsestr(wheel.read(name).decode())


def test_both_packages_ship_py_typed(wheel):
    names = set(wheel.namelist())
    for package in PACKAGES:
        assert f"{package}/__init__.py" in names
        assert f"{package}/py.typed" in names, f"{package}/py.typed is not in the wheel"
        assert (ROOT / package / "py.typed").read_bytes() == b""  # a marker, empty


def test_wheel_ships_the_packaged_trace_and_license(wheel):
    names = set(wheel.namelist())
    for data in (ROOT / "eplb" / "data").glob("*.npz"):
        assert f"eplb/data/{data.name}" in names
    licenses = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert len(licenses) == 1, sorted(n for n in names if ".dist-info/" in n)
    assert wheel.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_metadata_license_classifiers_and_urls(wheel):
    m = metadata(wheel)
    assert m["Name"] == "eplb" and m["Summary"] and m["Requires-Python"] == ">=3.10"
    assert m.get("License-Expression", m["License"]) == "MIT"
    assert m["Author"] and "mixture-of-experts" in m["Keywords"].split(",")
    classifiers = set(m.get_all("Classifier"))
    for c in ("License :: OSI Approved :: MIT License",
              "Development Status :: 3 - Alpha",
              "Topic :: Scientific/Engineering :: Artificial Intelligence",
              "Environment :: GPU :: NVIDIA CUDA",
              "Operating System :: POSIX :: Linux",
              "Typing :: Typed",
              "Programming Language :: Python :: 3 :: Only"):
        assert c in classifiers, c
    # one classifier per supported minor version, from requires-python's floor up
    minors = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers
                    if c.startswith("Programming Language :: Python :: 3."))
    assert minors and minors[0] == 10 and minors == list(range(10, minors[-1] + 1))
    urls = dict(u.split(", ", 1) for u in m.get_all("Project-URL"))
    assert set(urls) == {"Homepage", "Documentation", "Issues", "Source"}, urls
    assert all(u.startswith("https://") for u in urls.values()), urls
    assert urls["Issues"] == urls["Source"] + "/issues"
