"""The commands' progress display (``adaspec.progress``, where the tool packages read it too)."""

from ..progress import StageProgress  # noqa: F401
