"""Package discovery (the metadata is in pyproject.toml).

Every package under quantkit/ is found by walking it, so a new subpackage cannot be left out of the
wheel. Three top-level folders of the repository are installed inside quantkit; they have no
``__init__.py`` (namespace portions), so ``import kernels`` from the repository root still finds an
installed regular package of that name (Hugging Face's) instead of this folder.
"""
from setuptools import find_namespace_packages, setup

MAPPED_FOLDERS = {
    "quantkit.kernels": "kernels",  # the Triton and C kernels, with their C sources
    "quantkit.recipes": "configs",  # the bundled recipes (YAML)
    "quantkit.calibration_data": "calibration_data",  # the calibration corpora's manifest (YAML)
}

setup(
    packages=find_namespace_packages(include=["quantkit", "quantkit.*"], exclude=["*.__pycache__"]) + list(MAPPED_FOLDERS),
    package_dir={"quantkit": "quantkit", **MAPPED_FOLDERS},
)
