"""A chat template that knows tools (Hermes syntax) gets them in its own terms: the
tools and the history's calls go to the template, and a tiny random model's
constrained reply is read back into OpenAI tool calls whose arguments validate."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from carpool.config import EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.models.causal_lm import load_causal_lm
from carpool.server.generation.generation_inputs import OfferedTools, render_chat
from carpool.server.generation.reply_reader import (
    ArgumentsDelta,
    CallStarted,
    ReplyReader,
    TextDelta,
)
from carpool.server.generation.schemas import ChatMessage
from carpool.server.generation.tools import HERMES, ToolSpec, template_format, tool_grammar
from carpool.workers.factory import engine_for
from tests import tiny_models

# The Hermes / Qwen2.5 shape, cut down to what the test needs.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

PICK = ToolSpec(
    "pick",
    "Pick a colour",
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["colour", "count"],
        "additionalProperties": False,
    },
)


@pytest.fixture(scope="module")
def hermes_folder(tmp_path_factory: pytest.TempPathFactory, smollm_folder: Path) -> Path:
    folder = tmp_path_factory.mktemp("tiny-hermes")
    # The whole vocabulary: llguidance forces a literal's canonical tokens ("tool").
    tiny_models.build("llama", folder, smollm_folder, vocab=49152)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_template_gets_the_tools_and_the_calls_in_its_own_syntax(hermes_folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(hermes_folder))
    assert template_format(tokenizer.chat_template) == HERMES
    served: Any = SimpleNamespace(tokenizer=tokenizer)
    history = [
        ChatMessage(role="user", content="Pick one."),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "pick", "arguments": '{"colour": "red", "count": 2}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", tool_call_id="call_1", content="done"),
    ]
    text = render_chat(served, history, True, OfferedTools([PICK], False, True, HERMES))
    assert '"name": "pick"' in text.split("</tools>")[0]  # the tool, from the template
    assert '<tool_call>\n{"name": "pick", "arguments": {"colour": "red", "count": 2}}' in text
    assert "<tool_response>done</tool_response>" in text
    assert "tool_calls" not in text  # not the generic wrapper


def test_a_required_call_comes_back_in_the_template_syntax_and_validates(
    hermes_folder: Path,
) -> None:
    lm = load_causal_lm(hermes_folder, progress=False)
    engine = engine_for(lm, EngineConfig(kv_cache_memory="16MiB"))
    grammar = tool_grammar([PICK], required=True, parallel=False, form=HERMES)
    assert grammar is not None
    assert tool_grammar([PICK], required=False, parallel=True, form=HERMES) is None  # auto: free
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=64, seed=3, grammar=grammar))
    final = None
    reader, events = ReplyReader(HERMES), []  # read as a stream reads it, step by step
    while engine.has_work:
        for out in engine.step():
            events += reader.feed(out.outputs[0].new_text)
            final = out if out.finished else final
    events += reader.finish()
    assert final is not None
    text = final.outputs[0].text
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    assert len(reader.complete_calls()) == 1
    arguments = json.loads(reader.complete_calls()[0].arguments)
    assert arguments["colour"] in ("red", "green") and 1 <= arguments["count"] <= 9
    # Streamed: the call's name first, then its arguments in pieces that join to them.
    assert isinstance(events[0], CallStarted) and events[0].name == "pick"
    pieces = [e.text for e in events if isinstance(e, ArgumentsDelta)]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == arguments
    assert not [e for e in events if isinstance(e, TextDelta) and e.text.strip()]
