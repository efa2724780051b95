"""Measuring: everything that tells how fast and how exact a configuration is.

``runner`` (``adaspec bench``: AR, configurations and peers side by side in one process),
``workloads`` (built-in prompt suites and user prompt files), ``peers`` (Hugging Face assisted
generation), ``report`` (report.md, plots), ``trace`` and ``replay`` (record a run once, replay
any policy on it offline), ``simulation`` (synthetic environments for policy tests). The runtime
never imports this package.
"""
