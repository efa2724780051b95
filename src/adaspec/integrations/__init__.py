"""Bridges to serving engines that run adaspec's drafter and length selection inside them.

``rows`` maps the rows of a serving engine's batch to requests across steps, ``batch`` is the
engine-independent proposer (drafters and policies per row), ``vllm`` the thin adapter that
vLLM loads as a ``custom_class`` speculative proposer. Nothing here imports vLLM at module
level, so the core is tested in any Python.
"""
