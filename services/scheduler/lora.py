"""The scheduler's LoRA adapters: which it serves (its registry), their cards in /v1/models and
the LoadLoRA / UnloadLoRA questions a client (the gateway's /v1/load_lora_adapter) asks.

Workers need no registry of their own: the scheduler resolves a request's adapter name to its
directory at admission (`Request.lora_path`) and every NewRequest carries it, so a worker that
joins later, or a request that fails over to another group, loads the same adapter where it
runs. Adapters are checked against the base model's config here, without torch
(common/lora.py), so a client learns at once what does not fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroserve.common import messages as P
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.lora import LoRARegistry, parse_lora_modules
from zeroserve.services.scheduler.outbox import Outbox

if TYPE_CHECKING:
    from zeroserve.common.config import SchedulerConfig


class LoRAAdmin:
    def __init__(self, cfg: SchedulerConfig, models: dict) -> None:
        self.cfg, self.models = cfg, models
        cfg.validate_lora(lambda msg: InvalidRequest(f"scheduler config: {msg}"))
        self.registry = LoRARegistry(cfg.max_lora_rank)
        default = next(iter(models), None)
        for name, path in parse_lora_modules(cfg.lora_modules).items():
            if default is None:
                raise InvalidRequest("--lora-modules needs a base model (--model)")
            self.registry.add(name, path, models[default].cfg, default, models)

    def resolve(self, params, model: str | None):
        return self.registry.resolve(params, model)

    def on_load(self, ident: bytes, m: P.LoadLoRA, now: float) -> Outbox:
        ob = Outbox()
        try:
            if not self.cfg.lora_enabled:
                raise InvalidRequest("this cluster serves no LoRA adapters; start it with --enable-lora "
                                     "(or --lora-modules)")
            model = m.model or next(iter(self.models), None)
            if model not in self.models:
                raise InvalidRequest(f"model {model!r} is not served by this cluster")
            self.registry.add(m.name, m.path, self.models[model].cfg, model, self.models)
            ob.to_client(ident, P.LoRAReply(name=m.name))
        except InvalidRequest as e:
            ob.to_client(ident, P.LoRAReply(name=m.name, ok=False, detail=str(e)[:4000]))
        return ob

    def on_unload(self, ident: bytes, m: P.UnloadLoRA, now: float) -> Outbox:
        ob = Outbox()
        try:
            self.registry.remove(m.name)
            ob.to_client(ident, P.LoRAReply(name=m.name))
        except InvalidRequest as e:
            ob.to_client(ident, P.LoRAReply(name=m.name, ok=False, detail=str(e)))
        return ob
