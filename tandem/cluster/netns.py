"""Run a command in a private network namespace that has only loopback: `python -m tandem.cluster.netns -- CMD`.

Ray advertises the machine's non-loopback address and probes 8.8.8.8 to learn it; local tests and
benchmarks must keep all of that traffic on this machine. `unshare --net` (as root; otherwise inside a user
namespace, `--user --map-root-user`, where the kernel allows unprivileged ones) gives the command a network stack of its own, `ip link set lo up` brings up its
loopback, and nothing else exists there: no route leaves the namespace. The command inherits the
environment (`--ray-local` adds RAY_AUTH_MODE=disabled, which a throwaway local cluster wants).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tandem.errors import TandemError

INNER = 'ip link set lo up && exec "$@"'


class NamespaceUnavailable(TandemError):
    """A private network namespace cannot be created here (no unshare/ip, or not permitted)."""


def netns_argv(command: list[str], user_namespace: bool | None = None) -> list[str]:
    """The argv that runs `command` inside a new network namespace with loopback up. Without root, a user
    namespace (`--map-root-user`) makes one where the kernel allows unprivileged user namespaces; None: that
    only when this process is not root."""
    if not command:
        raise TandemError("netns: no command given (usage: python -m tandem.cluster.netns [--ray-local] -- CMD ...)")
    unshare, ip = shutil.which("unshare"), shutil.which("ip") or ("/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else None)
    if unshare is None or ip is None:
        raise NamespaceUnavailable("netns needs `unshare` (util-linux) and `ip` (iproute2) on PATH")
    if user_namespace is None:
        user_namespace = os.geteuid() != 0
    flags = ["--user", "--map-root-user", "--net"] if user_namespace else ["--net"]
    return [unshare, *flags, "--", "sh", "-c", INNER.replace("ip ", ip + " ", 1), "sh", *command]


def in_private_netns() -> bool:
    """True when the only network interface is loopback (what netns_argv sets up)."""
    import socket

    try:  # ioctl/netlink in this process's namespace (/sys/class/net shows the mount's view, not the namespace's)
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def netns_available() -> str | None:
    """None when a private network namespace can be made here, else the reason it cannot."""
    try:
        argv = netns_argv(["true"])
    except NamespaceUnavailable as e:
        return str(e)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --net failed: {e}"
    if done.returncode != 0:
        how = "unshare --user --map-root-user --net" if os.geteuid() != 0 else "unshare --net"
        return f"{how} is not permitted here: {(done.stderr or done.stdout).strip()[:200]}"
    return None


def ray_local_env(env: dict | None = None) -> dict:
    """The environment of a throwaway local Ray cluster inside the namespace (no token auth, no usage stats)."""
    return dict(os.environ if env is None else env, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")


def run_in_netns(command: list[str], ray_local: bool = False, **kwargs) -> subprocess.CompletedProcess:
    env = ray_local_env(kwargs.pop("env", None)) if ray_local else kwargs.pop("env", None)
    return subprocess.run(netns_argv(command), env=env, **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    ray_local = "--ray-local" in args[: args.index("--")] if "--" in args else False
    command = args[args.index("--") + 1:] if "--" in args else [a for a in args if a != "--ray-local"]
    try:
        return run_in_netns(command, ray_local=ray_local).returncode
    except TandemError as e:
        print(f"tandem.cluster.netns: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
