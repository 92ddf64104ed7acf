"""instructor and LlamaIndex as their users write them, run in a virtualenv of their own (their openai SDK is older
than the test extra's): ``python older_openai_clients.py BASE_URL MODEL`` prints what each got, as JSON."""

import json
import sys

import instructor
import openai
import pydantic
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike


class City(pydantic.BaseModel):
    name: str
    country: str


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


def main(base_url: str, model: str) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused"), mode=instructor.Mode.TOOLS)
    city = client.chat.completions.create(model=model, response_model=City, max_retries=1, max_tokens=100,
                                          temperature=0,
                                          messages=[{"role": "user", "content": "Name a city in France."}])
    llm = OpenAILike(model=model, api_base=base_url, api_key="unused", is_chat_model=True,
                     is_function_calling_model=True, max_tokens=100, temperature=0, context_window=2048)
    chat = llm.chat([ChatMessage(role="user", content="Say hello.")])
    streamed = "".join(piece.delta or "" for piece in llm.stream_chat([ChatMessage(role="user", content="Hi!")]))
    tool = FunctionTool.from_defaults(fn=get_weather)
    called = llm.chat_with_tools([tool], user_msg="What is the weather in Paris?", tool_required=True)
    calls = llm.get_tool_calls_from_response(called, error_on_no_tool_call=True)
    print(json.dumps({
        "instructor": city.model_dump(), "llama_index_chat": chat.message.content, "llama_index_stream": streamed,
        "llama_index_tools": [{"name": c.tool_name, "arguments": c.tool_kwargs} for c in calls],
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
