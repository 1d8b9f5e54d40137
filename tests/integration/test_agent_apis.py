"""The APIs agent clients speak, with the real ``openai`` and ``anthropic`` SDKs against
a real ``carpool serve``: OpenAI's Responses (``responses.create``, ``.stream``,
``.parse``, stored responses and ``previous_response_id``), Anthropic's Messages
(``messages.create``, ``.stream``, ``count_tokens``), tool calls whose arguments
validate and arrive in several pieces, tool round trips, bad input in each protocol's
shape, and a client leaving mid-stream aborting its request on each route. Then the
agent frameworks on top, unchanged: LangChain's ``ChatOpenAI`` and the OpenAI Agents
SDK (its chat and Responses models, a function tool)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.integration.conftest import Server, start_server, stop_server
from tests.integration.test_structured_outputs import ARGUMENTS, TOOLS, Person, Weather

CHAT = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--model", CHAT, "--kv-cache-memory", "64MiB")
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def thinking() -> Iterator[Server]:
    """The same model behind a reasoning parser. deepseek_r1: a reply reasons until
    </think>, which this model never writes, so every free reply is all reasoning."""
    s = start_server(
        "--model", CHAT, "--kv-cache-memory", "64MiB", "--reasoning-parser", "deepseek_r1"
    )
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused")


# The openai SDK's own helper makes strict schemas; Responses takes tools flat.
CHAT_TOOLS = TOOLS
RESPONSES_TOOLS: list[Any] = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
MESSAGES_TOOLS: list[Any] = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in CHAT_TOOLS
]
ASK = "What is the weather in Paris?"


# -- Responses -------------------------------------------------------------------------


def test_a_response_whole_and_streamed_says_the_same(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": CHAT,
        "input": "Name a color.",
        "instructions": "Answer in one word.",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    whole = oai.responses.create(**kwargs)
    assert whole.object == "response" and whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens > 0
    kinds, deltas = [], []
    with oai.responses.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == whole.output_text
    assert final.status == whole.status


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "add"}], ids=["required", "named"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_function_calls_have_arguments_that_validate(
    oai: openai.OpenAI, tool_choice: Any, stream: bool
) -> None:
    kwargs: dict[str, Any] = {
        "model": CHAT,
        "input": ASK,
        "tools": RESPONSES_TOOLS,
        "tool_choice": tool_choice,
        "max_output_tokens": 100,
        "temperature": 0,
    }
    if stream:
        pieces: dict[str, list[str]] = {}
        with oai.responses.stream(**kwargs) as events:
            for event in events:
                if event.type == "response.function_call_arguments.delta":
                    pieces.setdefault(event.item_id, []).append(event.delta)
            response = events.get_final_response()
    else:
        response = oai.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    for call in calls:
        if isinstance(tool_choice, dict):
            assert call.name == "add"
        ARGUMENTS[call.name].model_validate_json(call.arguments)
        assert call.call_id.startswith("call_")
        if stream:
            assert call.id is not None and len(pieces[call.id]) > 1
            assert "".join(pieces[call.id]) == call.arguments


def test_responses_parse_returns_an_object_that_validates(oai: openai.OpenAI) -> None:
    parsed = oai.responses.parse(
        model=CHAT,
        input="Describe a person.",
        text_format=Person,
        max_output_tokens=80,
        temperature=0,
    )
    assert isinstance(parsed.output_parsed, Person)


def test_a_tool_round_trip_through_stored_responses(oai: openai.OpenAI) -> None:
    called = oai.responses.create(
        model=CHAT,
        input=ASK,
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        max_output_tokens=100,
        temperature=0,
    )
    call = next(item for item in called.output if item.type == "function_call")
    answer = oai.responses.create(
        model=CHAT,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}],
        tools=RESPONSES_TOOLS,
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
    )
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    assert answer.previous_response_id == called.id
    # The same round trip, stateless: the output items sent back as input.
    stateless = oai.responses.create(
        model=CHAT,
        input=[
            {"role": "user", "content": ASK},
            *[item.model_dump(exclude_none=True) for item in called.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
        ],
        tools=RESPONSES_TOOLS,
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
        store=False,
    )
    # The stored conversation came along: both prompts are the same.
    assert stateless.output_text == answer.output_text
    assert stateless.usage is not None and answer.usage is not None
    assert stateless.usage.input_tokens == answer.usage.input_tokens
    assert oai.responses.retrieve(called.id).output[0].type == "function_call"
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(stateless.id)  # store=False kept nothing


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input[0].content[0]",
        ),
        ({"previous_response_id": "resp_nope"}, 400, "previous_response_id"),
        ({"temperature": 3}, 400, "temperature"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "x",
                        "schema": {"type": "array", "uniqueItems": True},
                    }
                }
            },
            400,
            "text.format",
        ),
        ({"model": "no-such-model"}, 404, "model"),
    ],
)
def test_bad_responses_requests_get_openai_errors_naming_the_field(
    server: Server, extra: dict[str, Any], status: int, param: str
) -> None:
    body = {"model": CHAT, "input": "hi", "max_output_tokens": 4, **extra}
    with server.client() as c:
        r = c.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param or (status == 404 and error["type"] == "not_found_error")
    assert "Traceback" not in r.text


# -- Messages --------------------------------------------------------------------------


def test_a_message_whole_and_streamed_says_the_same(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": CHAT,
        "max_tokens": 12,
        "system": "Answer in one word.",
        "messages": [{"role": "user", "content": "Name a color."}],
        "extra_body": {"temperature": 0},  # this SDK no longer takes it; older ones do
    }
    whole = claude.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens > 0
    kinds, pieces = [], []
    with claude.messages.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                pieces.append(event.delta.text)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert (
        final.stop_reason == whole.stop_reason
        and final.usage.output_tokens == whole.usage.output_tokens
    )
    assert (
        claude.messages.count_tokens(
            model=CHAT, system=kwargs["system"], messages=kwargs["messages"]
        ).input_tokens
        == whole.usage.input_tokens
    )


@pytest.mark.parametrize(
    "tool_choice", [{"type": "any"}, {"type": "tool", "name": "add"}], ids=["any", "named"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_message_tool_uses_have_inputs_that_validate(
    claude: anthropic.Anthropic, tool_choice: Any, stream: bool
) -> None:
    kwargs: dict[str, Any] = {
        "model": CHAT,
        "max_tokens": 100,
        "messages": [{"role": "user", "content": ASK}],
        "tools": MESSAGES_TOOLS,
        "tool_choice": tool_choice,
        "extra_body": {"temperature": 0},
    }
    pieces: dict[int, list[str]] = {}
    if stream:
        with claude.messages.stream(**kwargs) as events:
            for event in events:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    pieces.setdefault(event.index, []).append(event.delta.partial_json)
            message = events.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    uses = [(k, b) for k, b in enumerate(message.content) if b.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for k, use in uses:
        if tool_choice["type"] == "tool":
            assert use.name == "add"
        ARGUMENTS[use.name].model_validate(use.input)
        if stream:
            assert len(pieces[k]) > 1 and json.loads("".join(pieces[k])) == use.input


def test_messages_parse_returns_an_object_that_validates(claude: anthropic.Anthropic) -> None:
    parsed = claude.messages.parse(
        model=CHAT,
        max_tokens=80,
        messages=[{"role": "user", "content": "Describe a person."}],
        output_format=Person,
        extra_body={"temperature": 0},
    )
    assert isinstance(parsed.parsed_output, Person)


def test_a_tool_use_its_result_and_the_answer(claude: anthropic.Anthropic) -> None:
    asked: list[Any] = [{"role": "user", "content": ASK}]
    called = claude.messages.create(
        model=CHAT,
        max_tokens=100,
        messages=asked,
        tools=MESSAGES_TOOLS,
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    use = next(b for b in called.content if b.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}
    history = [
        *asked,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in called.content]},
        {"role": "user", "content": [result]},
    ]
    answer = claude.messages.create(
        model=CHAT,
        max_tokens=20,
        messages=history,
        tools=MESSAGES_TOOLS,
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    assert answer.content and all(b.type == "text" for b in answer.content)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    # The call and its result are in the prompt (tool_choice none offers no tools).
    counted = claude.messages.count_tokens(
        model=CHAT, messages=history, tools=MESSAGES_TOOLS, tool_choice={"type": "none"}
    )
    assert counted.input_tokens == answer.usage.input_tokens
    alone = claude.messages.count_tokens(model=CHAT, messages=asked).input_tokens
    assert answer.usage.input_tokens > alone + 10


def test_a_stop_sequence_met_is_named(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": CHAT,
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "extra_body": {"temperature": 0},
    }
    text = claude.messages.create(**kwargs).content[0].text  # type: ignore[union-attr]
    words = text.split()
    assert len(words) > 3, text
    stop = words[2]
    stopped = claude.messages.create(**kwargs, stop_sequences=["@@never@@", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stop not in stopped.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "status", "kind", "names"),
    [
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}
                ],
            },
            400,
            "invalid_request_error",
            "Input tag 'image'",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "messages[0].content[0]",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
            400,
            "invalid_request_error",
            "temperature",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "output_config": {
                    "format": {
                        "type": "json_schema",
                        "schema": {"type": "array", "uniqueItems": True},
                    }
                },
            },
            400,
            "invalid_request_error",
            "output_config.format",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "model": "nope"},
            404,
            "not_found_error",
            "nope",
        ),
    ],
)
def test_bad_messages_requests_get_anthropic_errors_naming_the_field(
    server: Server, body: dict[str, Any], status: int, kind: str, names: str
) -> None:
    with server.client() as c:
        r = c.post("/v1/messages", json={"model": CHAT, **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert names in error["error"]["message"] and "Traceback" not in r.text


def test_the_anthropic_sdk_raises_its_own_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model=CHAT, max_tokens=0, messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )


# -- reasoning, in every API -------------------------------------------------------------


def test_a_reasoning_parser_splits_replies_in_every_api(
    oai: openai.OpenAI, thinking: Server
) -> None:
    asked: list[Any] = [{"role": "user", "content": "Name a color."}]
    greedy: dict[str, Any] = {"model": CHAT, "temperature": 0}
    # The same model without a parser answers the same text, as its answer.
    said = oai.chat.completions.create(messages=asked, max_tokens=12, **greedy)
    text = said.choices[0].message.content
    assert text
    t_oai = openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="unused")
    whole = t_oai.chat.completions.create(messages=asked, max_tokens=12, **greedy)
    message = whole.choices[0].message
    assert message.content is None
    assert message.model_extra is not None and message.model_extra["reasoning_content"] == text
    pieces = [
        (chunk.choices[0].delta.model_extra or {}).get("reasoning_content")
        for chunk in t_oai.chat.completions.create(
            messages=asked, max_tokens=12, stream=True, **greedy
        )
        if chunk.choices
    ]
    assert len([p for p in pieces if p]) > 1 and "".join(p for p in pieces if p) == text

    response = t_oai.responses.create(input=asked, max_output_tokens=12, **greedy)
    reasoning, answer = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == text
    assert answer.type == "message" and response.output_text == ""
    with t_oai.responses.stream(input=asked, max_output_tokens=12, **greedy) as events:
        seen = list(events)
    deltas = [e.delta for e in seen if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == text
    last = seen[-1]
    assert last.type == "response.incomplete"  # cut by max_output_tokens, as asked
    assert [item.type for item in last.response.output] == ["reasoning", "message"]

    claude = anthropic.Anthropic(base_url=thinking.url, api_key="unused")
    # This SDK no longer takes temperature as an argument; older ones do.
    ask: dict[str, Any] = {"model": CHAT, "max_tokens": 12, "messages": asked}
    ask["extra_body"] = {"temperature": 0}
    said_in_messages = claude.messages.create(**ask)
    block = said_in_messages.content[0]
    assert block.type == "thinking" and block.thinking == text
    with claude.messages.stream(**ask) as stream:
        thoughts = [
            e.delta.thinking
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        ]
    assert "".join(thoughts) == text

    # Under a grammar the reply is constrained from its first token: not split.
    shaped = t_oai.chat.completions.create(
        messages=asked, max_tokens=40, response_format={"type": "json_object"}, **greedy
    )
    assert isinstance(json.loads(shaped.choices[0].message.content or ""), dict)
    assert shaped.choices[0].message.model_extra == {"reasoning_content": None, "reasoning": None}


# -- chat completions' streamed tool calls -----------------------------------------------


def test_chat_streams_a_calls_name_first_then_its_arguments_in_pieces(oai: openai.OpenAI) -> None:
    entries = []
    for chunk in oai.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": ASK}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        max_tokens=100,
        temperature=0,
        stream=True,
    ):
        if chunk.choices:
            entries += chunk.choices[0].delta.tool_calls or []
    first = entries[0]
    assert first.id and first.type == "function" and first.function is not None
    assert first.function.name in ARGUMENTS
    arguments = [
        e.function.arguments
        for e in entries
        if e.index == 0 and e.function and e.function.arguments
    ]
    assert len(arguments) > 1
    ARGUMENTS[first.function.name].model_validate_json("".join(arguments))


# -- leaving mid-stream ----------------------------------------------------------------

LONG_STRING = {"type": "string", "minLength": 2000}
LEAVING: dict[str, dict[str, Any]] = {
    "/v1/responses": {
        "input": "Write.",
        "max_output_tokens": 900,
        "text": {
            "format": {
                "type": "json_schema",
                "name": "story",
                "schema": {
                    "type": "object",
                    "properties": {"story": LONG_STRING},
                    "required": ["story"],
                },
            }
        },
    },
    "/v1/messages": {
        "max_tokens": 900,
        "messages": [{"role": "user", "content": "Write."}],
        "tools": [
            {
                "name": "write",
                "input_schema": {
                    "type": "object",
                    "properties": {"story": LONG_STRING},
                    "required": ["story"],
                },
            }
        ],
        "tool_choice": {"type": "any"},
    },
    "/v1/chat/completions": {
        "max_tokens": 900,
        "messages": [{"role": "user", "content": "Write."}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "write",
                    "parameters": {
                        "type": "object",
                        "properties": {"story": LONG_STRING},
                        "required": ["story"],
                    },
                },
            }
        ],
        "tool_choice": "required",
    },
}


def _aborted(server: Server) -> float:
    try:
        return server.metric("carpool_request_success_total", model=CHAT, finished_reason="abort")
    except KeyError:
        return 0.0


@pytest.mark.parametrize("path", sorted(LEAVING))
def test_a_client_leaving_mid_stream_aborts_its_request(server: Server, path: str) -> None:
    """The grammar holds each reply open for 2000 characters: it is running, not done,
    when the client leaves."""
    before = _aborted(server)
    body = {"model": CHAT, "stream": True, **LEAVING[path]}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a generator left behind would close the stream
        events = [next(line for line in lines if line.startswith("data: ")) for _ in range(8)]
        assert len(events) == 8  # past the opening events: tokens are flowing
        assert server.metric("carpool_num_requests_running", model=CHAT) == 1
    # The connection is closed: the request is aborted at the engine's next step.
    deadline = time.monotonic() + 30
    while _aborted(server) < before + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert server.metric("carpool_num_requests_running", model=CHAT) == 0
    assert server.metric("carpool_kv_cache_usage_perc", model=CHAT) == 0


# --- agent frameworks on top of the OpenAI routes ----------------------------------------


def test_langchains_chat_model_invokes_streams_binds_tools_and_structures(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    def chat(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(
            base_url=f"{server.url}/v1",
            api_key="unused",  # type: ignore[arg-type]
            model=CHAT,
            temperature=0,
            max_tokens=max_tokens,  # type: ignore[call-arg]
            max_retries=0,
        )

    llm = chat(8)
    whole = llm.invoke("Say hello.")
    assert isinstance(whole.content, str) and whole.content
    streamed = "".join(str(chunk.content) for chunk in llm.stream("Say hello."))
    assert streamed == whole.content  # greedy: the same tokens either way
    caller = chat(100).bind_tools([Weather], tool_choice="Weather")
    (call,) = caller.invoke("What is the weather in Paris?").tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"])
    structured = chat(100).with_structured_output(Person)
    assert isinstance(structured.invoke("Describe a person from Rome."), Person)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_the_openai_agents_sdk_runs_a_function_tool(server: Server, api: str) -> None:
    import agents

    agents.set_tracing_disabled(True)  # its traces go to OpenAI's servers otherwise
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model: agents.Model = (
        agents.OpenAIChatCompletionsModel(model=CHAT, openai_client=client)
        if api == "chat"
        else agents.OpenAIResponsesModel(model=CHAT, openai_client=client)
    )
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        model=model,
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="get_weather", max_tokens=100, temperature=0
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(asked) == 1 and result.final_output == f"sunny in {asked[0]}"
