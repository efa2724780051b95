"""adaspec: adaptive speculative decoding for Hugging Face causal LMs.

Quick start::

    from adaspec import SpeculativeEngine
    engine = SpeculativeEngine.from_pretrained("smollm2", drafters=["prompt-lookup"])
    result = engine.generate("Repeat after me: the cat sat on the mat.", max_new_tokens=64)
    print(result.text, result.stats.summary())
"""

from .config import GenerationConfig, SamplingConfig
from .drafters import (Decision, FeatureHeadDrafter, TinyLMDrafter, Draft, Drafter, DraftStep, ModelDrafter, NoDrafter,
                       PromptLookupDrafter, Proposals, SuffixDatastore, SuffixDrafter, build_drafter)
from .engine import GenerationResult, SpeculativeEngine
from .errors import (AdaspecError, ConfigError, ModelLoadError, PromptError, UnknownNameError,
                     VocabularyMismatchError)
from .feedback import RoundFeedback
from .length import LengthPolicy, StaticLength
from .metrics import RequestStats, RoundRecord
from .models import LoadedModel, load_model
from .selection import DrafterPolicy, StaticPolicy
from .version import __version__

__all__ = [
    "AdaspecError", "ConfigError", "Decision", "Draft", "Drafter", "DrafterPolicy", "DraftStep",
    "FeatureHeadDrafter", "TinyLMDrafter",
    "GenerationConfig", "GenerationResult", "LengthPolicy", "LoadedModel", "ModelDrafter",
    "ModelLoadError", "NoDrafter", "PromptError", "PromptLookupDrafter", "Proposals",
    "RequestStats", "RoundFeedback", "RoundRecord", "SamplingConfig", "SpeculativeEngine",
    "StaticLength", "StaticPolicy", "SuffixDatastore", "SuffixDrafter", "UnknownNameError",
    "VocabularyMismatchError", "build_drafter", "load_model",
]
