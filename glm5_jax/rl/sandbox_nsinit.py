"""pid 1 of a sandbox child's namespaces on the util-linux backend (glm5_jax.rl.sandbox_isolation).

``unshare --mount --pid ... -- python -I -S -B sandbox_nsinit.py '<json config>' <child argv...>``, run as
root inside the new namespaces, before any untrusted code: mounts a tmpfs at ``root``, builds the mount
plan there (read-only, nosuid, nodev binds; device nodes; the scratch tmpfs owned by the child's uid;
symlinks), remounts the root read-only, then runs the child as ``chroot root setpriv ... -- argv``,
waits for it and exits with its status (128 + n when signal n killed it). The parent kills this process
at the end of the run, and with it, the kernel kills everything else in the pid namespace.

Standard library only (it runs in an isolated interpreter); a failed mount raises and exits non-zero.
"""

import json
import os
import subprocess
import sys


def mount(cfg, *args):
    subprocess.run([cfg["mount"], *args], check=True, close_fds=True)


def build_root(cfg):
    root, uid = cfg["root"], cfg["uid"]
    mount(cfg, "-t", "tmpfs", "-o", "size=1m,mode=755,nosuid,nodev", "tmpfs", root)
    for kind, src, dest, size_mb in cfg["plan"]:
        path = root + dest
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if kind == "symlink":
            os.symlink(src, path)
        elif kind == "tmpfs":
            os.makedirs(path)
            mount(cfg, "-t", "tmpfs", "-o", f"size={size_mb}m,mode=700,uid={uid},gid={uid},nosuid,nodev",
                  "tmpfs", path)
        elif kind in ("ro", "dev"):
            if os.path.isdir(src):
                os.makedirs(path, exist_ok=True)
            else:
                open(path, "a").close()
            mount(cfg, "--bind", *(["-o", "ro,nosuid,nodev"] if kind == "ro" else []), src, path)
        else:
            raise ValueError(f"unknown mount kind {kind!r}")
    mount(cfg, "-o", "remount,ro,bind", root)


def main():
    cfg = json.loads(sys.argv[1])
    build_root(cfg)
    # close_fds=False: the child's pipe ends (inherited from the parent) must reach it
    rc = subprocess.call([cfg["chroot"], cfg["root"], *cfg["drop"], *sys.argv[2:]], close_fds=False)
    sys.exit(128 - rc if rc < 0 else rc)    # 128 + n, as bwrap does: sandbox_isolation.SIGNAL_STATUS_BASE


if __name__ == "__main__":
    main()
