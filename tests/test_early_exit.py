"""The early-exit drafter: the target's first layers, sharing its weights."""

import pytest
import torch

from adaspec import AdaspecError, SpeculativeEngine
from adaspec.exactness import greedy_reference

from conftest import make_tiny_model


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return make_tiny_model(seed=3, layers=3)


@pytest.mark.parametrize("layers,k", [(1, 3), (2, 5)])
def test_early_exit_is_exact_and_leaves_target_intact(target, layers, k):
    prompt = [1, 5, 7, 9, 3, 5, 7, 9, 3, 5]
    ref = greedy_reference(target, prompt, 30)
    engine = SpeculativeEngine(target, [f"early-exit:layers={layers}"], k=k)
    result = engine.generate(prompt, max_new_tokens=30)
    assert result.token_ids == ref
    assert result.stats.drafted > 0
    assert len(target.model.layers) == 3 and target.config.num_hidden_layers == 3
    drafter = engine.drafters[0]
    assert drafter.model.model.layers[0] is target.model.layers[0]  # shared, not copied


@pytest.mark.parametrize("spec", ["early-exit", "early-exit:layers=3", "early-exit:layers=0"])
def test_early_exit_bad_layers(target, spec):
    with pytest.raises(AdaspecError, match="layers"):
        SpeculativeEngine(target, [spec])
