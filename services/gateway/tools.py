"""Tool calls in the gateway's chat responses: which parser reads a model's calls, and the
assistant message a non-streamed answer carries (streams: common/tools.py's ToolStream)."""

from __future__ import annotations

from typing import Any

from zeroserve.services.gateway.errors import APIError


async def tool_parser(gw, model: str) -> str:
    """The format `model` writes tool calls in (tool_choice auto): the scheduler's
    --tool-call-parser, or what it recognised in the chat template; a 400 when neither says."""
    for refresh in (False, True):  # the card says "" until the scheduler's tokenizer has loaded
        card = next((m for m in await gw.models(refresh=refresh) if m["id"] == model), {})
        if card.get("tool_call_parser"):
            return card["tool_call_parser"]
    raise APIError(400, f'tool_choice "auto" needs to know how model {model!r} writes tool calls, and its chat '
                        "template is not one zeroserve recognises: start the cluster with --tool-call-parser NAME "
                        '(hermes, llama3_json, mistral), or send tool_choice "required" or a named function',
                   "BadRequestError", "invalid_request", param="tool_choice")


def assistant_message(o) -> dict[str, Any]:
    """OpenAI's message of one completion: its text, or with tools the text outside the calls
    and the calls."""
    if o.tool_calls is None:
        return {"role": "assistant", "content": o.text}
    msg: dict[str, Any] = {"role": "assistant", "content": o.content}
    if o.tool_calls:
        msg["tool_calls"] = o.tool_calls
    return msg
