"""Package discovery (the metadata is in pyproject.toml).

Every package under quantkit/ is found by walking it, so a new subpackage cannot be left out of the
wheel. Three top-level folders of the repository are installed inside quantkit. kernels/ has no
``__init__.py`` (a namespace portion), so ``import kernels`` from the repository root still finds the
installed regular package of that name (Hugging Face's); ``quantkit/kernels`` is a symlink to it for
source and editable runs (kernels/README.md). configs/ and calibration_data/ hold data only.
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
