"""The environment the tests run in (what launch/setup.sh installs in CI) lies within pyproject.toml's bounds: the
dependencies and every extra's requirements that are installed satisfy them (the core dependencies must be)."""
import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
EXTRAS = [(extra, r) for extra, reqs in PROJECT["optional-dependencies"].items() for r in reqs
          if not r.startswith(PROJECT["name"])]


def installed_version(requirement: Requirement):
    try:
        return importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.parametrize("requirement", PROJECT["dependencies"])
def test_installed_dependency_is_within_bounds(requirement):
    req = Requirement(requirement)
    version = installed_version(req)
    assert version is not None, f"{req.name} is not installed"
    assert req.specifier.contains(version, prereleases=True), f"{req.name} {version} is outside {req.specifier}"


@pytest.mark.parametrize("extra,requirement", EXTRAS)
def test_installed_extra_requirement_is_within_bounds(extra, requirement):
    req = Requirement(requirement)
    version = installed_version(req)
    if version is None:
        pytest.skip(f"{req.name} (extra [{extra}]) is not installed here")
    assert req.specifier.contains(version, prereleases=True), f"{req.name} {version} is outside {req.specifier}"

