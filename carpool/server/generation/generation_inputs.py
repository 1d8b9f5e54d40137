"""From an OpenAI request to what the engine takes: the conversation rendered with
the model's chat template (tools offered in its system message), prompts tokenized
within the context bound, and ``SamplingParams`` (with the grammar compiled before
the request is queued). The rendering and tokenizing run on the pre-processing pool.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.admission import per_request, refuse_oversized
from carpool.engine.async_engine import HALF, GenerationStream
from carpool.engine.sampling_params import Grammar, SamplingParams
from carpool.errors import InvalidRequest
from carpool.server.generation.schemas import (
    GUIDED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    SamplingFields,
)
from carpool.server.generation.tools import (
    HERMES,
    ToolSpec,
    calls_as_content,
    chosen_tools,
    hermes_history,
    template_format,
    tool_grammar,
    tools_prompt,
    with_tools_prompt,
)
from carpool.server.registry.preprocess import Keep, TooManyTokens, encode_within
from carpool.server.registry.served import ServedGenerator, ServedModels


def detokenize_ids(served: ServedGenerator, ids: list[int]) -> str:
    """The text of ``ids``, each checked against the vocabulary. Runs on the
    pre-processing pool."""
    vocab = served.lm.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"token ids must be in [0, {vocab})", param="tokens")
    return served.tokenizer.decode(ids)


@dataclass(frozen=True)
class OfferedTools:
    """The tools a chat request lets the model call, and how."""

    tools: list[ToolSpec]
    required: bool
    parallel: bool
    form: str  # how the model writes calls: tools.HERMES or tools.GENERIC


@dataclass(frozen=True)
class PreparedChat:
    """A chat request made ready for the engine: its prompt's token ids, its sampling
    parameters (grammar compiled), and the form its replies are read in when tools
    were offered (None: plain text)."""

    served: ServedGenerator
    prompt: list[int]
    params: SamplingParams
    tool_form: str | None

    @property
    def reasoning(self) -> str | None:
        """The reasoning parser that splits the reply's thinking off, if any: the
        model's, unless a grammar constrains the reply from its first token."""
        return self.served.reasoning_parser if self.params.grammar is None else None

    def start(self, body: SamplingFields) -> GenerationStream:
        """The engine stream of this chat (one prompt)."""
        return self.served.engine.start_many(
            [self.prompt],
            [self.params],
            priority=body.priority,
            timeout_s=self.served.timeout(body.timeout),
        )[0]


async def prepare_chat(models: ServedModels, body: ChatCompletionRequest) -> PreparedChat:
    """The one path from a chat request to the engine's input: the conversation
    rendered (tools offered), tokenized and its grammar compiled on the pre-processing
    pool. Chat completions, Responses and Messages all come through here."""
    served = models.generator(body.model)
    offered = offered_tools(served, body)
    prompt = await models.preprocess.run(
        chat_prompt, served, body.messages, body.add_generation_prompt, body, offered
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    grammar = await compile_grammar(models, served, body, offered)
    params = sampling_params(served, body, len(prompt), max_tokens, logprobs, grammar=grammar)
    return PreparedChat(served, prompt, params, None if offered is None else offered.form)


def tool_form(served: ServedGenerator) -> str:
    """How ``served``'s chat template writes tool calls (``tools.template_format``)."""
    return template_format(getattr(served.tokenizer, "chat_template", None))


def offered_tools(served: ServedGenerator, body: ChatCompletionRequest) -> OfferedTools | None:
    """The tools ``body`` offers (None: none, or ``tool_choice: none``)."""
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice != "none":
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    specs = [
        ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in body.tools
    ]
    if len({t.name for t in specs}) != len(specs):
        raise InvalidRequest("tools must have distinct names", param="tools")
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    plain = None if isinstance(choice, NamedToolChoice) else choice
    tools, required = chosen_tools(specs, plain, named)
    if not tools:
        return None
    text = body.response_format is None or body.response_format.type == "text"
    if not text or body.structured_outputs is not None:
        raise InvalidRequest(
            "response_format and structured_outputs cannot be combined with tools",
            param="response_format",
        )
    # A named choice is one call of that function (OpenAI's meaning), parallel or not.
    parallel = body.parallel_tool_calls and named is None
    return OfferedTools(tools, required, parallel, tool_form(served))


def chat_prompt(
    served: ServedGenerator,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    body: SamplingFields | None,
    offered: OfferedTools | None = None,
) -> list[int]:
    """The conversation rendered with the model's own chat template, as token ids
    (``body``: the request whose ``truncate_prompt_tokens`` applies; ``offered``:
    tools described in the system message). Runs on the pre-processing pool."""
    extra = template_switches(served, body) if isinstance(body, ChatCompletionRequest) else None
    text = render_chat(served, messages, add_generation_prompt, offered, extra)
    return encode_prompts(served, [text], body, add_special_tokens=False)[0]


def template_switches(served: ServedGenerator, body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's variables for ``body``: OpenAI's ``reasoning_effort`` and
    ``verbosity`` as the template's own switches where it has one (a template that
    reads ``reasoning_effort`` gets it; one with Qwen3's ``enable_thinking`` thinks
    unless the effort is ``none``), then the request's ``chat_template_kwargs``,
    which win."""
    template = getattr(served.tokenizer, "chat_template", None) or ""
    switches: dict[str, Any] = {}
    effort = body.reasoning_effort
    if effort is not None and "reasoning_effort" in template:
        switches["reasoning_effort"] = effort
    elif effort is not None and "enable_thinking" in template:
        switches["enable_thinking"] = effort != "none"
    if body.verbosity is not None and "verbosity" in template:
        switches["verbosity"] = body.verbosity
    return {**switches, **(body.chat_template_kwargs or {})}


def render_chat(
    served: ServedGenerator,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    offered: OfferedTools | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation rendered with the model's own chat template. A template that
    knows tools gets them and the history's calls in its own terms; for any other,
    the tools are offered in the system message and past calls are written in the
    generic wrapper's JSON (``carpool.server.generation.tools``). ``template_kwargs``: the
    request's extra template variables (``chat_template_kwargs``)."""
    hermes = tool_form(served) == HERMES
    plain = [_plain(i, m, hermes) for i, m in enumerate(messages)]
    taken = set(template_kwargs or ()) & _TEMPLATE_ARGUMENTS
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(sorted(taken))}",
            param="chat_template_kwargs",
        )
    extra: dict[str, Any] = dict(template_kwargs or {})
    if offered is not None and hermes:
        extra["tools"] = [_template_tool(t) for t in offered.tools]
    elif offered is not None:
        plain = with_tools_prompt(plain, tools_prompt(offered.tools, offered.required))
    try:
        text: str = served.tokenizer.apply_chat_template(
            plain, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as exc:  # a template may raise on a conversation it rejects
        raise InvalidRequest(
            f"the chat template refused messages: {exc}", param="messages"
        ) from exc
    return text


# What apply_chat_template itself takes: a request's template variables may not set it.
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)


def _plain(i: int, m: ChatMessage, hermes: bool) -> dict[str, Any]:
    """Message ``i`` as chat templates take it: text content; past tool calls in the
    template's terms (``hermes``) or in the generic wrapper's JSON."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    "only text content parts are supported", param=f"messages[{i}].content"
                )
            texts.append(part["text"])
        content = "".join(texts)
    message: dict[str, Any] = {"role": m.role, "content": content or ""}
    thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if thinking is not None:
        message["reasoning_content"] = thinking
    if m.tool_calls:
        calls = [c.model_dump() for c in m.tool_calls]
        where = f"messages[{i}].tool_calls"
        if hermes:
            message["tool_calls"] = hermes_history(calls, where)
        else:
            message["content"] = calls_as_content(calls, where)
    return message


def _template_tool(tool: ToolSpec) -> dict[str, Any]:
    """A tool as chat templates take it (OpenAI's shape)."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.parameters or {"type": "object"},
        },
    }


async def prompt_token_ids(
    models: ServedModels,
    served: ServedGenerator,
    prompt: str | list[str] | list[int] | list[list[int]],
    body: SamplingFields,
) -> list[list[int]]:
    """Each prompt's token ids: texts tokenized on the pre-processing pool, token ids
    taken on the event loop (a copy: the hop to the pool and back cost a request 2.7
    ms at the median, 13 at the 90th percentile, with 64 streams on two cores)."""
    texts = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], str))
    if texts:
        return await models.preprocess.run(tokenize_prompts, served, prompt, body)
    return tokenize_prompts(served, prompt, body)


def tokenize_prompts(
    served: ServedGenerator,
    prompt: str | list[str] | list[int] | list[list[int]],
    body: SamplingFields,
) -> list[list[int]]:
    """Each prompt's token ids (texts tokenized within the context bound)."""
    if isinstance(prompt, str):
        return encode_prompts(served, [prompt], body)
    if not prompt:
        raise InvalidRequest("prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return encode_prompts(served, prompt, body)
    return [list(p) for p in prompt]


def encode_prompts(
    served: ServedGenerator,
    texts: list[str],
    body: SamplingFields | None,
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """Token ids of each text; a text certainly over the context (or, with
    ``truncate_prompt_tokens``, its kept tail) is judged without tokenizing it all."""
    truncate = None if body is None else body.truncate_prompt_tokens
    keep: Keep = "all" if truncate is None else "tail"
    limit = served.max_model_len if truncate is None else truncate
    try:
        return encode_within(
            lambda ts: served.encode_batch(ts, add_special_tokens),
            texts,
            limit,
            keep,
            served.token_chars,
        )
    except TooManyTokens as exc:
        raise InvalidRequest(
            f"this model's maximum context length is {served.max_model_len} tokens; "
            f"the prompt has more",
            param="prompt" if len(texts) == 1 else f"prompt[{exc.index}]",
        ) from None


def check_prompt_count(served: ServedGenerator, count: int, param: str = "prompt") -> None:
    """Refuse (413), before tokenizing, a call with more prompts than one request
    may bring (``param``: the field that holds them)."""
    max_waiting = served.engine.max_waiting
    if max_waiting is not None:
        taker = f"model {served.name!r}"
        refuse_oversized(
            count, per_request(max_waiting), what="prompts", taker=taker, param=param, why=HALF
        )


def requested_grammar(body: SamplingFields) -> tuple[Grammar, str] | None:
    """The grammar ``body`` asks its output to match, and the field that asked:
    OpenAI's ``response_format`` (``text`` asks nothing) or vLLM's
    ``structured_outputs``."""
    if body.response_format is not None and body.structured_outputs is not None:
        raise InvalidRequest(
            "give response_format or structured_outputs, not both", param="structured_outputs"
        )
    so = body.structured_outputs
    # vLLM's guided_* fields arrive as structured_outputs; an error names the one sent.
    asked_by = _guided_field(body) or "structured_outputs"
    if so is not None:
        given = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
        }
        named = [k for k, v in given.items() if v is not None]
        if len(named) != 1:
            raise InvalidRequest(
                "structured_outputs needs exactly one of json, regex, choice and grammar",
                param=asked_by,
            )
        if so.json_ is not None:
            schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
            return Grammar("json_schema", schema), asked_by
        if so.regex is not None:
            return Grammar("regex", so.regex), asked_by
        if so.choice is not None:
            distinct = list(dict.fromkeys(so.choice))  # a repeated choice adds nothing
            return Grammar("choice", json.dumps(distinct)), asked_by
        return Grammar("lark", str(so.grammar)), asked_by
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Grammar("json_schema", '{"type": "object"}'), "response_format"
    if rf.type == "structural_tag":
        tags = {
            "structures": [s.model_dump(by_alias=True) for s in rf.structures],
            "triggers": rf.triggers,
        }
        return Grammar("structural_tag", json.dumps(tags)), "response_format"
    schema_ = rf.json_schema.schema_ if rf.type == "json_schema" else None
    return Grammar("json_schema", json.dumps(schema_ or {"type": "object"})), "response_format"


async def compile_grammar(
    models: ServedModels,
    served: ServedGenerator,
    body: SamplingFields,
    offered: OfferedTools | None = None,
) -> Grammar | None:
    """The request's grammar (the tool wrapper's when tools are offered), compiled (or
    found cached) on the pre-processing pool before the request is queued; a grammar
    that does not compile is a 400."""
    if offered is not None:
        grammar = tool_grammar(offered.tools, offered.required, offered.parallel, offered.form)
        asked: tuple[Grammar, str] | None = None if grammar is None else (grammar, "tools")
    else:
        asked = requested_grammar(body)
    if asked is None:
        return None
    compiled, param = asked
    await models.preprocess.run(served.compile_grammar, compiled, param)
    return compiled


def _guided_field(body: SamplingFields) -> str | None:
    """The vLLM ``guided_*`` field ``body`` sent, if any."""
    return next((f for f in GUIDED_FIELDS.values() if getattr(body, f) is not None), None)


def logit_bias(body: SamplingFields) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as strings) as (id, bias) pairs."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise InvalidRequest(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            )
        pairs.append((int(key), bias))
    return tuple(pairs)


def sampling_params(
    served: ServedGenerator,
    body: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: Grammar | None = None,
) -> SamplingParams:
    model = served.generation_defaults  # for fields left unset (--generation-config)

    def given(value: Any, field: str, default: Any) -> Any:
        return model.get(field, default) if value is None else value

    if max_tokens is None:  # the model's default, else vLLM's: what the context has left
        room = max(1, served.max_model_len - prompt_len)
        max_tokens = min(room, model.get("max_tokens", room))
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=given(body.temperature, "temperature", 1.0),
        top_p=given(body.top_p, "top_p", 1.0),
        top_k=given(body.top_k, "top_k", 0),
        min_p=given(body.min_p, "min_p", 0.0),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=given(body.repetition_penalty, "repetition_penalty", 1.0),
        seed=body.seed,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        logit_bias=logit_bias(body),
        grammar=grammar,
    )
