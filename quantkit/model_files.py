"""Files named from inside a model folder, resolved so that they never leave it.

A model folder is untrusted input: its index's `weight_map`, its config's `gguf_file` and its
symlinks are written by whoever made the repository. Every reader asks `model_file(folder, name)`
for the path of a file the folder names, and never joins such a name itself; it refuses, with
one line naming the entry and the fix:

- absolute names (`/etc/passwd`, `C:\\x`) and names with a `..` component, whatever they resolve to;
- names that resolve (symlinks followed) outside the folder's boundary.

The boundary is the folder itself, resolved; except in a Hugging Face cache snapshot
(`…/models--org--name/snapshots/<rev>/`), whose files are symlinks into `../../blobs/`: there
it is the repository's cache folder (`…/models--org--name`), so blobs of the same repository
are fine and anything outside it (another repository's blobs included) is refused.
"""
from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Optional

from quantkit.errors import QuantkitError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def boundary(folder: Path) -> Path:
    """The folder files named inside `folder` must resolve into (see the module docstring)."""
    real = Path(folder).resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")) \
            and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def model_file(folder: Path, name, what: str = "a file name") -> Path:
    """`folder / name`, after checking that `name` (read from inside `folder`: `what` says where,
    e.g. "model.safetensors.index.json's weight_map") stays inside the folder's boundary."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise QuantkitError(f"{folder}: {what} names {name!r}, which is not a file name; re-create the checkpoint")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or name.startswith(("/", "\\")):
        raise QuantkitError(f"{folder}: {what} names the absolute path {name!r}; quantkit reads only files inside "
                            "the model folder: put the file in the folder and name it relative to it")
    if ".." in posix.parts or ".." in windows.parts:
        raise QuantkitError(f"{folder}: {what} names {name!r}, which leaves the model folder; quantkit reads only "
                            "files inside it: put the file in the folder and name it relative to it")
    path = folder / name
    check_inside(folder, path, what)
    return path


def check_inside(folder: Path, path: Path, what: str = "a file") -> None:
    """Refuse `path` (in `folder`) when it resolves, symlinks followed, outside the folder's boundary."""
    root = boundary(folder)
    real = Path(path).resolve()
    if real != root and root not in real.parents:
        raise QuantkitError(f"{folder}: {what} {Path(path).name!r} resolves (through a symlink) to {real}, outside the "
                            "model folder; "
                            "quantkit reads only files inside it: copy the file into the folder instead of linking it")


def check_folder_links(folder: Path) -> None:
    """Every entry of `folder` (top level: what transformers and quantkit read, config and tokenizer
    files included) that is a symlink must resolve inside the folder's boundary."""
    folder = Path(folder)
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink():
            check_inside(folder, entry, "entry")


def safetensors_shards(folder: Path) -> Optional[dict[str, Path]]:
    """tensor name -> its shard file, from `model.safetensors.index.json` (None when the folder has no
    index), every shard name checked by `model_file`; a malformed index is refused."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if not index.is_file() and not index.is_symlink():
        return None
    check_inside(folder, index, "index")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise QuantkitError(f"{index} is not a valid safetensors index; re-create the checkpoint") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise QuantkitError(f"{index}: weight_map must map tensor names to shard file names")
    shards = {name: model_file(folder, name, f"{INDEX_FILE}'s weight_map") for name in sorted(set(weight_map.values()))}
    return {tensor: shards[name] for tensor, name in weight_map.items()}


def single_safetensors(folder: Path) -> Optional[Path]:
    """`folder/model.safetensors` (checked like any named file) when it exists, else None."""
    path = Path(folder) / SINGLE_FILE
    if not path.is_file() and not path.is_symlink():
        return None
    return model_file(folder, SINGLE_FILE, "weights file")


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards or the single file, every name checked to
    stay inside `folder` (never a glob, which would also pick up stray or planted files)."""
    shards = safetensors_shards(folder)
    if shards is not None:
        files = sorted(set(shards.values()))
        missing = [str(f.relative_to(folder)) for f in files if not f.is_file()]
        if missing:
            raise QuantkitError(f"{folder} is missing shard(s) {', '.join(missing)} listed in its index")
        return files
    single = single_safetensors(folder)
    if single is not None:
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise QuantkitError(f"{folder} holds only pickle weights (.bin/.pt); quantkit loads safetensors only — convert them first")
    raise QuantkitError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def check_remote_code(folder: Path, config: dict, trust_remote_code: bool, flag: Optional[str] = "--trust-remote-code") -> None:
    """Refuse a model that only the repository's own Python code can build (config.json's auto_map,
    a model_type transformers does not know) unless `trust_remote_code`: transformers would otherwise
    raise a message about its own argument, or prompt on a terminal. `flag` is the option that allows
    it in the calling command (None: the command never runs repository code)."""
    auto_map = config.get("auto_map")
    if trust_remote_code or not auto_map:
        return
    from transformers import CONFIG_MAPPING

    if config.get("model_type") in CONFIG_MAPPING:
        return  # transformers builds it with its own code; the repository's is not needed
    fix = (f"pass {flag} if you trust the code in {folder}" if flag else
           "this command never runs a repository's code; load it with quantkit.load(..., trust_remote_code=True)")
    raise QuantkitError(f"{folder} needs the Python code of its repository (config.json's auto_map, model_type "
                        f"{config.get('model_type')!r}), which quantkit does not run unasked: {fix}")
