"""Tools for instructors and maintainers of the course, run from a checkout of it.

They are not part of ``course_lib``, the learner's runtime that Colab pip-installs: they need
the course folder (``solutions/``) and the dev extras (``nbformat``, ``nbclient``), and every
command takes the course folder explicitly.

=====================  =========================================================
``authoring``          maintainers: generate exercises/, refresh committed outputs
``grade``              instructors: grade a folder of submitted exercise notebooks
``sandbox``            the bubblewrap sandbox each submission runs in
``inside``             the grader's code that runs inside that sandbox
=====================  =========================================================
"""
