"""What each child does to itself before it reads untrusted input: a seccomp deny-list, rlimits, cwd.

The seccomp filter goes through libseccomp by ctypes (when the library is present); the rlimits bound
CPU, address space, file size, open files, core dumps and processes. Standard library only.
"""

import os
import resource

# Syscalls that fail with EPERM under the filter (clone3 gets ENOSYS so libc falls back to clone, whose
# namespace flags are refused below).
DENY = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
        "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "kexec_load",
        "kexec_file_load", "reboot", "swapon", "swapoff", "init_module", "finit_module", "delete_module",
        "iopl", "ioperm", "userfaultfd", "open_by_handle_at", "name_to_handle_at", "mount_setattr",
        "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "acct", "settimeofday",
        "clock_settime", "adjtimex", "quotactl", "syslog", "vhangup", "io_uring_setup", "io_uring_enter",
        "io_uring_register", "lookup_dcookie")
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET
CLONE_NAMESPACE_FLAGS = (0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
AF_UNIX = 1
SCMP_ACT_ALLOW, SCMP_ACT_EPERM, SCMP_ACT_ENOSYS = 0x7fff0000, 0x00050000 | 1, 0x00050000 | 38
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7


def set_rlimits(cpu_s: int, mem_b: int, fsize_b: int) -> None:
    """CPU soft ``cpu_s`` (SIGXCPU) and hard ``cpu_s + 1`` (SIGKILL); AS, FSIZE, NOFILE 64, CORE 0, NPROC 16."""
    def lim(which, soft, hard=None):
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass
    lim(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)
    lim(resource.RLIMIT_AS, mem_b)
    lim(resource.RLIMIT_FSIZE, fsize_b)
    lim(resource.RLIMIT_CORE, 0)
    lim(resource.RLIMIT_NOFILE, 64)
    if hasattr(resource, "RLIMIT_NPROC"):
        lim(resource.RLIMIT_NPROC, 16)


def install_seccomp() -> str:
    """Install the deny-list filter; returns "on" or "unavailable: <why>"."""
    try:
        import ctypes
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return "unavailable: libseccomp.so.2 not found"

    class Cmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(Cmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return "unavailable: seccomp_init failed"

    def add(name, action, cmps=()):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return
        arr = (Cmp * max(1, len(cmps)))(*[Cmp(*c) for c in cmps])
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
        if rc != 0:
            raise OSError(-rc, "seccomp_rule_add " + name)
    try:
        for name in DENY:
            add(name, SCMP_ACT_EPERM)
        add("clone3", SCMP_ACT_ENOSYS)
        for flag in CLONE_NAMESPACE_FLAGS:
            add("clone", SCMP_ACT_EPERM, [(0, SCMP_CMP_MASKED_EQ, flag, flag)])
        add("socket", SCMP_ACT_EPERM, [(0, SCMP_CMP_NE, AF_UNIX, 0)])
        rc = lib.seccomp_load(ctx)
        if rc != 0:
            return f"unavailable: seccomp_load failed ({rc})"
    except OSError as e:
        return f"unavailable: {e}"
    finally:
        lib.seccomp_release(ctx)
    return "on"


def confine(cfg: dict) -> str:
    """seccomp (if asked), rlimits, cwd = $HOME; returns the seccomp state for the verdict."""
    sc = install_seccomp() if cfg["seccomp"] else "off"
    set_rlimits(cfg["cpu_s"], cfg["mem_b"], cfg["fsize_b"])
    try:
        os.chdir(os.environ.get("HOME", "/"))
    except OSError:
        pass
    return sc
