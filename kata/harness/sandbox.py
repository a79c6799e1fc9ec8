"""OS-level confinement for the processes that run a candidate's code: no network, writes only to
the directories the caller names, no signal to any process outside.

Inside, whatever the strategy: a new network namespace (the host's loopback is out of reach), a
new PID namespace (no other process can be signalled: not the judge, not the review); the
filesystem read-only but for the `writable` directories and a private /tmp, /dev/shm and /run
(tmpfs: torch.compile caches in /tmp; /run holds the host's service sockets); a /dev of the basic
and GPU nodes only (no disks); /proc's kernel settings read-only; no capabilities. The working
directory, the user id and the environment (plus CACHE_ENV) are kept; what Python reads under
/tmp (the interpreter, sys.path, this repository) is bound read-only into the private one.

detect() picks the first strategy that works here, by trying it:
1. bubblewrap, with a PID namespace too (the code cannot signal your processes). bwrap stays the
   child's parent and reports its signal N as exit code 128+N: returncode() maps it back.
2. user namespaces: this file as a launcher (`python -I -S kata/harness/sandbox.py --writable DIR --
   ARGV`) that unshares, with a PID namespace too: the launcher stays outside, waits and ends as
   ARGV ended (its exit code, or the same signal); inside, its child is the namespace's init,
   builds the view (a fresh /proc where the host allows one) and runs ARGV as pid 2. Killing
   the launcher's process group kills all three; when init ends, the kernel ends the rest.
3. none: the command runs as given, and the note says so.
Both confining strategies cap what the code may take (caps(), TMP_CAP): each process's memory,
the private tmpfs mounts' size, a file's size and the number of processes; the note names them.
KATA_SANDBOX=off forces none; =bwrap or =unshare tries that strategy only.
"""

from __future__ import annotations

import os
import sys

LAUNCHER = os.path.abspath(__file__)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_SECUREBITS, SECBIT_NOROOT_AND_LOCKED, PR_SET_NO_NEW_PRIVS = 1, 28, 0b11, 38
PR_CAPBSET_DROP, LINUX_CAPABILITY_VERSION_3 = 24, 0x20080522
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}  # the capset system call, which glibc does not wrap
BASIC_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = {"fd": "", "stdin": "/0", "stdout": "/1", "stderr": "/2"}  # to /proc/self/fd...
GPU_DEVICES = ("nvidia", "dri", "kfd")  # name prefixes: NVIDIA (nvidia-caps/ too), DRM, AMD ROCm
# Caches that default to the home directory, read-only inside: Triton's (torch.compile on a GPU)
# goes to the private /tmp, as torch.compile's own caches already do.
CACHE_ENV = {"TRITON_CACHE_DIR": "/tmp/.triton/cache"}
NO_SUID_DEV_EXEC = MS_NOSUID | MS_NODEV | MS_NOEXEC  # may be locked on; adding them is allowed
FAILED = 125  # the launcher's exit status when it could not build the sandbox
# Caps on what the code inside may take (see caps()): rlimits, inherited by all it starts, and
# the private tmpfs mounts' size. Generous for the probes; small enough to leave the host alive.
GiB = 2**30
MEMORY_CAP_FLOOR = 16 * GiB  # the shipped wrapper's int32-sizes call puts 8.6 GB on the host
TMP_CAP = 1 * GiB  # each private tmpfs (/tmp, /dev/shm, /run): torch.compile's caches take MBs
FILE_CAP = 2 * GiB  # the largest file a process may write (RLIMIT_FSIZE): SIGXFSZ past it
PROCESS_HEADROOM = 2048  # tasks over the user's own (threads count: torch starts one per core)


def proc_covers() -> list[str]:
    """What /proc holds besides processes: kernel settings (sys/), drivers' controls (driver/),
    bus/ and such, made read-only inside. Processes' own entries stay writable: CUDA fails to
    initialise with /proc read-only (error 304), and other processes' are out of reach."""
    return sorted(
        entry.path
        for entry in os.scandir("/proc")
        if not entry.name.isdigit()
        and not entry.is_symlink()  # self, thread-self, mounts, net
        and (entry.is_dir() or entry.stat().st_mode & 0o222)
    )


def gpu_devices() -> list[str]:
    return sorted(f"/dev/{name}" for name in os.listdir("/dev") if name.startswith(GPU_DEVICES))


def _launch(args: list[str]) -> None:
    """The launcher's main: never returns. -I -S keep whatever lies in the candidate's working
    directory or PYTHONPATH from being imported before the confinement exists (and start it in
    a few ms): only the standard library's os, sys and ctypes run here."""
    split = args.index("--")  # before it: --writable DIR or --readable DIR, repeated
    if args[1:split] == ["--caps"]:  # bubblewrap's: the rlimits alone, inherited through bwrap
        argv = args[split + 1 :]
        try:
            set_caps(caps())
            os.execvp(argv[0], argv)
        except OSError as error:
            os.write(2, f"kata sandbox: {error.filename or argv[0]}: {error.strerror}\n".encode())
            os._exit(FAILED)
    binds = sorted(zip(args[2:split:2], args[1:split:2], strict=True))  # parents first
    argv = args[split + 1 :]
    try:
        confine(binds)
        os.execvp(argv[0], argv)
    except OSError as error:
        what = error.filename or argv[0]  # None: the exec failed
        os.write(2, f"kata sandbox: {what}: {error.strerror}\n".encode())
        os._exit(FAILED)


def confine(binds: list[tuple[str, str]]) -> None:
    """Confine this process, as the module's docstring says: returns in the confined process
    (pid 2 of a new PID namespace), with `binds` ((path, "--writable" or "--readable"), parents
    first) mounted. The calling process itself stays outside, waits, and ends as the confined one
    ends; it never returns. A step that fails writes one "kata sandbox:" line to stderr and
    exits with FAILED. The caller must be single-threaded (unshare requires it): the launcher,
    or a child just forked from a zygote (zygote.py) that has closed its descriptors but 0-2."""
    import contextlib
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    string, ulong = ctypes.c_char_p, ctypes.c_ulong
    libc.mount.argtypes = [string, string, string, ulong, string]
    libc.prctl.argtypes = [ctypes.c_int, ulong, ulong, ulong, ulong]

    def check(result: int, what: str) -> None:
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error), what)

    def mount(source, target, fstype=None, flags=0, data=None) -> None:
        strings = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
        check(libc.mount(*strings[:3], flags, strings[3]), f"mount {os.fsdecode(target)}")

    try:
        cwd, uid, gid = os.getcwd(), os.getuid(), os.getgid()
        limits = caps()  # before unshare: the host's processes still in view
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
        maps = {"setgroups": "deny", "uid_map": f"{uid} {uid} 1", "gid_map": f"{gid} {gid} 1"}
        for name, text in maps.items():  # the same ids inside, mapped to ours
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
        # The PID namespace holds this process's children only: a signal sent from inside
        # reaches no process outside it (the judge, the review, the interviewer's shell).
        status_read, status_write = os.pipe()
        init = os.fork()
        if init:
            _end_as(init, status_read, status_write)
        os.close(status_read)
        # The launcher killed alone (its caller's time limit) takes init, hence everything inside.
        check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(pdeathsig)")  # SIGKILL
        mount(None, "/", flags=MS_REC | MS_PRIVATE)  # nothing done here reaches the host
        # Handles on what the tmpfs mounts below cover (the writable directories are usually
        # under /tmp), opened in this namespace so that they can be bound.
        devices = [f"/dev/{name}" for name in BASIC_DEVICES] + gpu_devices()
        handles = {path: os.open(path, os.O_PATH) for path in [*dict(binds), *devices]}
        _remount_all_read_only(mount)
        # This namespace's processes only; a host that masks parts of its /proc refuses a
        # fresh one, and the host's stays (its processes listed, still out of a signal's reach).
        with contextlib.suppress(OSError):
            mount("proc", "/proc", "proc", NO_SUID_DEV_EXEC)
        for path in proc_covers():
            mount(path, path, flags=MS_BIND | MS_REC)
            mount(None, path, flags=MS_REMOUNT | MS_BIND | MS_RDONLY | NO_SUID_DEV_EXEC)
        for path in ("/tmp", "/run", "/dev"):
            if os.path.isdir(path) and not os.path.islink(path):
                mode = "1777" if path == "/tmp" else "755"
                size = "" if path == "/dev" else f",size={TMP_CAP}"  # /dev: read-only below
                mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode}{size}")
        for path in devices:
            if os.path.isdir(f"/proc/self/fd/{handles[path]}"):
                os.mkdir(path)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY))
            # The source mount is read-only now: opening a device node to write is still
            # allowed (a read-only mount refuses writes to files, directories and links only).
            mount(f"/proc/self/fd/{handles[path]}", path, flags=MS_BIND | MS_REC)
        for name, target in DEV_LINKS.items():
            os.symlink(f"/proc/self/fd{target}", f"/dev/{name}")
        os.mkdir("/dev/shm")
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={TMP_CAP}")
        mount(None, "/dev", flags=MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        for path, option in binds:
            os.makedirs(path, exist_ok=True)  # in a fresh tmpfs when it was under one
            mount(f"/proc/self/fd/{handles[path]}", path, flags=MS_BIND | MS_REC)
            # The bind copied the read-only flag just set on its source: a writable one clears
            # it, keeping what the host locked (a truly read-only mount stays read-only).
            flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV
            flags |= os.statvfs(path).f_flag & MS_NOEXEC  # ST_NOEXEC has the same value
            mount(None, path, flags=flags | (0 if option == "--writable" else MS_RDONLY))
        for handle in handles.values():
            os.close(handle)
        # The bind mount now at that path, not the directory it covers; when nothing is there,
        # the old directory stays the working directory, read-only.
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        # No capability survives the exec, even as uid 0: the read-only mounts above cannot be
        # remounted, nor the tmpfs mounts unmounted to show what they cover.
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        check(libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT_AND_LOCKED, 0, 0, 0), "securebits")
        # Nor before one: a zygote's child runs the candidate's code without an exec, and the
        # capabilities the new user namespace gave it would let that code remount what is
        # read-only. Bounding set first (that needs CAP_SETPCAP), then every set.
        with open("/proc/sys/kernel/cap_last_cap") as file:
            for capability in range(int(file.read()) + 1):
                check(libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0), "prctl(capbset_drop)")
        header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
        no_capabilities = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2
        number = SYS_CAPSET.get(os.uname().machine, -1)  # -1: ENOSYS, the sandbox refused
        check(libc.syscall(number, header, no_capabilities), "capset")
        os.environ.update(CACHE_ENV)
        set_caps(limits)
        # The command runs as pid 2, not as init: signals it sends itself (abort, say) act as
        # usual.
        command = os.fork()
        if command == 0:
            os.close(status_write)
            return
        _reap_until(command, status_write)
    except OSError as error:
        os.write(2, f"kata sandbox: {error.filename or 'confine'}: {error.strerror}\n".encode())
        os._exit(FAILED)


def caps() -> dict[int, int]:
    """The rlimits the confined code runs under, by resource number. RLIMIT_AS is no use: CUDA
    reserves address ranges far larger than any host's memory. RLIMIT_DATA counts, since Linux
    4.7, only writable private mappings: the reserved ranges (PROT_NONE) and the driver's mapped
    device memory (shared) are not counted. Seen on an H100 (torch 2.11): CUDA initialises under
    it, fixed/ scores full marks, the shipped int32-sizes call runs, the cap bites. RLIMIT_NPROC
    counts every task of the real user on the machine (in its user namespace on Linux 5.14+), and
    never binds root."""
    import resource

    return {
        resource.RLIMIT_DATA: memory_cap(),
        resource.RLIMIT_FSIZE: FILE_CAP,
        resource.RLIMIT_NPROC: _tasks_of(os.getuid()) + PROCESS_HEADROOM,
    }


def memory_cap() -> int:
    """Half the host's memory, at least MEMORY_CAP_FLOOR."""
    with open("/proc/meminfo") as file:
        total = next(int(line.split()[1]) * 1024 for line in file if line.startswith("MemTotal:"))
    return max(MEMORY_CAP_FLOOR, total // 2)


def _tasks_of(uid: int) -> int:
    """How many tasks (threads included, as RLIMIT_NPROC counts them) `uid` runs now."""
    count = 0
    for entry in os.scandir("/proc"):
        try:
            with open(f"/proc/{entry.name}/status", "rb") as file:
                fields = dict(line.split(b":", 1) for line in file if b":" in line)
            count += int(fields[b"Threads"]) if int(fields[b"Uid"].split()[0]) == uid else 0
        except (OSError, KeyError, ValueError):
            continue  # not a process, or it ended
    return count


def set_caps(limits: dict[int, int]) -> None:
    """Lower each soft and hard limit to `limits` (never raise one already lower)."""
    import resource

    for number, value in limits.items():
        soft, hard = resource.getrlimit(number)
        value = min([value, *(v for v in (soft, hard) if v != resource.RLIM_INFINITY)])
        resource.setrlimit(number, (value, value))


def _reap_until(command: int, status_write: int) -> None:
    """The namespace's init: reaps every process left to it until `command` ends, hands the
    launcher its wait status, and exits, which ends whatever is left inside. Never returns."""
    os.close(0)  # the judge reads the command's stdout to its end: hold none of its pipes
    os.close(1)
    while True:
        pid, status = os.wait()
        if pid == command:
            os.write(status_write, status.to_bytes(4, "little"))
            os._exit(0)


def _end_as(init: int, status_read: int, status_write: int) -> None:
    """The launcher, outside: waits for the namespace's init, then ends as the command did
    (its exit code, or death by the same signal), so that the caller sees the command's end."""
    import signal

    os.close(status_write)
    os.close(0)
    os.close(1)
    reported = os.read(status_read, 4)
    _, status = os.waitpid(init, 0)
    if len(reported) == 4:  # else init ended first (it could not build the view): its status
        status = int.from_bytes(reported, "little")
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal this process cannot die of here
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else FAILED)


def _remount_all_read_only(mount) -> None:
    """Every mount of this namespace read-only, one by one (a remount is not recursive)."""
    import errno
    import re

    with open("/proc/self/mountinfo", "rb") as file:
        lines = file.read().splitlines()
    for line in lines:
        fields = line.split()
        point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
        options = fields[5].split(b",")
        fstype = fields[fields.index(b"-") + 1]
        if b"ro" in options or fstype == b"autofs":  # autofs: a lookup would trigger it
            continue
        if point == b"/proc" and fstype == b"proc":
            continue  # proc_covers() instead
        # The host may have locked nosuid, nodev, noexec: a remount must keep them.
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, flag in ((b"nosuid", MS_NOSUID), (b"nodev", MS_NODEV), (b"noexec", MS_NOEXEC)):
            flags |= flag if name in options else 0
        try:
            mount(None, point, flags=flags)
        except OSError as error:
            if error.errno not in (errno.ENOENT, errno.EACCES):  # out of reach for the code too
                raise


if __name__ == "__main__":
    _launch(sys.argv)

# Below: the parent's side. Imported after the launcher, which does not need them (half its
# start-up time would go to dataclasses and pathlib).
import functools  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

NOTE = (
    "no network; writes only to the judged directory and a private /tmp; no other process in "
    "reach; caps: {caps} ({how})"
)
RIGHTS = "the candidate's code ran with your rights"


@dataclass(frozen=True)
class Sandbox:
    name: str  # "bubblewrap", "user namespaces" or "none"
    why_none: str = ""  # for "none": the scorecard's line

    @property
    def note(self) -> str:
        """One line for the scorecard's "sandbox" row, naming the caps applied and those not."""
        if self.name == "none":
            return self.why_none
        said = [f"memory {memory_cap() / GiB:.0f} GiB a process"]
        if self.name == "bubblewrap" and not _bwrap_sizes():
            said.append("/tmp not capped (this bwrap has no --size)")
        else:
            said.append(f"/tmp and /dev/shm {TMP_CAP / GiB:.0f} GiB")
        said.append(f"files {FILE_CAP / GiB:.0f} GiB")
        if os.getuid() == 0:
            said.append("processes not capped (RLIMIT_NPROC never binds root)")
        else:
            said.append(f"{PROCESS_HEADROOM} more processes")
        return NOTE.format(caps=", ".join(said), how=self.name)

    def wrap(self, argv: list[str], *, writable: list[Path]) -> list[str]:
        """The command to run instead of `argv`: the same program, confined, with the existing
        directories `writable` writable. Give subprocess the cwd, env and start_new_session you
        would give it for `argv`."""
        options = [item for path, option in self.binds(writable) for item in (option, path)]
        if self.name == "bubblewrap":
            caps_first = [sys.executable, "-I", "-S", LAUNCHER, "--caps", "--"]
            return [*caps_first, *_bwrap_options(options), "--", *argv]
        if self.name == "user namespaces":
            return [sys.executable, "-I", "-S", LAUNCHER, *options, "--", *argv]
        return list(argv)

    def binds(self, writable: list[Path]) -> list[tuple[str, str]]:
        """(path, "--readable" or "--writable"), parents first: what the sandbox mounts over its
        read-only view (confine() takes them as they are)."""
        binds = {path: "--readable" for path in _python_paths()}
        binds |= {os.path.realpath(path): "--writable" for path in writable}
        return sorted(binds.items())

    def returncode(self, code: int) -> int:
        """The wrapped program's own returncode: negative for a signal death, as subprocess
        reports it unwrapped (bwrap reports the child's signal N as exit code 128+N)."""
        if self.name == "bubblewrap" and 128 < code < 128 + 65:
            return -(code - 128)
        return code


@functools.cache
def _python_paths() -> list[str]:
    """What Python (and the probes) read that lies where the sandbox puts a fresh tmpfs."""
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(sys.executable), *sys.path}
    paths.add(os.path.dirname(os.path.dirname(LAUNCHER)))  # this repository
    paths = {os.path.realpath(path) for path in paths if path and os.path.isdir(path)}
    hidden = [path for path in paths if path.startswith(("/tmp/", "/run/", "/dev/"))]
    return [path for path in hidden if not any(path.startswith(f"{p}/") for p in hidden)]


@functools.cache
def _bwrap_sizes() -> bool:
    """Whether this bwrap caps a tmpfs's size (--size: bubblewrap 0.5.0 and later)."""
    import subprocess

    try:
        said = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--size" in said.stdout + said.stderr


def _bwrap_options(binds: list[str]) -> list[str]:
    tmpfs = ["--size", str(TMP_CAP), "--tmpfs"] if _bwrap_sizes() else ["--tmpfs"]
    options = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", *tmpfs, "/dev/shm"]
    for path in gpu_devices():
        options += ["--dev-bind", path, path]
    options += ["--proc", "/proc"]
    for path in proc_covers():  # the host's: these hold no process's entries
        options += ["--ro-bind", path, path]
    options += [*tmpfs, "/tmp"]
    if os.path.isdir("/run") and not os.path.islink("/run"):
        options += [*tmpfs, "/run"]
    # After the tmpfs mounts: bwrap binds from the host's paths.
    for option, path in zip(binds[::2], binds[1::2], strict=True):
        options += ["--bind" if option == "--writable" else "--ro-bind", path, path]
    for name, value in CACHE_ENV.items():
        options += ["--setenv", name, value]
    return [*options, "--unshare-net", "--unshare-pid", "--die-with-parent", "--cap-drop", "ALL"]


BUBBLEWRAP = Sandbox("bubblewrap")
NAMESPACES = Sandbox("user namespaces")

# Run inside a trial sandbox: its working directory is writable, / is read-only, the network
# namespace is not ours, no capability is left.
_CHECK = """
import os, sys
open("written", "w").close()
assert os.statvfs("/").f_flag & os.ST_RDONLY, "/ is writable"
assert os.readlink("/proc/self/ns/net") != sys.argv[1], "the network is the host's"
assert "CapEff:\\t0000000000000000" in open("/proc/self/status").read(), "capabilities left"
"""


def trial(sandbox: Sandbox) -> str | None:
    """None when `sandbox` confines a process on this machine, or why it does not."""
    import re
    import shutil
    import subprocess
    import tempfile

    if sandbox.name == "bubblewrap" and not shutil.which("bwrap"):
        return "no bwrap"
    what = "bwrap failed" if sandbox.name == "bubblewrap" else "user namespaces refused"
    check = [sys.executable, "-I", "-S", "-c", _CHECK, os.readlink("/proc/self/ns/net")]
    with tempfile.TemporaryDirectory(prefix="kata-sandbox-") as directory:
        argv = sandbox.wrap(check, writable=[directory])
        try:
            done = subprocess.run(argv, cwd=directory, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"{what}: {error}"
        if done.returncode == 0 and os.path.exists(os.path.join(directory, "written")):
            return None
    said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    said = said[-1] if said else f"exit code {done.returncode}"
    # Its first clause, without the program's name: "bwrap: No permissions to ..., likely ..."
    return f"{what}: {re.split(r'[.,] ', re.sub(r'^(bwrap|kata sandbox): ', '', said))[0][:120]}"


@functools.cache
def detect() -> Sandbox:
    """The sandbox to run the candidate's code in on this machine (tried once per process)."""
    setting = os.environ.get("KATA_SANDBOX", "").strip().lower()
    if setting in ("off", "0", "no", "none", "false"):
        return Sandbox("none", f"none: turned off by KATA_SANDBOX={setting}: {RIGHTS}")
    choices = {"bwrap": [BUBBLEWRAP], "unshare": [NAMESPACES]}.get(setting)
    reasons = []
    for sandbox in choices or [BUBBLEWRAP, NAMESPACES]:
        reason = trial(sandbox)
        if reason is None:
            return sandbox
        reasons.append(reason)
    return Sandbox("none", f"none available on this machine ({'; '.join(reasons)}): {RIGHTS}")
