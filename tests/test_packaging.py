"""The release workflow (.github/workflows/release.yml) and the packaging tools (SPEC §18).

GitHub Actions cannot run here, so the workflow is checked for what a release needs: it parses,
it builds manylinux wheels for x86_64 and aarch64, macOS wheels for x86_64 and arm64 and the
sdist with maturin's action, publishes only from a version tag by trusted publishing, and the
config its smoke step checks is one `gateway check` accepts. The builds themselves are `make
wheel`, `make wheel-aarch64`, `make sdist` and `make dist-check` (run by .ci/run, not here:
they take minutes).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
MATURIN_ACTION = "PyO3/maturin-action@v1"
#: SPEC §18: glibc 2.17 or 2.28 — what RHEL 8 (2.28) and Amazon Linux 2 (2.26) can install.
MANYLINUX = {"2014", "2_17", "2_28", "manylinux2014", "manylinux_2_28"}


@pytest.fixture(scope="module")
def workflow() -> dict[Any, Any]:
    data = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(data, dict)
    return data


def _steps(job: dict[str, Any], uses: str) -> list[dict[str, Any]]:
    return [s for s in job["steps"] if s.get("uses") == uses]


def _targets(job: dict[str, Any]) -> set[str]:
    matrix = job["strategy"]["matrix"]
    if "include" in matrix:
        return {entry["target"] for entry in matrix["include"]}
    return set(matrix["target"])


def test_triggers_are_a_version_tag_and_by_hand(workflow: dict[Any, Any]) -> None:
    # PyYAML reads the bare key `on` as the boolean true (YAML 1.1); GitHub reads it as "on".
    on = workflow.get("on", workflow.get(True))
    assert on["push"] == {"tags": ["v*"]}
    assert "workflow_dispatch" in on
    assert "pull_request" not in on


def test_linux_wheels_are_manylinux_for_x86_64_and_aarch64(workflow: dict[Any, Any]) -> None:
    job = workflow["jobs"]["linux"]
    assert _targets(job) == {"x86_64", "aarch64"}
    (build,) = _steps(job, MATURIN_ACTION)
    assert str(build["with"]["manylinux"]) in MANYLINUX
    assert build["with"]["target"] == "${{ matrix.target }}"
    assert "--release" in build["with"]["args"].split()


def test_macos_wheels_for_x86_64_and_arm64(workflow: dict[Any, Any]) -> None:
    job = workflow["jobs"]["macos"]
    assert _targets(job) == {"x86_64", "aarch64"}
    assert job["runs-on"] == "${{ matrix.runner }}"
    assert all(e["runner"].startswith("macos-") for e in job["strategy"]["matrix"]["include"])
    (build,) = _steps(job, MATURIN_ACTION)
    assert "--release" in build["with"]["args"].split()


def test_sdist_is_built_and_every_artifact_uploaded(workflow: dict[Any, Any]) -> None:
    jobs = workflow["jobs"]
    (build,) = _steps(jobs["sdist"], MATURIN_ACTION)
    assert build["with"]["command"] == "sdist"
    for name in ("linux", "macos", "sdist"):
        (upload,) = _steps(jobs[name], "actions/upload-artifact@v6")
        assert upload["with"]["path"] == "dist"
        assert upload["with"]["name"].startswith("wheels-")


def test_publishing_only_from_a_tag_with_trusted_publishing(workflow: dict[Any, Any]) -> None:
    assert workflow["permissions"] == {"contents": "read"}
    job = workflow["jobs"]["publish"]
    assert job["if"] == "startsWith(github.ref, 'refs/tags/v')"
    assert set(job["needs"]) == {"linux", "macos", "sdist"}
    # Trusted publishing: an OIDC token, never a stored PyPI token.
    assert job["permissions"] == {"id-token": "write"}
    assert "secrets." not in WORKFLOW.read_text()
    (download,) = _steps(job, "actions/download-artifact@v7")
    assert download["with"]["pattern"] == "wheels-*"
    assert [s["uses"] for s in job["steps"]][-1] == "pypa/gh-action-pypi-publish@release/v1"


def test_the_smoke_config_of_the_workflow_passes_gateway_check(
    workflow: dict[Any, Any], tmp_path: Path
) -> None:
    """Both wheel jobs run `gateway check` on a config they write: a schema change that
    rejects it would fail every release."""
    scripts = [
        s["run"]
        for name in ("linux", "macos")
        for s in workflow["jobs"][name]["steps"]
        if "gateway check" in s.get("run", "")
    ]
    assert len(scripts) == 2 and scripts[0] == scripts[1]
    printf = re.search(r"printf '%s\\n' (.*?) > /tmp/gateway\.yaml", scripts[0], re.S)
    assert printf is not None
    lines = shlex.split(printf.group(1).replace("\\\n", " "))
    config = tmp_path / "gateway.yaml"
    config.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"^\s*m\s+→ pool p\b", done.stdout, re.M), done.stdout


def test_the_wheel_tools_are_dev_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dev = " ".join(project["project"]["optional-dependencies"]["dev"])
    # `make wheel`: maturin --zig links against glibc 2.17 with PyPI's zig; auditwheel checks.
    for tool in ("maturin", "ziglang", "auditwheel"):
        assert re.search(rf"\b{tool}\b", dev), tool
    assert (ROOT / project["tool"]["maturin"]["manifest-path"]).is_file()
