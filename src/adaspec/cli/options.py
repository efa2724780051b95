"""The command-line option checks (``adaspec.options``, where the tool packages read them too)."""

from ..options import (check_drafters, check_number, check_path, check_policies, check_sampling,  # noqa: F401
                       check_target, check_tree, fail)
