"""The tinyinfer course: lessons where students build each stage of inference and measure it.

Each lesson folder ``NN-topic/`` holds the lesson text (README.md), an exercise with typed
stubs, the teacher's solution, a checker and an experiment. ``lessons.course`` runs them;
``tinyinfer lesson --help`` (or ``python -m lessons --help``) says how.
"""
