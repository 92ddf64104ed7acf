"""The agent and app libraries people point at a local server, each as its user would write it, through real
gunicorn on the real SmolLM2-135M-Instruct. SmolLM2's own file template renders no tools: every tool here goes
through the built-in Hermes rendering, and forced calls are held to their schema by the grammar.

instructor 1.17 (jiter<0.15, which holds openai to 3.3) and LlamaIndex (openai<3) cannot share the test extra's
environment with openai-agents (openai>=3): they run in a virtualenv of their own that .ci/run makes
(KRONK_TEST_OLDER_OPENAI_PYTHON), from tests/support/older_openai_clients.py.
"""

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
from pydantic import BaseModel

from .conftest import run_server


class City(BaseModel):
    name: str
    country: str


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM's own price list, not the network's

ASK = "What is the weather in Paris? Use the tool."
CITY = "Name a city in France and its country."


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("libraries"), {"KRONK_MODELS": f"smol={smollm2}"}) as s:
        yield s


# -- LangChain ----------------------------------------------------------------------------------------------------

def test_langchain_bind_tools_on_both_apis(server):
    from langchain_anthropic import ChatAnthropic
    from langchain_openai import ChatOpenAI

    models = [ChatOpenAI(model="smol", base_url=server.url + "/v1", api_key="unused", max_tokens=200, temperature=0),
              ChatAnthropic(model="smol", base_url=server.url, api_key="unused", max_tokens=200, temperature=0)]
    for model in models:
        reply = model.bind_tools([get_weather], tool_choice="get_weather").invoke(ASK)
        assert [call["name"] for call in reply.tool_calls] == ["get_weather"], type(model).__name__
        assert isinstance(reply.tool_calls[0]["args"].get("city"), str)


def test_langchain_structured_output_by_function_calling(server):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(model="smol", base_url=server.url + "/v1", api_key="unused", max_tokens=200, temperature=0)
    city = model.with_structured_output(City, method="function_calling").invoke(CITY)
    assert isinstance(city, City) and city.name


def test_langchain_with_reasoning_and_verbosity(server):
    from langchain_openai import ChatOpenAI

    common = dict(model="smol", base_url=server.url + "/v1", api_key="unused", max_tokens=20, verbosity="low")
    chat = ChatOpenAI(reasoning_effort="low", **common)
    responses = ChatOpenAI(reasoning={"effort": "low", "summary": "auto"}, use_responses_api=True, **common)
    for model in (chat, responses):
        assert model.invoke("Say hello.").text


# -- OpenAI Agents SDK --------------------------------------------------------------------------------------------

def run_agents(server, make_agent, prompt: str) -> list:
    """Run an agent on each model class, Chat Completions and Responses; their final outputs."""
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def run() -> list:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        models = [OpenAIChatCompletionsModel(model="smol", openai_client=client),
                  OpenAIResponsesModel(model="smol", openai_client=client)]
        return [(await Runner.run(make_agent(model), prompt)).final_output for model in models]

    return asyncio.run(run())


def test_openai_agents_call_a_function_tool_on_both_model_classes(server):
    from agents import Agent, ModelSettings, function_tool

    outputs = run_agents(server, lambda model: Agent(
        name="weather", instructions="Answer with the tool.", model=model, tools=[function_tool(get_weather)],
        model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    ), ASK)
    assert len(outputs) == 2 and all(output.startswith("sunny in ") for output in outputs)


def test_openai_agents_with_reasoning_and_verbosity(server):
    from agents import Agent, ModelSettings
    from openai.types.shared import Reasoning

    settings = ModelSettings(reasoning=Reasoning(effort="low", summary="auto"), verbosity="low", max_tokens=200,
                             temperature=0)
    outputs = run_agents(server, lambda model: Agent(name="plain", instructions="Be brief.", model=model,
                                                     model_settings=settings), "Say hello.")
    assert len(outputs) == 2 and all(outputs)


# -- Pydantic AI --------------------------------------------------------------------------------------------------

def test_pydantic_ai_default_structured_output_on_both_apis(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.providers.openai import OpenAIProvider

    models = [OpenAIChatModel("smol", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused")),
              AnthropicModel("smol", provider=AnthropicProvider(base_url=server.url, api_key="unused"))]
    for model in models:
        result = Agent(model, output_type=City).run_sync(CITY, model_settings={"max_tokens": 200, "temperature": 0})
        assert isinstance(result.output, City) and result.output.name, type(model).__name__


# -- LiteLLM ------------------------------------------------------------------------------------------------------

def test_litellm_chat_streaming_and_tools(server):
    import litellm

    common = dict(model="openai/smol", api_base=server.url + "/v1", api_key="unused", max_tokens=30, temperature=0)
    said = litellm.completion(messages=[{"role": "user", "content": "Say hello."}], **common)
    assert said.choices[0].message.content
    parts = litellm.completion(messages=[{"role": "user", "content": "Say hello."}], stream=True, **common)
    assert "".join(part.choices[0].delta.content or "" for part in parts)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
    called = litellm.completion(messages=[{"role": "user", "content": ASK}], tools=[tool], tool_choice="required",
                                **{**common, "max_tokens": 200})
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert any(entry["route"] == "/v1/chat/completions" for entry in server.completed())


# -- instructor and LlamaIndex, in their own environment ----------------------------------------------------------

OLDER_OPENAI = os.environ.get("KRONK_TEST_OLDER_OPENAI_PYTHON")


@pytest.mark.skipif(not OLDER_OPENAI and not os.environ.get("KRONK_TEST_REQUIRE_OLDER_OPENAI"),
                    reason="no virtualenv with instructor and LlamaIndex (KRONK_TEST_OLDER_OPENAI_PYTHON): "
                           ".ci/run makes one")
def test_instructor_tools_and_llama_index_chat_stream_and_tools(server):
    assert OLDER_OPENAI, "KRONK_TEST_OLDER_OPENAI_PYTHON is not set"
    script = Path(__file__).parent / "support" / "older_openai_clients.py"
    ran = subprocess.run([OLDER_OPENAI, str(script), server.url + "/v1", "smol"], capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout)
    assert got["instructor"]["name"] and got["instructor"]["country"]  # TOOLS mode: a forced call, validated
    assert got["llama_index_chat"] and got["llama_index_stream"]
    (call,) = got["llama_index_tools"]
    assert call["name"] == "get_weather" and isinstance(call["arguments"].get("city"), str)
