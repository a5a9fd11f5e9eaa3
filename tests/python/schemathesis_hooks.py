"""Schemathesis hooks of test_schemathesis.py, loaded by the schemathesis CLI
through ``SCHEMATHESIS_HOOKS=schemathesis_hooks`` (this folder on PYTHONPATH).

They keep a property-based run over a real model affordable on a CPU without
changing what a response must look like: the generated requests stay within
the document, only smaller.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

#: The model id the server under test serves (set by the test).
SERVED_MODEL = os.environ.get("MLXCEL_SERVED_MODEL", "")

#: Generation runs at ~15 tokens/s on a 2-core CPU, and one request costs
#: max_tokens x n x prompts tokens. Schemathesis draws these from the whole
#: documented range (max_tokens up to 2^63, n up to 16, long prompt lists), so
#: a single case could run for minutes; clamped, every case is sub-second and
#: still exercises stop/length, several choices and several prompts.
MAX_TOKENS = 4
MAX_CHOICES = 2
MAX_PROMPTS = 2

_GENERATION_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}


@schemathesis.hook
def before_load_schema(context: schemathesis.HookContext, raw_schema: dict[str, Any]) -> None:
    """Pins ``model`` and the ``{id}`` of ``/v1/models/{id}`` to the served
    model: the document can only say "the served id" in words, and a random
    name is a 404 that would leave generation untested. Negative cases still
    send other names (404, which the document lists)."""
    if not SERVED_MODEL:
        return
    pinned = {"type": "string", "enum": [SERVED_MODEL]}
    schemas = raw_schema.get("components", {}).get("schemas", {})
    for name in (
        "CreateChatCompletionRequest",
        "CreateCompletionRequest",
        "CreateResponseRequest",
        "CreateMessageRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
        "CreateEmbeddingRequest",
    ):
        properties = schemas.get(name, {}).get("properties")
        if properties is not None and "model" in properties:
            properties["model"] = dict(pinned)
    operation = raw_schema.get("paths", {}).get("/v1/models/{id}", {}).get("get", {})
    for parameter in operation.get("parameters", []):
        if parameter.get("name") == "id":
            parameter["schema"] = dict(pinned)


def _clamp_int(body: dict[str, Any], key: str, limit: int) -> None:
    value = body.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value > limit:
        body[key] = limit


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    """Clamps the cost of every generation request right before it is sent.

    ``before_call`` sees the cases of every phase (coverage cases too), unlike
    the generation-time ``map_body``. Only values above the limits change, so
    invalid values (0, negatives, wrong types) still reach the server."""
    if case.operation.path == "/v1/embeddings" and isinstance(case.body, dict):
        # Each input is a prefill of its own: at most MAX_PROMPTS of them.
        inputs = case.body.get("input")
        if isinstance(inputs, list) and len(inputs) > MAX_PROMPTS and not all(
            isinstance(t, int) for t in inputs
        ):
            case.body["input"] = inputs[:MAX_PROMPTS]
        return
    if case.operation.path not in _GENERATION_PATHS or not isinstance(case.body, dict):
        return
    body = case.body
    _clamp_int(body, "max_tokens", MAX_TOKENS)
    _clamp_int(body, "max_completion_tokens", MAX_TOKENS)
    _clamp_int(body, "max_output_tokens", MAX_TOKENS)
    _clamp_int(body, "n", MAX_CHOICES)
    _clamp_int(body, "best_of", MAX_CHOICES)
    if case.operation.path == "/v1/messages" and "max_tokens" not in body:
        # Required by the route (and absent from the shared schema, which
        # count_tokens reads too): most generated bodies would stop there.
        body["max_tokens"] = MAX_TOKENS
    if case.operation.path == "/v1/completions":
        # The completions default is 16 tokens (as OpenAI's), not the
        # server's --default-max-tokens.
        if body.get("max_tokens") is None:
            body["max_tokens"] = MAX_TOKENS
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not all(
            isinstance(t, int) for t in prompt
        ):
            body["prompt"] = prompt[:MAX_PROMPTS]

#: Special-token strings of the chat formats the served models use: text a
#: client may legitimately write (a JSON value, a message, a stop string)
#: that must stay text, never end a reply or fail a request.
SPECIAL_TOKEN_TEXTS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>")


def _with_special_tokens(value: Any, salt: list[int]) -> Any:
    """``value`` with a special-token string inserted into some of its
    strings (every third one met, deterministically), recursively."""
    if isinstance(value, str):
        salt[0] += 1
        if salt[0] % 3 == 0:
            token = SPECIAL_TOKEN_TEXTS[salt[0] % len(SPECIAL_TOKEN_TEXTS)]
            middle = len(value) // 2
            return value[:middle] + token + value[middle:]
        return value
    if isinstance(value, list):
        return [_with_special_tokens(v, salt) for v in value]
    if isinstance(value, dict):
        return {k: _with_special_tokens(v, salt) for k, v in value.items()}
    return value


@schemathesis.hook
def map_body(context: schemathesis.HookContext, body: Any) -> Any:
    """Puts special-token strings into generated request text (message
    contents, stop strings, text prompts, Responses input and
    instructions): no request may end in a 5xx because of them (issue 28).
    Roles, types, names and other fields the document restricts stay as
    generated."""
    if not isinstance(body, dict):
        return body
    salt = [0]
    messages = body.get("messages")
    if isinstance(messages, list):
        body["messages"] = [_message_with_special_tokens(m, salt) for m in messages]
    for key in ("stop", "instructions", "stop_sequences"):
        if key in body:
            body[key] = _with_special_tokens(body[key], salt)
    for key in ("prompt", "input", "system"):
        value = body.get(key)
        if isinstance(value, str):
            body[key] = _with_special_tokens(value, salt)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            body[key] = _with_special_tokens(value, salt)
    return body


def _message_with_special_tokens(message: Any, salt: list[int]) -> Any:
    """A chat message with special-token strings in its content only (its
    role stays one the document allows)."""
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        message = dict(message)
        message["content"] = _with_special_tokens(message["content"], salt)
    return message
