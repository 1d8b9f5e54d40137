"""Structured outputs with the real ``openai`` client against a real ``carpool
serve``: ``chat.completions.parse`` with Pydantic models of different shapes
returns objects that validate, streamed output parses too, vLLM's ``choice`` and
``regex`` outputs match, and what cannot be enforced or is malformed is a 400
naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import Server, start_server, stop_server

CHAT = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--model", CHAT, "--kv-cache-memory", "64MiB")
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


class Person(BaseModel):
    name: Annotated[str, Field(max_length=20)]
    age: Annotated[int, Field(ge=0, le=120)]
    city: Literal["Paris", "London", "Rome"]


class Item(BaseModel):
    sku: Literal["A", "B", "C"]
    quantity: Annotated[int, Field(ge=1, le=9)]


class Order(BaseModel):
    number: Annotated[int, Field(ge=1, le=9999)]
    items: Annotated[list[Item], Field(max_length=3)]
    paid: bool


class Color(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Palette(BaseModel):
    primary: Color
    secondary: Color | None


class Code(BaseModel):
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}-[0-9]{2}$")]
    valid: bool


class Team(BaseModel):
    lead: Person
    members: Annotated[list[Annotated[str, Field(max_length=12)]], Field(max_length=2)]


class Address(BaseModel):
    street: Annotated[str, Field(max_length=30)]
    zip_code: Annotated[str, Field(pattern=r"^[0-9]{5}$")]
    country: Literal["FR", "GB", "IT"]


class Event(BaseModel):
    title: Annotated[str, Field(max_length=30)]
    day: Annotated[int, Field(ge=1, le=31)]
    attendees: Annotated[list[Annotated[str, Field(max_length=10)]], Field(max_length=3)]


class Rating(BaseModel):
    score: Annotated[int, Field(ge=1, le=5)]
    comment: Annotated[str, Field(max_length=40)] | None


class Author(BaseModel):
    name: Annotated[str, Field(max_length=20)]


class Book(BaseModel):
    title: Annotated[str, Field(max_length=30)]
    author: Author
    year: Annotated[int, Field(ge=1800, le=2025)]
    genres: Annotated[list[Literal["fiction", "science", "history"]], Field(max_length=2)]


class Flags(BaseModel):
    visible: bool
    editable: bool
    archived: bool


class Grid(BaseModel):
    rows: Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0, le=9)]], Field(max_length=3)]],
        Field(max_length=3),
    ]


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: Annotated[int, Field(ge=1, le=10)]


class Square(BaseModel):
    kind: Literal["square"]
    side: Annotated[int, Field(ge=1, le=10)]


class Drawing(BaseModel):
    shape: Circle | Square


MODELS: list[tuple[type[BaseModel], str]] = [
    (Person, "Describe a person."),
    (Order, "Write an order for two items."),
    (Palette, "Pick two colors."),
    (Code, "Make up a product code."),
    (Team, "Describe a small team."),
    (Address, "Write an address."),
    (Event, "Plan a party."),
    (Rating, "Rate a film."),
    (Book, "Describe a book."),
    (Flags, "Set some flags."),
    (Grid, "Make a small grid of digits."),
    (Drawing, "Draw a shape."),
]


@pytest.mark.parametrize(("model", "ask"), MODELS, ids=[m.__name__ for m, _ in MODELS])
def test_parse_returns_objects_that_validate(
    client: openai.OpenAI, model: type[BaseModel], ask: str
) -> None:
    reply = client.chat.completions.parse(
        model=CHAT,
        messages=[{"role": "user", "content": ask}],
        response_format=model,
        max_tokens=200,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)


def test_json_object_output_is_a_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_a_streamed_structured_output_parses(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema()},
        },
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Person.model_validate_json(text)


def test_choice_and_regex_outputs_match(client: openai.OpenAI) -> None:
    choice = client.completions.create(
        model=CHAT,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(
        model=CHAT,
        prompt="A date:",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", regex.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=CHAT,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body=extra,
        )
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param, body


def test_text_format_store_and_user_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        response_format={"type": "text"},
        store=False,
        user="someone",
    )
    assert reply.choices[0].message.content


class Weather(BaseModel):
    city: Annotated[str, Field(max_length=20)]
    unit: Literal["celsius", "fahrenheit"]


class Sum(BaseModel):
    a: Annotated[int, Field(ge=0, le=1000)]
    b: Annotated[int, Field(ge=0, le=1000)]


# The openai client's own helper: strict schemas (no properties beyond the model's).
TOOLS = [
    openai.pydantic_function_tool(Weather, name="get_weather", description="Weather in a city"),
    openai.pydantic_function_tool(Sum, name="add", description="Add two numbers"),
]
ARGUMENTS: dict[str, type[BaseModel]] = {"get_weather": Weather, "add": Sum}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "add"}}],
    ids=["required", "named"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_calls_have_arguments_that_validate(
    client: openai.OpenAI, tool_choice: object, stream: bool
) -> None:
    kwargs: dict[str, object] = {
        "model": CHAT,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 100,
        "temperature": 0,
    }
    if stream:
        calls: dict[int, dict[str, str]] = {}
        reason = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
                entry["name"] += delta_call.function.name or ""
                entry["arguments"] += delta_call.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        reason = reply.choices[0].finish_reason
        got = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    assert reason == "tool_calls" and got
    for name, arguments in got:
        if isinstance(tool_choice, dict):
            assert name == "add"
        ARGUMENTS[name].model_validate_json(arguments)


def test_a_call_its_result_and_the_final_answer(client: openai.OpenAI) -> None:
    called = client.chat.completions.create(
        model=CHAT, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0
    )  # type: ignore[call-overload]
    message = called.choices[0].message
    assert message.tool_calls
    history = [
        *ASK,
        message,
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C, sunny"},
    ]
    answer = client.chat.completions.create(
        model=CHAT, messages=history, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0
    )  # type: ignore[call-overload]
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "array", "uniqueItems": True},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=CHAT, messages=ASK, max_tokens=4, extra_body=extra)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param, body


def test_history_arguments_that_are_not_json_are_a_400(client: openai.OpenAI) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=CHAT, messages=history, max_tokens=4)  # type: ignore[arg-type]
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "messages[1].tool_calls", body
