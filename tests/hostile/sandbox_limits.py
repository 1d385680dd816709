"""Not an attack: the sandbox as a learner's function sees it. It answers right only if every
limit holds where the checks run: no root, no network, no view of the course, a memory limit
(5 GiB cannot be had), a process limit, a file-size limit (Python ignores SIGXFSZ, so the write
fails), a small private /tmp, a CPU limit. A sandbox that lost a limit makes it fail."""

CODE = '''
import os
import resource
import socket

problems = []
if os.getuid() == 0 or os.geteuid() == 0:
    problems.append("root")
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2).close()
    problems.append("network")
except OSError:
    pass
if os.path.exists("@@COURSE@@") or os.path.exists("@@SUBMISSIONS@@"):
    problems.append("course or submissions in view")
try:
    block = bytearray(5 << 30)
    problems.append("memory")
    del block
except MemoryError:
    pass
for limit in ("RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_AS"):
    if resource.getrlimit(getattr(resource, limit))[0] == resource.RLIM_INFINITY:
        problems.append(limit)
try:
    with open("/tmp/big", "wb") as f:
        f.write(b"x" * (65 << 20))
    problems.append("file size")
except OSError:
    pass
finally:
    if os.path.exists("/tmp/big"):
        os.remove("/tmp/big")
stat = os.statvfs("/tmp")
if stat.f_blocks * stat.f_frsize > 600 << 20:
    problems.append("/tmp size")
if problems:
    return problems
n = 1
for s in shape:
    n *= s
return n * torch.empty((), dtype=dtype).element_size()
'''
CELLS = [("body:tensor_nbytes", CODE)]
SOLVE = ()
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "not done"}
