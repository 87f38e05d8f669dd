"""Opens what root could read past every file rule: disks, physical and kernel memory, the kernel
log, the kernel's keyrings, and lists /dev. Each step that works is reported with the marker
(the test fails on it). Expected: runtime_error, every step refused."""

import os

MARKER = "__MARKER__"

# EVOLVE-BLOCK-START
PATHS = ["/dev/sda", "/dev/vda", "/dev/nvme0n1", "/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg", "/proc/kcore",
         "/proc/kmsg", "/proc/keys", "/proc/kpageflags", "/dev/loop0", "/dev/zram0"]


def setup(ctx, shape):
    got, refused = [], []
    for path in PATHS:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            got.append(path)
            os.close(fd)
        except OSError as exc:
            refused.append(f"{path}: {exc.strerror}")
    try:
        got.append(f"/dev listing of {len(os.listdir('/dev'))} entries")
    except OSError as exc:
        refused.append(f"/dev listing: {exc.strerror}")
    raise RuntimeError(" ".join(f"{MARKER}-got {g}" for g in got) + f" refused: {refused}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
