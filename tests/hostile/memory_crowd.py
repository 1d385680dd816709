"""Harming the neighbours and the grader: eight processes of 700 MiB each, every one under the
per-process limit, 5.5 GiB together (the old grader limited processes, not the sandbox, and the
OOM killer took other learners' kernels and the grader). The sandbox's cgroup holds all its
processes to --memory: the kernel kills one of them, inside; the checks run as usual."""

REQUIRES = "cgroup"
CODE = '''
import os
import time

children = 0
while children < 7 and os.fork() != 0:
    children += 1
block = bytearray(700 << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
time.sleep(30)
if children < 7:
    os._exit(0)
'''
CELLS = [("end", CODE)]
SOLVE = ("tensor_nbytes", "pick_training_dtype")
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "passed"}
NOTES = ("the sandbox ran out of memory",)
