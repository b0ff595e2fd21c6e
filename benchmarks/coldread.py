"""A plain cold sequential read of files (the floor ANALYZE is compared with)."""
import os
import sys

CHUNK = 16 << 20
buf = bytearray(CHUNK)
total = 0
for root in sys.argv[1:]:
    paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in sorted(fs) if f.endswith(".safetensors")]
    for p in sorted(paths):
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := os.readv(fd, [buf]):
            total += n
        os.close(fd)
print(total)
