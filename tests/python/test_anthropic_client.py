"""The official `anthropic` Python client against a running mlxcel server
(`POST /v1/messages`, `POST /v1/messages/count_tokens`).

The client is used as a user would (its `x-api-key` header, its stream
helper, its typed errors); every test asserts values: streamed against
whole answers, usage against count_tokens, forced tool calls against their
schema. The last test replays a request sequence shaped like a coding
agent's (a long system prompt, several tools, tool results growing turn by
turn) and checks that each turn reads the turns before it from the prefix
cache.
"""

import json
import urllib.request

import anthropic
import pytest

#: Greedy decoding, so that answers can be compared. The client's own
#: parameters no longer include `temperature`; the server still reads it.
GREEDY = {"temperature": 0}

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "description": "The current time in a time zone",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string"}},
        "required": ["zone"],
    },
}


@pytest.fixture(scope="module")
def client(mlxcel_server):
    return anthropic.Anthropic(
        base_url=mlxcel_server.base_url,
        api_key=mlxcel_server.api_key,
        max_retries=0,
        timeout=120,
    )


@pytest.fixture(scope="module")
def model(mlxcel_server):
    return mlxcel_server.model


def ask(text):
    return [{"role": "user", "content": text}]


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def prompt_tokens(usage):
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_plain_message_and_its_count(client, model):
    messages = ask("Name three colors.")
    m = client.messages.create(
        model=model, max_tokens=16, extra_body=GREEDY, system="You are brief.", messages=messages
    )
    assert m.id.startswith("msg_")
    assert m.type == "message" and m.role == "assistant" and m.model == model
    assert m.content[0].type == "text" and text_of(m)
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= m.usage.output_tokens <= 16
    assert m.usage.cache_creation_input_tokens == 0
    count = client.messages.count_tokens(model=model, system="You are brief.", messages=messages)
    assert count.input_tokens == prompt_tokens(m.usage)


def test_stream_helper_equals_the_whole_answer(client, model):
    kw = dict(model=model, max_tokens=20, extra_body=GREEDY, messages=ask("Why is the sky blue?"))
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == text_of(whole)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_stop_sequences_end_the_answer(client, model):
    kw = dict(model=model, max_tokens=20, extra_body=GREEDY, messages=ask("Why is the sky blue?"))
    full = text_of(client.messages.create(**kw))
    stop = full.split()[2]
    m = client.messages.create(stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence"
    assert m.stop_sequence == stop
    assert text_of(m) == full[: full.index(stop)]


def test_forced_tool_then_its_result(client, model):
    messages = ask("What is the weather in Paris?")
    kw = dict(model=model, max_tokens=40, extra_body=GREEDY, tools=[WEATHER, TIME])
    m = client.messages.create(
        tool_choice={"type": "tool", "name": "get_weather"}, messages=messages, **kw
    )
    assert m.stop_reason == "tool_use"
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_")
    assert isinstance(call.input["city"], str)
    # Streamed with the helper: the same call, built from input_json deltas.
    with client.messages.stream(
        tool_choice={"type": "tool", "name": "get_weather"}, messages=messages, **kw
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert sum(1 for e in events if e.type == "input_json") >= 2
    assert final.content[0].type == "tool_use"
    assert final.content[0].input == call.input
    # The round trip: the call and its result sent back; a text answer.
    history = messages + [
        {"role": "assistant", "content": m.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees, sunny"}
            ],
        },
    ]
    answer = client.messages.create(messages=history, **kw)
    assert answer.content[0].type == "text" and text_of(answer)
    count = client.messages.count_tokens(model=model, tools=[WEATHER, TIME], messages=history)
    assert count.input_tokens == prompt_tokens(answer.usage)
    # The tools' description (the start of every prompt here) came from
    # the prefix cache the first request filled.
    assert answer.usage.cache_read_input_tokens > 0


def test_any_makes_the_model_call_a_tool(client, model):
    m = client.messages.create(
        model=model,
        max_tokens=40,
        extra_body=GREEDY,
        tools=[WEATHER, TIME],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=ask("What is the weather in Paris?"),
    )
    assert m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) >= 1
    assert calls[0].name in ("get_weather", "get_time")
    assert isinstance(calls[0].input, dict)


def test_errors_are_the_clients_typed_errors(client, model, mlxcel_server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="not-the-served-model", max_tokens=4, messages=ask("hi"))
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=model,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ],
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=mlxcel_server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=model, max_tokens=4, messages=ask("hi"))
    assert e.value.body["error"]["type"] == "authentication_error"


# --- a coding agent's turns -------------------------------------------------

AGENT_SYSTEM = "\n".join(
    [
        "You are a coding agent working in a git repository on the user's machine.",
        "Read files before you change them; keep changes small and explain them.",
    ]
    + [
        f"Rule {i}: prefer the project's own helpers, run the tests after every change,"
        f" and never touch files outside the repository (guideline {i} of the style guide)."
        for i in range(1, 25)
    ]
)


def _tool(name, description, **properties):
    return {
        "name": name,
        "description": description,
        "input_schema": {
            "type": "object",
            "properties": {k: {"type": v} for k, v in properties.items()},
            "required": list(properties),
        },
    }


AGENT_TOOLS = [
    _tool("read_file", "Read a file of the repository", path="string"),
    _tool("write_file", "Write a file of the repository", path="string", content="string"),
    _tool("edit_file", "Replace text in a file", path="string", old="string", new="string"),
    _tool("bash", "Run a shell command", command="string"),
    _tool("grep", "Search the repository", pattern="string", path="string"),
    _tool("list_dir", "List a directory", path="string"),
]

#: The recorded turns: each call the agent made and the result it got.
AGENT_CALLS = [
    ("list_dir", {"path": "src"}, "main.py\nutil.py\ntest_util.py"),
    (
        "read_file",
        {"path": "src/util.py"},
        "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
    ),
    (
        "bash",
        {"command": "python -m pytest -q src"},
        "F.\nFAILED src/test_util.py::test_add - assert -1 == 3\n1 failed, 1 passed in 0.02s",
    ),
    (
        "edit_file",
        {"path": "src/util.py", "old": "return a - b", "new": "return a + b"},
        "Edited src/util.py (1 replacement)",
    ),
    ("bash", {"command": "python -m pytest -q src"}, "..\n2 passed in 0.02s"),
]


def _agent_turn(turn):
    """The request of turn `turn`: the task, then the calls and results of
    the turns before it."""
    messages = [{"role": "user", "content": "The add function in src/util.py is wrong. Fix it."}]
    for i, (name, arguments, result) in enumerate(AGENT_CALLS[:turn]):
        call_id = f"toolu_{i:04d}"
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Step {i + 1}."},
                    {"type": "tool_use", "id": call_id, "name": name, "input": arguments},
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}],
            }
        )
    return messages


def _cache_stats(server):
    request = urllib.request.Request(server.base_url + "/v1/cache/stats", headers=server.headers())
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def test_agent_turns_read_the_turns_before_from_the_prefix_cache(client, model, mlxcel_server):
    block = _cache_stats(mlxcel_server)["block_size"]
    previous = None
    for turn in range(len(AGENT_CALLS) + 1):
        messages = _agent_turn(turn)
        before = _cache_stats(mlxcel_server)
        m = client.messages.create(
            model=model,
            max_tokens=4,
            extra_body=GREEDY,
            system=[{"type": "text", "text": AGENT_SYSTEM, "cache_control": {"type": "ephemeral"}}],
            tools=AGENT_TOOLS,
            messages=messages,
            metadata={"user_id": "agent-test"},
        )
        after = _cache_stats(mlxcel_server)
        total = prompt_tokens(m.usage)
        count = client.messages.count_tokens(
            model=model,
            system=[{"type": "text", "text": AGENT_SYSTEM}],
            tools=AGENT_TOOLS,
            messages=messages,
        )
        assert count.input_tokens == total, turn
        if previous is not None:
            assert total > previous, turn
            # Every full block of the previous turn's prompt is read back
            # (the history renders the same; at most the block where the
            # previous turn's generation prompt ended is recomputed).
            reused = m.usage.cache_read_input_tokens
            assert reused >= (previous // block) * block - block, (turn, reused, previous)
            assert after["hits"] > before["hits"], turn
            assert after["tokens_reused"] - before["tokens_reused"] >= reused, turn
        previous = total
    # The last turns computed only what they added.
    assert m.usage.input_tokens < total // 4, m.usage
