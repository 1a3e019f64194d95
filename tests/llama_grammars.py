"""llama.cpp's own GBNF grammars (its ``grammars/`` folder), for the tests and benches that compare
lloyal's engines on them.

llama-cpp-sys-2 vendors llama.cpp without that folder, so the files come from the llama.cpp
inside llama-cpp-python's source distribution (the version ``make bench-peers-cpp`` builds,
downloaded with pip), kept in ``~/.cache/lloyal/llama-grammars/<version>/`` (override the folder
with ``LLOYAL_LLAMA_GRAMMARS``). Only the ``*.gbnf`` members are read from the archive.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
NAMES = ("arithmetic", "c", "chess", "english", "japanese", "json", "json_arr", "list")


def grammar_dir() -> Path:
    """The folder holding ``<name>.gbnf`` for each of :data:`NAMES` (downloaded on first use)."""
    explicit = os.environ.get("LLOYAL_LLAMA_GRAMMARS")
    if explicit:
        return Path(explicit)
    folder = Path.home() / ".cache" / "lloyal" / "llama-grammars" / VERSION
    if all((folder / f"{n}.gbnf").is_file() for n in NAMES):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(_download_sdist(Path(tmp)), mode="r:gz") as tar:
        for member in tar.getmembers():
            path = Path(member.name)
            if path.suffix == ".gbnf" and path.parent.name == "grammars" and path.stem in NAMES:
                f = tar.extractfile(member)
                if f is not None:
                    (folder / path.name).write_bytes(f.read())
    missing = [n for n in NAMES if not (folder / f"{n}.gbnf").is_file()]
    if missing:
        raise FileNotFoundError(f"llama-cpp-python {VERSION}'s sdist has no grammars/{missing}")
    return folder


def grammars() -> dict[str, str]:
    """Each of llama.cpp's grammars by name: its GBNF text."""
    folder = grammar_dir()
    return {n: (folder / f"{n}.gbnf").read_text(encoding="utf-8") for n in NAMES}


def _download_sdist(into: Path) -> Path:
    """llama-cpp-python's sdist, through pip (and so through whatever index pip is set to use)."""
    local = Path(__file__).resolve().parents[1] / "target" / "peers" / f"llama_cpp_python-{VERSION}.tar.gz"
    if local.is_file():  # `make bench-peers-cpp` downloaded it already
        return local
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python"]
    subprocess.run([*cmd, f"llama-cpp-python=={VERSION}", "-d", str(into)], check=True, timeout=600)
    return next(into.glob("llama_cpp_python-*.tar.gz"))
