"""requirements.txt and environment.yml must list the same packages with the same lower bounds."""
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PIP = {"pytorch": "torch"}  # conda-forge names that differ from PyPI's
SPEC = re.compile(r"^([A-Za-z0-9_.\-]+)\s*(.*)$")


def parse(lines):
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-e"):
            out["<this project>"] = ""
            continue
        name, spec = SPEC.match(line).groups()
        out[CONDA_TO_PIP.get(name.lower(), name.lower())] = spec.replace(" ", "")
    return out


def test_requirements_and_environment_agree():
    reqs = parse((ROOT / "requirements.txt").read_text().splitlines())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda, pip = [], []
    for dep in env["dependencies"]:
        (pip.extend(dep["pip"]) if isinstance(dep, dict) else conda.append(dep))
    listed = parse(conda + pip)
    listed.pop("python"), listed.pop("pip")
    assert listed == reqs


def test_the_installed_packages_satisfy_the_requirements():
    """What is installed here (what CI installs from requirements.txt) meets every lower bound the file states."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    reqs = parse((ROOT / "requirements.txt").read_text().splitlines())
    reqs.pop("<this project>", None)
    for name, spec in reqs.items():
        name = name.split("[", 1)[0]
        try:
            installed = version(name)
        except PackageNotFoundError:
            raise AssertionError(f"{name} is required but not installed") from None
        assert SpecifierSet(spec).contains(installed, prereleases=True), (name, spec, installed)


def test_the_maintained_nvml_binding_and_no_upper_pins():
    reqs = parse((ROOT / "requirements.txt").read_text().splitlines())
    assert "nvidia-ml-py" in reqs and "pynvml" not in reqs  # pynvml is the deprecated wrapper of the same library
    assert not any("<" in spec for spec in reqs.values()), "no upper pins unless something is broken"
