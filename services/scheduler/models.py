"""The models a scheduler serves: each one's config and sampling defaults (no tokenizer: the
process shell, or the in-process engine, tokenizes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroserve.common.embeddings import model_pooling
from zeroserve.common.log import get_logger
from zeroserve.common.model_config import ModelConfig, resolve_sampling_defaults

log = get_logger("scheduler")


@dataclass
class ModelInfo:
    name: str
    cfg: ModelConfig
    tokenizer: object = None  # unused by the state: the shell tokenizes (service.py)
    sampling_defaults: dict = field(default_factory=dict)  # for the fields a Submit leaves unset
    tool_call_parser: str = ""  # set by the shell once the tokenizer (and so the template) is known
    pooling: str = "last"  # embedding requests that name none (--pooling, common/embeddings.py)


def load_models(dirs: list[str], generation_config: str = "auto", pooling: str = "auto") -> dict[str, ModelInfo]:
    """The served models' configs, sampling defaults and embedding pooling (cheap; a directory we
    cannot serve fails here, at start). Their tokenizers load in the background
    (`SchedulerService`): transformers takes seconds to import, and a restarted scheduler must
    answer pings and HELLOs at once."""
    models = {}
    for d in dirs:
        mc = ModelConfig.from_dir(d)
        defaults = resolve_sampling_defaults(mc, generation_config)
        if defaults:  # vLLM says this too: a request's unset fields will not be SamplingParams' defaults
            log.info("sampling defaults from the model's generation config", model=mc.name, **defaults)
        models[mc.name] = ModelInfo(mc.name, mc, sampling_defaults=defaults, pooling=model_pooling(d, pooling))
    return models
