"""The wheel carries every module and data file, and the repository's kernels/ folder shadows nothing.

The wheel is built from a copy of the files setup.py reads (so the source tree gets no build/ or
egg-info), with the venv's setuptools (no build isolation: no network). The expected contents come
from walking the source folders, not from the packaging configuration under test.
"""
import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_SUFFIXES = {".py", ".yaml", ".c"}  # modules, recipes and the calibration manifest, C sources


def mapped_folders() -> dict:
    """setup.py's MAPPED_FOLDERS ({package: top-level folder}), read without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MAPPED_FOLDERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no MAPPED_FOLDERS")


def expected_wheel_files() -> set:
    """Every file under quantkit/ and the mapped folders that the installed package needs, as wheel paths."""
    roots = {"quantkit": ROOT / "quantkit"}
    roots.update({pkg.replace(".", "/"): ROOT / folder for pkg, folder in mapped_folders().items()})
    expected = set()
    for dest, src in roots.items():
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not (Path(dirpath) / d).is_symlink()]
            for name in filenames:
                path = Path(dirpath) / name
                if path.suffix in DATA_SUFFIXES:
                    expected.add(f"{dest}/{path.relative_to(src).as_posix()}")
    return expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ["quantkit", *mapped_folders().values()]:
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=ignore)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (whl,) = out.glob("quantkit-*.whl")
    return whl


def test_wheel_carries_every_module_recipe_manifest_and_c_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = expected_wheel_files()
    # the folders the issue named, so an empty walk cannot pass
    for must in ("quantkit/pipeline/driver.py", "quantkit/kernels/cpu_gemv.c", "quantkit/kernels/cpu_decoder.c",
                 "quantkit/recipes/rtn-w4.yaml", "quantkit/calibration_data/registry.yaml"):
        assert must in expected, must
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"
    # nothing at the top level but quantkit itself: no kernels/, configs/ or tests/ beside it
    tops = {n.split("/")[0] for n in names}
    assert tops == {"quantkit", next(t for t in tops if t.endswith(".dist-info"))}, tops
    # every quantkit subpackage of the source tree is in the wheel
    packages = {str(Path(n).parent) for n in expected if n.endswith(".py")}
    assert packages <= {str(Path(n).parent) for n in names}
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "quantkit = quantkit.cli:main" in entry_points


def test_top_level_kernels_folder_does_not_shadow_hugging_faces_kernels():
    """kernels/ has no __init__.py: from the repository root (first on sys.path) `import kernels` still gives
    the installed regular package (Hugging Face's, which transformers requires), while quantkit.kernels
    gives this folder's modules."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin, "Hugging Face's kernels package is not installed"
    probe = ("import kernels, quantkit.kernels.cpu_gemv as g; "
             "print(kernels.__file__); print(g.SOURCE.resolve())")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr
    hf_file, c_source = done.stdout.split("\n")[:2]
    assert Path(hf_file).resolve() == Path(spec.origin).resolve()
    assert Path(hf_file).name == "__init__.py" and not Path(hf_file).resolve().is_relative_to(ROOT / "kernels")
    assert Path(c_source) == (ROOT / "kernels" / "cpu_gemv.c").resolve()
