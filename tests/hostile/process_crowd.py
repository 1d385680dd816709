"""Harming the neighbours: 200 busy processes for the whole notebook run (the old grader gave
every process its own CPU weight, so an honest neighbour's checks ran out of time). Each
sandbox now has one equal CPU weight in a cgroup of its own, and time limits count its CPU
seconds: the victims keep their scores; this notebook's own run ends at its time limit."""

REQUIRES = "cgroup"
CODE = '''
import os
import time

for _ in range(200):
    if os.fork() == 0:
        while True:
            pass
time.sleep(600)
'''
CELLS = [("end", CODE)]
SOLVE = ("tensor_nbytes",)
EXPECTED = {"tensor_nbytes": "passed", "pick_training_dtype": "not done"}
