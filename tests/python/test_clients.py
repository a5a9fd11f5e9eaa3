"""Client libraries people put in front of an OpenAI-compatible server, unchanged.

langchain-openai, instructor, litellm and the OpenAI Agents SDK (its
``OpenAIChatCompletionsModel``: Chat Completions) each drive the real mlxcel
server through three things: a forced tool call, a
streamed tool call and structured output. The model is tiny, so its answers
are not smart, but forced tool choices and json_schema are decoded under a
grammar: the shapes are guaranteed, and the tests assert them: the called
function is the forced one, its arguments are a JSON object valid against the
tool's parameter schema, streamed argument fragments join into that object,
structured output parses into the pydantic model, and finish reasons are the
ones OpenAI documents (``tool_calls`` for a call, ``stop`` for a finished
answer).

Where a library hides the wire (instructor, the Agents SDK, the ``type`` of a
langchain tool-call delta), a recording httpx transport keeps a copy of the
request it sent and of the bytes it got back, without changing either; the
library itself still reads the response as usual.

The Agents SDK's default model (``OpenAIResponsesModel``, the Responses API)
runs an agent with one function tool through a whole run: the forced call,
the tool's result sent back as a ``function_call_output``, and the answer.

Nothing here may reach the internet: litellm uses its bundled model-cost map
and no telemetry, and the Agents SDK's tracing is off.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Annotated, Any

# Before litellm is imported: its bundled model-cost map, not a download,
# and no catalog, check or tokenizer fetched on its own.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_OFFLINE_MODE"] = "true"

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

import instructor
import litellm
from agents import (
    Agent,
    MessageOutputItem,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIProvider,
    OpenAIResponsesModel,
    Runner,
    ToolCallOutputItem,
    ToolCallItem,
    function_tool,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI

litellm.telemetry = False  # gone from current releases; older ones read it
litellm.suppress_debug_info = True
set_tracing_disabled(True)

# litellm's own TypedDicts use typing.ReadOnly, which pydantic warns about.
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")

MAX_TOKENS = 48
TIMEOUT_S = 120

QUESTION = "What is the weather in Paris?"
CITY_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": CITY_PARAMETERS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time of a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 20}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}


class City(BaseModel):
    """A city."""

    city: str = Field(max_length=20)


def ask(text: str = QUESTION) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def model(mlxcel_server) -> str:
    return mlxcel_server.model


@pytest.fixture(scope="module")
def v1(mlxcel_server) -> str:
    return mlxcel_server.base_url + "/v1"


# --- a recording transport ---------------------------------------------------


@dataclass
class Exchange:
    """One HTTP exchange a library made: its JSON request and the raw reply."""

    path: str
    request: Any
    status: int = 0
    body: bytearray = field(default_factory=bytearray)

    def json(self) -> Any:
        return json.loads(bytes(self.body))

    def chunks(self) -> list[dict]:
        """The ``data:`` payloads of a server-sent-event reply, up to ``[DONE]``."""
        out, done = [], False
        for line in bytes(self.body).decode("utf-8").splitlines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            assert not done, f"data after [DONE]: {data!r}"
            if data == "[DONE]":
                done = True
                continue
            out.append(json.loads(data))
        assert done, "the stream did not end with data: [DONE]"
        return out


class _TeeSync(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, sink: bytearray):
        self._inner, self._sink = inner, sink

    def __iter__(self):
        for piece in self._inner:
            self._sink.extend(piece)
            yield piece

    def close(self) -> None:
        self._inner.close()


class _TeeAsync(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, sink: bytearray):
        self._inner, self._sink = inner, sink

    async def __aiter__(self):
        async for piece in self._inner:
            self._sink.extend(piece)
            yield piece

    async def aclose(self) -> None:
        await self._inner.aclose()


class Recorder:
    """httpx clients that keep a copy of each exchange; nothing is altered."""

    def __init__(self) -> None:
        self.exchanges: list[Exchange] = []

    def _begin(self, request: httpx.Request) -> Exchange:
        content = request.read()
        exchange = Exchange(request.url.path, json.loads(content) if content else None)
        self.exchanges.append(exchange)
        return exchange

    def _end(self, exchange: Exchange, request: httpx.Request, response: httpx.Response, tee) -> httpx.Response:
        assert "content-encoding" not in response.headers, "a compressed reply cannot be read raw"
        exchange.status = response.status_code
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=tee(response.stream, exchange.body),
            extensions=response.extensions,
            request=request,
        )

    def sync_client(self) -> httpx.Client:
        recorder = self

        class Tap(httpx.BaseTransport):
            def __init__(self) -> None:
                self._inner = httpx.HTTPTransport()

            def handle_request(self, request):
                exchange = recorder._begin(request)
                return recorder._end(exchange, request, self._inner.handle_request(request), _TeeSync)

            def close(self) -> None:
                self._inner.close()

        return httpx.Client(transport=Tap(), timeout=TIMEOUT_S)

    def async_client(self) -> httpx.AsyncClient:
        recorder = self

        class Tap(httpx.AsyncBaseTransport):
            def __init__(self) -> None:
                self._inner = httpx.AsyncHTTPTransport()

            async def handle_async_request(self, request):
                exchange = recorder._begin(request)
                return recorder._end(
                    exchange, request, await self._inner.handle_async_request(request), _TeeAsync
                )

            async def aclose(self) -> None:
                await self._inner.aclose()

        return httpx.AsyncClient(transport=Tap(), timeout=TIMEOUT_S)

    def only_chat(self) -> Exchange:
        """The one chat-completions exchange made, which succeeded."""
        chats = [e for e in self.exchanges if e.path.endswith("/chat/completions")]
        assert len(chats) == 1, [e.path for e in self.exchanges]
        assert chats[0].status == 200, bytes(chats[0].body)[:500]
        return chats[0]


# --- shared assertions -------------------------------------------------------


def assert_one_call(message: dict, finish_reason: str, name: str, schema: dict) -> dict:
    """A non-streamed reply that calls ``name`` once: its parsed, valid arguments."""
    assert finish_reason == "tool_calls", message
    assert not message.get("content"), message
    [call] = message["tool_calls"]
    assert call["type"] == "function"
    assert isinstance(call["id"], str) and call["id"]
    assert call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args, dict)
    jsonschema.validate(args, schema)
    return args


def assert_streamed_call(chunks: list[dict], name: str, schema: dict) -> str:
    """Chunks of a stream that calls ``name`` once, as OpenAI streams it.

    The first tool-call delta opens the call (id, type ``function``, the
    name); the deltas after it carry only argument fragments, more than one
    of them (an object of a key and a string value is several tokens), and
    the fragments join into a JSON object valid against ``schema``. The
    choice finishes with ``tool_calls`` and says nothing in text. Returns
    the joined arguments.
    """
    assert chunks, "no chunks"
    assert len({c["id"] for c in chunks}) == 1
    deltas, finishes, text = [], [], ""
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        for choice in chunk["choices"]:
            assert choice["index"] == 0
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            deltas += delta.get("tool_calls") or []
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    assert finishes == ["tool_calls"], finishes
    assert text == "", text
    assert deltas, "no tool-call deltas"
    assert {d["index"] for d in deltas} == {0}, deltas

    first, rest = deltas[0], deltas[1:]
    assert isinstance(first.get("id"), str) and first["id"], first
    assert first.get("type") == "function", first
    assert first["function"]["name"] == name, first
    for later in rest:
        assert not later.get("id"), later
        assert not (later.get("function") or {}).get("name"), later
    fragments = [d["function"]["arguments"] for d in deltas if (d.get("function") or {}).get("arguments")]
    joined = "".join(fragments)
    args = json.loads(joined)
    assert isinstance(args, dict), joined
    jsonschema.validate(args, schema)
    assert len(fragments) >= 2, f"the arguments {joined!r} came in one piece: {deltas}"
    assert any((d.get("function") or {}).get("arguments") for d in rest), deltas
    return joined


# --- langchain-openai ----------------------------------------------------------


def chat_openai(v1, api_key, model, recorder=None, **kw) -> ChatOpenAI:
    if recorder is not None:
        kw["http_client"] = recorder.sync_client()
    return ChatOpenAI(
        model=model, base_url=v1, api_key=api_key, temperature=0, max_tokens=MAX_TOKENS,
        max_retries=0, timeout=TIMEOUT_S, **kw,
    )


def test_langchain_forced_tool_call(v1, api_key, model):
    llm = chat_openai(v1, api_key, model).bind_tools([WEATHER, TIME], tool_choice="get_weather")
    message = llm.invoke(QUESTION)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert message.invalid_tool_calls == []
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    assert isinstance(call["id"], str) and call["id"]
    jsonschema.validate(call["args"], CITY_PARAMETERS)
    assert message.content == ""


def test_langchain_streamed_tool_call(v1, api_key, model):
    recorder = Recorder()
    llm = chat_openai(v1, api_key, model, recorder).bind_tools(
        [WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    pieces = list(llm.stream(QUESTION))
    sent = recorder.only_chat()
    assert sent.request["stream"] is True and sent.request["tool_choice"] == "required"
    joined = assert_streamed_call(sent.chunks(), "get_weather", CITY_PARAMETERS)

    # What langchain made of the stream: the same call, piece by piece.
    tool_chunks = [t for p in pieces for t in p.tool_call_chunks]
    assert tool_chunks[0]["name"] == "get_weather" and tool_chunks[0]["id"]
    assert "".join(t["args"] or "" for t in tool_chunks) == joined
    full = pieces[0]
    for p in pieces[1:]:
        full += p
    assert full.response_metadata["finish_reason"] == "tool_calls"
    assert full.invalid_tool_calls == []
    [call] = full.tool_calls
    assert call["name"] == "get_weather" and call["args"] == json.loads(joined)


def test_langchain_structured_output(v1, api_key, model):
    recorder = Recorder()
    llm = chat_openai(v1, api_key, model, recorder)
    result = llm.with_structured_output(City, method="json_schema", include_raw=True).invoke(QUESTION)
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], City)
    raw = result["raw"]
    assert raw.response_metadata["finish_reason"] == "stop"
    assert City.model_validate_json(raw.content) == result["parsed"]
    sent = recorder.only_chat()
    assert sent.request["response_format"]["type"] == "json_schema"
    jsonschema.validate(json.loads(raw.content), sent.request["response_format"]["json_schema"]["schema"])


# --- instructor ------------------------------------------------------------------


def instructor_client(v1, api_key, mode, recorder):
    client = openai.OpenAI(
        base_url=v1, api_key=api_key, max_retries=0, timeout=TIMEOUT_S,
        http_client=recorder.sync_client(),
    )
    return instructor.from_openai(client, mode=mode)


def sent_tool(request: dict) -> tuple[str, dict]:
    """The one tool instructor offered and forced: (name, parameters)."""
    [tool] = request["tools"]
    name = tool["function"]["name"]
    assert request["tool_choice"] == {"type": "function", "function": {"name": name}}
    return name, tool["function"]["parameters"]


def test_instructor_forced_tool_call(v1, api_key, model):
    recorder = Recorder()
    client = instructor_client(v1, api_key, instructor.Mode.TOOLS, recorder)
    city, completion = client.chat.completions.create_with_completion(
        model=model, response_model=City, messages=ask(), max_tokens=MAX_TOKENS, temperature=0, max_retries=0,
    )
    assert isinstance(city, City)
    name, parameters = sent_tool(recorder.only_chat().request)
    choice = completion.choices[0]
    args = assert_one_call(choice.message.model_dump(), choice.finish_reason, name, parameters)
    # instructor returns its own subclass of City: compare the values.
    assert City.model_validate(args).model_dump() == city.model_dump()


def test_instructor_streamed_tool_call(v1, api_key, model):
    recorder = Recorder()
    client = instructor_client(v1, api_key, instructor.Mode.TOOLS, recorder)
    partials = list(client.chat.completions.create_partial(
        model=model, response_model=City, messages=ask(), max_tokens=MAX_TOKENS, temperature=0,
        max_retries=0, stream=True,
    ))
    sent = recorder.only_chat()
    assert sent.request["stream"] is True
    name, parameters = sent_tool(sent.request)
    joined = assert_streamed_call(sent.chunks(), name, parameters)
    assert partials, "instructor yielded nothing"
    assert partials[-1].city == City.model_validate_json(joined).city


def test_instructor_json_schema_output(v1, api_key, model):
    recorder = Recorder()
    client = instructor_client(v1, api_key, instructor.Mode.JSON_SCHEMA, recorder)
    city, completion = client.chat.completions.create_with_completion(
        model=model, response_model=City, messages=ask(), max_tokens=MAX_TOKENS, temperature=0, max_retries=0,
    )
    assert isinstance(city, City)
    sent = recorder.only_chat()
    assert sent.request["response_format"]["type"] == "json_schema"
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    assert City.model_validate_json(choice.message.content).model_dump() == city.model_dump()


# --- litellm --------------------------------------------------------------------


def litellm_kw(v1, api_key, model) -> dict:
    return dict(
        model=f"openai/{model}", api_base=v1, api_key=api_key, messages=ask(),
        max_tokens=MAX_TOKENS, temperature=0, max_retries=0, timeout=TIMEOUT_S,
    )


def test_litellm_forced_tool_call(v1, api_key, model):
    response = litellm.completion(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **litellm_kw(v1, api_key, model),
    )
    choice = response.choices[0]
    assert_one_call(choice.message.model_dump(), choice.finish_reason, "get_weather", CITY_PARAMETERS)


def test_litellm_streamed_tool_call(v1, api_key, model):
    kw = litellm_kw(v1, api_key, model)
    chunks = list(litellm.completion(
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=True, **kw,
    ))
    joined = assert_streamed_call([c.model_dump() for c in chunks], "get_weather", CITY_PARAMETERS)
    rebuilt = litellm.stream_chunk_builder(chunks, messages=kw["messages"])
    choice = rebuilt.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == joined


def test_litellm_structured_output(v1, api_key, model):
    response = litellm.completion(response_format=City, **litellm_kw(v1, api_key, model))
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    City.model_validate_json(choice.message.content)


# --- OpenAI Agents SDK (Chat Completions) ----------------------------------------


calls: list[str] = []


@function_tool
def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
    """Current weather of a city."""
    calls.append(city)
    return f"sunny in {city}"


def chat_model(v1, api_key, model, recorder) -> OpenAIChatCompletionsModel:
    client = openai.AsyncOpenAI(
        base_url=v1, api_key=api_key, max_retries=0, timeout=TIMEOUT_S,
        http_client=recorder.async_client(),
    )
    return OpenAIChatCompletionsModel(model=model, openai_client=client)


def weather_agent(v1, api_key, model, recorder, tool_choice) -> Agent:
    # The tool's result is the run's answer: one model call, no second turn.
    return Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        model=chat_model(v1, api_key, model, recorder),
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(
            tool_choice=tool_choice, parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS,
        ),
    )


def test_agents_forced_tool_call(v1, api_key, model):
    recorder = Recorder()
    calls.clear()
    agent = weather_agent(v1, api_key, model, recorder, "get_weather")
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=2))
    sent = recorder.only_chat()
    assert sent.request["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    choice = sent.json()["choices"][0]
    args = assert_one_call(choice["message"], choice["finish_reason"], "get_weather", get_weather.params_json_schema)
    [item] = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    assert item.raw_item.name == "get_weather"
    assert json.loads(item.raw_item.arguments) == args
    assert calls == [args["city"]]
    assert result.final_output == f"sunny in {args['city']}"


def test_agents_streamed_tool_call(v1, api_key, model):
    recorder = Recorder()
    calls.clear()
    agent = weather_agent(v1, api_key, model, recorder, "required")

    async def run():
        result = Runner.run_streamed(agent, QUESTION, max_turns=2)
        events = [e async for e in result.stream_events()]
        return result, events

    result, events = asyncio.run(run())
    sent = recorder.only_chat()
    assert sent.request["stream"] is True and sent.request["tool_choice"] == "required"
    joined = assert_streamed_call(sent.chunks(), "get_weather", get_weather.params_json_schema)

    # The SDK re-emits the call as Responses events: the item first, then
    # its argument deltas, which join into the same arguments.
    raw = [e.data for e in events if e.type == "raw_response_event"]
    added = [i for i, d in enumerate(raw) if d.type == "response.output_item.added" and d.item.type == "function_call"]
    deltas = [i for i, d in enumerate(raw) if d.type == "response.function_call_arguments.delta"]
    assert len(added) == 1 and raw[added[0]].item.name == "get_weather"
    assert len(deltas) >= 2 and added[0] < deltas[0]
    assert "".join(raw[i].delta for i in deltas) == joined
    args = json.loads(joined)
    assert calls == [args["city"]]
    assert result.final_output == f"sunny in {args['city']}"


def test_agents_structured_output(v1, api_key, model):
    recorder = Recorder()
    agent = Agent(
        name="city",
        instructions="Name the city the user asks about.",
        model=chat_model(v1, api_key, model, recorder),
        output_type=City,
        model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
    )
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=1))
    assert isinstance(result.final_output, City)
    sent = recorder.only_chat()
    response_format = sent.request["response_format"]
    assert response_format["type"] == "json_schema" and response_format["json_schema"]["strict"] is True
    choice = sent.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert City.model_validate_json(choice["message"]["content"]) == result.final_output


# --- OpenAI Agents SDK, its default model (the Responses API) --------------------


def test_agents_default_responses_model_runs_a_tool_round_trip(v1, api_key, model):
    recorder = Recorder()
    calls.clear()
    client = openai.AsyncOpenAI(
        base_url=v1, api_key=api_key, max_retries=0, timeout=TIMEOUT_S,
        http_client=recorder.async_client(),
    )
    # What a new user gets: the default provider's model for a name.
    responses_model = OpenAIProvider(openai_client=client).get_model(model)
    assert isinstance(responses_model, OpenAIResponsesModel)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        model=responses_model,
        tools=[get_weather],
        # Forced on the first turn; the SDK resets it to auto after the call,
        # and the second turn answers from the tool's result.
        model_settings=ModelSettings(
            tool_choice="get_weather", parallel_tool_calls=False, temperature=0, max_tokens=24,
        ),
    )
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=3))
    sent = [e for e in recorder.exchanges if e.path.endswith("/responses")]
    assert len(sent) >= 2 and all(e.status == 200 for e in sent)
    first, second = sent[0], sent[1]
    assert first.request["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert first.request["tools"][0]["name"] == "get_weather"
    [call] = [i.raw_item for i in result.new_items if isinstance(i, ToolCallItem)]
    args = json.loads(call.arguments)
    jsonschema.validate(args, get_weather.params_json_schema)
    assert calls == [args["city"]]
    assert first.json()["output"][0]["call_id"] == call.call_id
    [output] = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert output.output == f"sunny in {args['city']}"
    # The second turn sends the call and its output back as input items.
    kinds = [item.get("type") for item in second.request["input"]]
    assert "function_call" in kinds and "function_call_output" in kinds
    sent_output = next(i for i in second.request["input"] if i.get("type") == "function_call_output")
    assert sent_output["call_id"] == call.call_id
    # The run ends with a text answer, which is the final output.
    messages = [i for i in result.new_items if isinstance(i, MessageOutputItem)]
    assert messages, [type(i).__name__ for i in result.new_items]
    answer = sent[-1].json()
    text = "".join(p["text"] for item in answer["output"] if item["type"] == "message" for p in item["content"])
    assert isinstance(result.final_output, str) and result.final_output == text and text.strip()
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
