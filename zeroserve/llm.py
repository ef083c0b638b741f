"""Offline batch generation with vLLM's interface: LLM(model).generate(prompts, params)."""

from __future__ import annotations

from typing import Any, Sequence

from zeroserve.common.config import EngineArgs
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.embeddings import finish_embedding
from zeroserve.common.outputs import EmbeddingOutput, RequestOutput
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.common.tools import attach_calls, check_tools, constrained_params
from zeroserve.services.engine import LLMEngine


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is None:  # the built-in model (random weights), made on first use
            from zeroserve.services.tiny_model import default_model_dir

            model = str(default_model_dir())
        self.engine = LLMEngine(EngineArgs.from_kwargs(model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate(prompts)`` without SamplingParams runs with: the model's
        generation_config.json (``generation_config="auto"``) over SamplingParams' defaults."""
        return self.engine.default_sampling_params()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = _prompt_list(prompts)
        if sampling_params is None:  # the model's generation config over SamplingParams' defaults
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequest(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                     "pass one for all or one per prompt")
        return self._run([(p, sp, None) for p, sp in zip(prompts, params)], use_tqdm)

    def embed(self, prompts, pooling: str | None = None, normalize: bool = True, dimensions: int | None = None,
              use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """The embedding of each prompt (text or token ids): its final hidden states pooled
        (``pooling`` "last" or "mean"; default the model's: --pooling), L2-normalised unless
        ``normalize`` is false, truncated to ``dimensions`` first if given."""
        outs = self._run([(p, None, pooling or "") for p in _prompt_list(prompts)], use_tqdm, "embedding")
        return [EmbeddingOutput(o.request_id, o.prompt_token_ids,
                                finish_embedding(o.embedding, dimensions, normalize).tolist()) for o in outs]

    def _run(self, jobs: list[tuple], use_tqdm: bool, what: str = "generating") -> list[RequestOutput]:
        """Add every (prompt, params, pooling) job, then step until all have finished."""
        # validate everything before running anything: a bad prompt loses no work
        ids = []
        try:
            for p, sp, pooling in jobs:
                ids.append(self.engine.add_request(p, sp, pooling=pooling))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc=what, unit="req")
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            for rid in ids:  # leave the engine usable: nothing of this batch stays queued
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
             tool_parser: str | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} dicts) or a list of
        them, through the model's chat template (or `chat_template`, the template's text).
        ``tools`` / ``tool_choice`` as in OpenAI's API (see AsyncClient.chat); the calls are
        parsed into each completion's ``tool_calls`` (``tool_parser``: the format for "auto",
        by default recognised from the template)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        spec = check_tools(tools, tool_choice, parallel_tool_calls)
        if spec is not None:
            if sampling_params is None:
                sampling_params = self.get_default_sampling_params()
            if isinstance(sampling_params, SamplingParams):
                sampling_params = constrained_params(sampling_params, spec)
            else:
                sampling_params = [constrained_params(p, spec) for p in sampling_params]
        outs = self.generate([{"messages": c, "chat_template": chat_template, "tools": spec.tools if spec else None}
                              for c in convs], sampling_params, use_tqdm=use_tqdm)
        if spec is not None:
            if tool_parser is None and spec.choice == "auto":
                from zeroserve.common.tool_parsers import parser_for_template

                tool_parser = parser_for_template(chat_template or self.tokenizer.chat_template)
            for o in outs:
                attach_calls(o.outputs, spec, tool_parser)
        return outs


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids, a dict) or a list of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
