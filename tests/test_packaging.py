"""pyproject.toml ships every package of the source tree, under the glmpost namespace (DESIGN.md §2)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_and_mapped():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    listed = set(setuptools["packages"])
    found = set()
    for top, directory in package_dir.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory)
            found.add(".".join([top, *relative.parts]) if relative.parts else top)
    assert found == listed, f"unlisted: {sorted(found - listed)}, missing: {sorted(listed - found)}"
    assert not (ROOT / "glmpost" / "formats").exists() and not (ROOT / "glmpost" / "npu").exists()


def test_torch_is_pinned_only_in_the_constraints_and_no_hardware_only_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dependencies = " ".join(project["dependencies"] + sum(project["optional-dependencies"].values(), []))
    assert "torch_npu" not in dependencies and "torch-npu" not in dependencies and "sglang" not in dependencies
    assert "torch==" not in dependencies
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()


def test_the_code_runs_on_the_oldest_python_pyproject_declares():
    # vermin reads every module's syntax, imports and standard-library names and reports the oldest
    # Python that has them all; tomllib (3.11+) is reached through glmpost.toml, which falls back to
    # tomli. ("long" is torch.long, which vermin mistakes for Python 2's builtin.)
    import re
    import subprocess
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest = re.fullmatch(r">=\s*(3\.\d+)", project["requires-python"]).group(1)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("vermin")), "--no-tips", "--violations", "--eval-annotations", "--exclude", "long",
         f"-t={oldest}-", "glmpost", "commands", "formats", "npu"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    if oldest < "3.11":
        assert any(d.replace(" ", "").startswith("tomli>=") and "python_version<'3.11'" in d.replace(" ", "")
                   for d in project["dependencies"]), "glmpost.toml needs tomli below Python 3.11"
