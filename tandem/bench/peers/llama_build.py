"""llama.cpp's own C++ tools, built for this CPU: `tandem peers setup llama-cpp`.

The sources are the llama.cpp that llama-cpp-python's sdist on PyPI vendors (`vendor/llama.cpp`), so the tools come from
a package registry like everything else here; cmake and a C++ compiler must be on the PATH. The build is native
(`-DGGML_NATIVE=ON`: this CPU's ISA, as a user building llama.cpp gets), without libcurl or OpenSSL (nothing downloads
at run time), static libraries. It lives under `$TANDEM_HOME/peers/llama.cpp-VERSION/` (never in the repository):

    dl/        the sdist, as pip downloaded it
    src/       the unpacked sdist
    build/     cmake's build tree; the tools are in build/bin/
    tools.json written last: version, commit, compiler, cmake flags, targets (what `--peers llama` records)

Each step skips when its output is there, so re-running is cheap; `--force` rebuilds.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from tandem.errors import InvalidParameterError

VERSION = "0.3.36"  # llama-cpp-python's sdist (the same release ../shared/peers/setup_env.sh builds the binding from)
SETUP = "tandem peers setup llama-cpp"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF")
NEEDED = ("llama-completion", "llama-speculative-simple", "llama-lookup", "llama-tokenize", "llama-quantize")  # --peers llama
EXTRA = ("llama-speculative", "llama-server", "llama-cli", "llama-bench")  # what users run beside them (--all)
MARKER = "tools.json"


def root(version: str = VERSION) -> Path:
    from tandem.models.zoo import tandem_home

    return tandem_home() / "peers" / f"llama.cpp-{version}"


def bin_dir(version: str = VERSION) -> Path:
    return root(version) / "build" / "bin"


def tool(name: str, version: str = VERSION) -> Path:
    """The path of a built tool; a clear error naming the set-up command when it is not built."""
    path = bin_dir(version) / name
    if not path.is_file():
        raise InvalidParameterError(f"--peers llama: no {name} at {path}; build llama.cpp's tools with `{SETUP}` "
                                    "(cmake and a C++ compiler needed, ~20-40 min on 2 cores)")
    return path


def built_info(version: str = VERSION) -> dict | None:
    """tools.json of a finished build, or None."""
    try:
        return json.loads((root(version) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def setup(version: str = VERSION, jobs: int = 2, targets: tuple[str, ...] = NEEDED, force: bool = False) -> dict:
    """Download, configure and build `targets`; returns (and writes) tools.json."""
    for program in ("cmake", "c++"):
        if shutil.which(program) is None:
            raise InvalidParameterError(f"{SETUP}: no `{program}` on the PATH (pip install cmake; a C++ compiler from the OS packages)")
    base = root(version)
    info = built_info(version)
    if info and not force and set(targets) <= set(info["targets"]):
        return info
    source = _unpacked(_sdist(base / "dl", version), base / "src")
    build = base / "build"
    if force or not (build / "CMakeCache.txt").is_file():
        _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], "configure")
    _run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *targets], "build")
    info = {"llama_cpp_python": version, "version": tool_version(bin_dir(version) / targets[0]),
            "cmake_flags": list(CMAKE_FLAGS), "targets": sorted(set(targets) | set((info or {}).get("targets", [])))}
    (base / MARKER).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return info


def tool_version(path: Path) -> str:
    """`TOOL --version`: llama.cpp's build number, commit and compiler (it prints them on stderr)."""
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True)
    return " | ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip())


def _sdist(dl: Path, version: str) -> Path:
    path = dl / f"llama_cpp_python-{version}.tar.gz"
    if not path.is_file():
        dl.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(dl),
              f"llama-cpp-python=={version}"], "download")
        if not path.is_file():
            raise InvalidParameterError(f"{SETUP}: pip download gave no {path.name} in {dl}")
    return path


def _unpacked(sdist: Path, src: Path) -> Path:
    """vendor/llama.cpp of the unpacked sdist (unpacked once; a member outside the folder is refused)."""
    top = src / sdist.name.removesuffix(".tar.gz")
    source = top / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as archive:
            archive.extractall(src, filter="data")
        if not (source / "CMakeLists.txt").is_file():
            raise InvalidParameterError(f"{SETUP}: {sdist.name} has no vendor/llama.cpp/CMakeLists.txt")
    return source


def _run(cmd: list[str], step: str) -> None:
    print(f"[llama.cpp {step}] $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise InvalidParameterError(f"{SETUP}: the {step} step failed: {' '.join(cmd)}")


def add_peers_command(sub) -> None:
    """`tandem peers setup llama-cpp [--jobs N] [--all] [--force]`."""
    peers = sub.add_parser("peers", help="set up peer engines for `tandem bench decode --peers`").add_subparsers()
    p = peers.add_parser("setup", help="build a peer engine under $TANDEM_HOME/peers")
    p.add_argument("engine", choices=("llama-cpp",))
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    p.add_argument("--all", action="store_true", help=f"also build {', '.join(EXTRA)}")
    p.add_argument("--force", action="store_true", help="configure and build again")
    p.set_defaults(func=_setup_command)


def _setup_command(args) -> int:
    info = setup(jobs=args.jobs, targets=NEEDED + (EXTRA if args.all else ()), force=args.force)
    print(json.dumps({"root": str(root()), **info}, indent=1))
    return 0
