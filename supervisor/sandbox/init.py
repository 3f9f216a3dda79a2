"""The sandbox's first process: namespaces, mounts, limits, then the code.

Run by path with the standard library only (``python -I -S init.py SPEC``),
never imported by the service for its side effects. SPEC is a JSON object
(see :func:`supervisor.sandbox.runner.init_spec`). The steps:

1. New mount, network and PID namespaces. A service running unprivileged
   also makes a user namespace, where it is root mapped to its own uid; a
   service running as root needs none, and drops to ``uid`` at the end.
2. A fork: the child is PID 1 of the new PID namespace, so when it ends the
   kernel ends every process the code started, and the code can address no
   process of the service (no ``kill`` of the parent by its pid).
3. In the child, the mounts (private to the namespace): every mount read
   only; fresh small tmpfs on /tmp, /var/tmp, /dev/shm and /run; the
   container's folder bound writable at ``/tmp/work``; an empty read-only
   tmpfs over each hidden path (the state dir, the models); a fresh /proc.
4. rlimits, no capabilities left (the bounding set dropped, no_new_privs),
   the parent-death signal, and ``exec`` of the Python that runs the code
   read from stdin, in ``/tmp/work`` with the given environment.

Exit status 125 with a ``sandbox:`` line on stderr means the setup failed;
the code never ran.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
from typing import Any

SETUP_FAILED = 125
# The sandbox's own wall clock runs this much past the parent's.
GRACE_S = 2.0
WORK = "/tmp/work"

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38

# statvfs flags a remount inside a user namespace must keep (the kernel
# refuses to clear a locked one).
_KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME),
)
# Mounts left as they are: /proc is replaced, /dev holds the devices the
# code needs writable (/dev/null); its /dev/shm gets a fresh tmpfs.
_LEFT_ALONE = ("/proc", "/dev")
_SCRATCH = ("/var/tmp", "/dev/shm", "/run")


class SetupError(Exception):
    pass


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _enc(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_enc(source), _enc(target), _enc(fstype), ctypes.c_ulong(flags), _enc(data)),
           f"mount {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _unshare(privileged: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if not privileged:
        flags |= CLONE_NEWUSER
    _check(_libc.unshare(flags), "unshare (namespaces)")
    if not privileged:
        uid, gid = os.geteuid(), os.getegid()
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # Field 5 is the mount point, with spaces and the like octal-escaped.
            raw = line.split()[4]
            points.append(raw.encode().decode("unicode_escape"))
    return points


def _left_alone(point: str) -> bool:
    return any(point == p or point.startswith(p + "/") for p in _LEFT_ALONE)


def _read_only_everywhere() -> None:
    for point in _mount_points():
        if _left_alone(point):
            continue
        try:
            kept = os.statvfs(point).f_flag
        except OSError:
            # Shadowed by a later mount on a parent path: not reachable, so
            # nothing to make read only.
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for st, ms in _KEPT_FLAGS:
            if kept & st:
                flags |= ms
        _mount(None, point, None, flags)


def _tmpfs(target: str, size_kib: int, mode: str, read_only: bool = False) -> None:
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    _mount("tmpfs", target, "tmpfs", flags, f"size={size_kib}k,mode={mode}")


def _hide(path: str) -> None:
    if os.path.isdir(path):
        _tmpfs(path, 4, "000", read_only=True)
    elif os.path.exists(path):
        _mount("/dev/null", path, None, MS_BIND)


def _mounts(spec: dict[str, Any], work_fd: int) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _read_only_everywhere()
    _tmpfs("/tmp", int(spec["tmp_kib"]), "1777")
    os.mkdir(WORK, 0o755)
    _mount(f"/proc/self/fd/{work_fd}", WORK, None, MS_BIND)
    # The bind took the read-only flag of the mount it came from.
    _mount(None, WORK, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    for path in _SCRATCH:
        if os.path.isdir(path) and not os.path.islink(path):
            _tmpfs(path, 1024, "1777")
    for path in spec["hide"]:
        _hide(path)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _limits(limits: dict[str, int]) -> None:
    for name, value in limits.items():
        which = getattr(resource, name)
        try:
            resource.setrlimit(which, (value, value))
        except ValueError as exc:
            # Over the hard limit the service itself runs under.
            raise SetupError(f"{name} {value}: {exc}") from exc


def _drop_privileges(spec: dict[str, Any], privileged: bool) -> None:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    if privileged:
        uid, gid = int(spec["uid"]), int(spec["gid"])
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        # The uid change made us not dumpable, which gives /proc/self to
        # root: we could not write our own maps.
        _prctl(PR_SET_DUMPABLE, 1)
        # A user namespace of its own, the uid mapped to itself: the kernel
        # counts RLIMIT_NPROC per user namespace, so sandboxes running as
        # the same uid at once do not share one process budget. Made before
        # the rlimits are set (its ceiling is the limit at creation).
        _check(_libc.unshare(CLONE_NEWUSER), "unshare (user namespace)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    # No capability left to regain by exec (the user namespace gave a full set).
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def _parent_alive(alive_fd: int) -> bool:
    """The parent holds the pipe's other end open until it exits."""
    os.set_blocking(alive_fd, False)
    try:
        return os.read(alive_fd, 1) != b""
    except BlockingIOError:
        return True


def _child(spec: dict[str, Any], privileged: bool, alive_fd: int) -> None:
    # Opened in the new mount namespace (a bind takes no mount of another)
    # and before the mounts hide the path it lives under.
    work_fd = os.open(spec["work"], os.O_PATH | os.O_DIRECTORY)
    _mounts(spec, work_fd)
    os.close(work_fd)
    _drop_privileges(spec, privileged)
    _limits(spec["rlimits"])
    os.chdir(WORK)
    # After the uid change, which clears it; then make sure the parent did
    # not end in between (the signal would never come).
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if not _parent_alive(alive_fd):
        raise SetupError("the sandbox's parent ended during setup")
    os.close(alive_fd)
    python = str(spec["python"])
    try:
        os.execve(python, [python, "-I", "-"], dict(spec["env"]))
    except OSError as exc:
        # /tmp is the sandbox's own and the hidden paths are empty there: a
        # Python under one of them, or one the sandbox's user may not
        # reach, is not found.
        raise SetupError(f"cannot run {python} in the sandbox: {exc.strerror}") from exc


def _status(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _in_initial_user_namespace() -> bool:
    with open("/proc/self/uid_map") as f:
        return f.read().split() == ["0", "0", "4294967295"]


def _end_namespace(proc_fd: int, pid: int) -> None:
    """SIGKILL every process of the sandbox's PID namespace, not only its
    PID 1: under a fork bomb PID 1 may sit in fork() a long while before the
    kernel gets to end the rest with it. ``proc_fd``: the service's /proc
    (ours shows the sandbox's own, once PID 1 mounted it), where the pids
    are those we can signal."""
    try:
        ns = os.readlink(f"{pid}/ns/pid", dir_fd=proc_fd)
    except OSError:
        return  # PID 1 is gone, and the namespace with it
    members = [pid]
    for name in os.listdir(proc_fd):
        if name.isdigit() and int(name) != os.getpid():
            try:
                if os.readlink(f"{name}/ns/pid", dir_fd=proc_fd) == ns:
                    members.append(int(name))
            except OSError:
                continue  # ended meanwhile, or not ours to look at
    for member in members:
        try:
            os.kill(member, signal.SIGKILL)
        except OSError:
            continue  # ended meanwhile


def _supervise(proc_fd: int, pid: int, wall_s: float) -> int:
    """Wait for PID 1; past the wall clock (the parent's own is the first,
    this one holds when the parent is stuck) or on SIGTERM from the parent,
    end the whole namespace."""
    def end(_signum: int, _frame: object) -> None:
        _end_namespace(proc_fd, pid)

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGALRM, end)
    signal.setitimer(signal.ITIMER_REAL, wall_s)
    # waitpid is retried after a handler ran (PEP 475).
    _, wait_status = os.waitpid(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    return _status(wait_status)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    try:
        # Ends with the service: then PID 1 ends with us (its own
        # parent-death signal), and the namespace with it.
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != int(spec["parent"]):
            raise SetupError("the service ended before the sandbox started")
        # Root of the machine: drops to the sandbox's uid. Root of a user
        # namespace (a container) cannot, having no other uid mapped: it
        # nests a user namespace like any unprivileged user.
        privileged = os.geteuid() == 0 and _in_initial_user_namespace()
        proc_fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
        _unshare(privileged)
    except (SetupError, OSError) as exc:
        print(f"sandbox: {exc}", file=sys.stderr, flush=True)
        return SETUP_FAILED
    alive_fd, held_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(held_fd)
        try:
            _child(spec, privileged, alive_fd)
        except (SetupError, OSError) as exc:
            print(f"sandbox: {exc}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    os.close(alive_fd)
    return _supervise(proc_fd, pid, float(spec["wall_s"]) + GRACE_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
