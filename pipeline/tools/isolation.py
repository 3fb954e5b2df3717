"""What a tool worker is shut into (``tools.isolation``): namespaces, a minimal root, no privileges.

Two levels, chosen by ``tools.isolation`` (``docs/tools.md`` has the table of what each one
isolates):

``namespaces`` (the default)
    The worker unshares a user, mount, pid, network and IPC namespace before it imports anything
    of the tools (:func:`enter_namespaces`; a user namespace can only be entered by a process with
    one thread), then forks: the child is process 1 of the new pid namespace and runs the calls;
    the parent (the *keeper*, outside the pid namespace) only waits for it and ends the way it
    ended (:func:`keep`). After the tools' imports the child builds a minimal root on a tmpfs and
    pivots into it (:func:`build_root`): the system directories (``/usr``, ``/bin``, ``/lib*``,
    ``/sbin``), the Python installation and the directories of the modules the worker imported,
    all read-only; a few files of ``/etc`` (the dynamic loader's, the time zone) and a ``passwd``
    naming the tool user; ``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``; a fresh
    ``/proc`` of the pid namespace where the kernel allows it; and ``/tmp``, a private tmpfs, the
    only writable directory (the working directory, ``HOME`` and ``TMPDIR``; a tool module that
    lives under the machine's ``/tmp`` is imported, but its files are not shown there). Nothing else of the
    machine exists there: not ``/etc/passwd``, not ``/home`` or ``/root``, not the run's directory,
    its checkpoints or the other processes' ``/proc``. The tool user is uid/gid
    :data:`TOOL_UID` inside (the run's user outside), then every capability is dropped and
    ``no_new_privs`` set (:func:`drop_privileges`): nothing it executes regains a privilege, and
    it cannot undo a mount. After every call process 1 kills every other process of its pid
    namespace (:func:`end_call_namespaces`: ``kill(-1, SIGKILL)`` from a pid namespace's init
    reaches exactly the namespace, also children started with ``setsid()``) and empties ``/tmp``.
    Killing the keeper (the timeout) or process 1 ends the whole namespace.

``process``
    No namespaces: for machines whose kernel refuses unprivileged user namespaces, chosen
    explicitly (the run never falls back to it by itself). The worker still gets an empty
    environment, a private working directory (``HOME``, ``TMPDIR``; emptied after every call), no
    capabilities and ``no_new_privs``, and after every call every process it started is killed,
    wherever it moved (:func:`end_call_process`: the worker is a child subreaper, so orphans of
    ``setsid()`` come back to it); the owner kills the same tree at a timeout
    (:func:`kill_tree`). The tool can still read and write what the run's user can, see the
    other processes and signal them.

Linux only; ``ctypes`` calls into the C library (Python 3.11 has no ``os.unshare``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re
import resource
import shutil
import signal
import sys
import time
from typing import NoReturn, Optional

LEVELS = ("namespaces", "process")
"""``tools.isolation``: the isolation levels, strongest first."""

TOOL_UID = 1000
"""The tools' user and group id inside the user namespace (the run's user outside)."""

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = (
    1024, 2048, 4096, 16384, 1 << 18, 1 << 21)
MNT_DETACH = 2
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
             "/etc/alternatives")
DEVICES = ("null", "zero", "full", "random", "urandom")
PRIVATE_DIR = "/tmp"
"""The tools' writable directory inside the ``namespaces`` root."""
CLEANUP_S = 2.0
"""How long the end of a call may wait for the processes it killed to be reaped."""

# statvfs flags -> the mount flags a read-only remount must keep (a user namespace may not clear
# the flags of a mount it inherited)
_KEEP_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
               (os.ST_RELATIME, MS_RELATIME))


class IsolationError(RuntimeError):
    """The requested isolation could not be set up on this machine (the message says which step
    failed and why)."""


def _libc() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise IsolationError(f"{what}: {os.strerror(err)} ({errno.errorcode.get(err, err)})")


def _mount(source: Optional[str], target: str, fstype: Optional[str], flags: int,
           data: Optional[str] = None) -> None:
    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    enc = (lambda s: None if s is None else os.fsencode(s))
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {source or ''} on {target}")


# ---------------------------------------------------------------- namespaces: before the imports
def enter_namespaces() -> None:
    """Unshare a user, mount, pid, network and IPC namespace and map this process's user and
    group to :data:`TOOL_UID` there. The caller must have one thread; its next child is process 1
    of the new pid namespace."""
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc().unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET
                           | CLONE_NEWIPC), "unshare(user, mount, pid, network, IPC namespaces)")
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{TOOL_UID} {uid} 1"),
                           ("gid_map", f"{TOOL_UID} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as err:
        raise IsolationError(f"mapping the tool user in its user namespace: {err}") from err


def keep(child: int, close_fds: tuple[int, ...]) -> NoReturn:
    """The keeper: wait for ``child`` (process 1 of the tools' pid namespace) and end as it
    ended (its exit status, or killed by its signal), so that the owner sees how the call ended."""
    for fd in close_fds:
        os.close(fd)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL, SIGSTOP: cannot be caught anyway
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


# ---------------------------------------------------------------- namespaces: the minimal root
def import_roots() -> list[str]:
    """The files the worker's Python needs after the pivot: its installation (prefixes) and the
    directory (or file) of every top-level module it imported."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for name, module in list(sys.modules.items()):
        if "." in name or module is None:
            continue
        found = list(getattr(module, "__path__", None) or [])
        if not found and getattr(module, "__file__", None):
            found = [module.__file__]
        for p in found:
            p = os.path.abspath(p)
            while p != "/" and not os.path.exists(p):  # a module in a zip archive: the archive
                p = os.path.dirname(p)
            if p != "/":
                paths.add(p)
    return sorted(paths | {os.path.realpath(p) for p in paths})


def _through_top_symlinks(path: str) -> str:
    """``path`` with a first component that is a symbolic link (``/lib`` -> ``usr/lib``) resolved."""
    parts = path.split("/", 2)
    top = "/" + parts[1]
    if os.path.islink(top):
        target = os.path.normpath(os.path.join("/", os.readlink(top)))
        return target + ("/" + parts[2] if len(parts) > 2 else "")
    return path


def plan_binds(paths: list[str]) -> list[str]:
    """The paths to bind-mount: each existing one, unless a bind of a directory above already
    shows it."""
    chosen: list[str] = []
    for p in sorted({_through_top_symlinks(os.path.normpath(p)) for p in paths if p},
                    key=lambda p: (p.count("/"), p)):
        if os.path.exists(p) and not any(p == c or p.startswith(c.rstrip("/") + "/")
                                          for c in chosen):
            chosen.append(p)
    return chosen


def _mount_points_under(path: str) -> list[str]:
    prefix = path.rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                           line.split()[4])  # "\040" is a space
            if point == path or point.startswith(prefix):
                found.append(point)
    return found


def _bind(source: str, target: str, *, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if not read_only:
        return
    for point in _mount_points_under(target):  # every mount under it read-only, not just the top
        kept = os.statvfs(point).f_flag
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        flags |= sum(ms for st, ms in _KEEP_FLAGS if kept & st)
        _mount(None, point, None, flags)


def build_root(root: str, *, binds: list[str], private_mb: int) -> dict:
    """Process 1 of the tools' namespaces: a tmpfs on ``root`` holding the minimal tree (the
    module docstring), then ``pivot_root`` into it (``chroot`` where the running root cannot be
    pivoted); the old root is detached. Returns what was set up (``proc``: whether ``/proc`` is
    there)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the machine
    _mount("tools-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
    for top in SYSTEM_DIRS:
        if os.path.islink(top):
            os.symlink(os.readlink(top), root + top)
    for path in plan_binds([*SYSTEM_DIRS, *binds]):
        if path != PRIVATE_DIR and not path.startswith(PRIVATE_DIR + "/"):  # /tmp is the tools'
            _bind(path, root + path, read_only=True)
    os.makedirs(root + "/etc", exist_ok=True)
    for path in ETC_FILES:
        if os.path.exists(path) and not os.path.exists(root + path):
            _bind(path, root + path, read_only=True)
    with open(root + "/etc/passwd", "w") as f:
        f.write(f"tool:x:{TOOL_UID}:{TOOL_UID}:tool:{PRIVATE_DIR}:/bin/sh\n")
    with open(root + "/etc/group", "w") as f:
        f.write(f"tool:x:{TOOL_UID}:\n")
    os.makedirs(root + "/dev", exist_ok=True)
    for name in DEVICES:  # device files: a read-only mount does not stop writes to them
        _bind("/dev/" + name, f"{root}/dev/{name}", read_only=False)
    os.makedirs(root + PRIVATE_DIR)
    _mount("tools-tmp", root + PRIVATE_DIR, "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0700,size={int(private_mb)}m")
    os.makedirs(root + "/proc")
    try:  # the pid namespace's own: only its processes; refused where the machine's is masked
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        proc = True
    except IsolationError:
        proc = False
    _enter_root(root)
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(PRIVATE_DIR)
    return {"proc": proc}


def _enter_root(root: str) -> None:
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    old = root + "/.old-root"
    os.mkdir(old)
    pivoted = number is not None and _libc().syscall(number, os.fsencode(root),
                                                     os.fsencode(old)) == 0
    if pivoted:
        os.chdir("/")
        _check(_libc().umount2(b"/.old-root", MNT_DETACH), "detach the old root")
        os.rmdir("/.old-root")
    else:  # the running root cannot be pivoted (an initramfs): chroot, without the capability
        os.rmdir(old)  # to leave it again (drop_privileges)
        os.chroot(root)
        os.chdir("/")


# ---------------------------------------------------------------- both levels
def drop_privileges() -> None:
    """No capability (effective, permitted, inheritable) and ``no_new_privs``: nothing this
    process executes gains a privilege (set-user-ID bits, file capabilities)."""
    libc = _libc()

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    _check(libc.capset(ctypes.byref(Header(_LINUX_CAPABILITY_VERSION_3, 0)),
                       (Data * 2)()), "drop the capabilities (capset)")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def clear_dir(path: str) -> bool:
    """Empty ``path`` (what a call left in its private directory); False if something stayed."""
    def retry(func, p, _exc) -> None:  # a directory the tool made unreadable
        os.chmod(os.path.dirname(p), 0o700)
        func(p)

    try:
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                shutil.rmtree(entry.path, onerror=retry)
            else:
                os.unlink(entry.path)
    except OSError:
        return False
    return not os.listdir(path)


def _reap_children(again) -> bool:
    """Reap this process's children until it has none (True), calling ``again()`` (kill once
    more) while some still run; False if some are left after :data:`CLEANUP_S`."""
    deadline = time.monotonic() + CLEANUP_S
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            if time.monotonic() > deadline:
                return False
            again()
            time.sleep(0.002)


def end_call_namespaces() -> bool:
    """Process 1 of the tools' pid namespace, after a call: SIGKILL to every other process of the
    namespace (``kill(-1)`` from a namespace's init reaches exactly its namespace, whatever
    session or group a process moved to), reaped (they are all its descendants: orphans come
    back to it). False if one is still there after :data:`CLEANUP_S`."""
    def kill_all() -> None:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kill_all()
    return _reap_children(kill_all)


# ---------------------------------------------------------------- process level
def become_subreaper() -> None:
    _check(_libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def _state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """The live (not zombie) processes below ``pid``, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(d))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL every process below ``pid`` (stopped first, so that none forks meanwhile), found
    again until none is left (at most :data:`CLEANUP_S`)."""
    deadline = time.monotonic() + CLEANUP_S
    while time.monotonic() < deadline:
        found = descendants(pid)
        if not found:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for child in found:
                try:
                    os.kill(child, sig)
                except OSError:
                    pass
        time.sleep(0.002)


def end_call_process() -> bool:
    """The ``process`` level's worker, after a call: every process it started killed and reaped
    (False if one is still there after :data:`CLEANUP_S`)."""
    me = os.getpid()
    kill_tree(me)
    return _reap_children(lambda: kill_tree(me))
