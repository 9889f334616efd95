"""What the agent frameworks do against a running pdd (run by scripts/bench-agents
with the frameworks' own virtualenv): each framework found is asked what its users
ask first — text, a structured answer (its own way of getting one: a forced tool
call, a JSON schema), a named tool call — through its own client code, and each
check prints one line, ok or what failed. A model's words are not judged (pdd's
tiny model has random weights): what is checked is what the framework makes of
pdd's answers — a parsed object, a call with arguments, text without an error.

    python agent_checks.py URL MODEL        (exit status: the checks that failed)
"""
# (No `from __future__ import annotations`: the frameworks build tool schemas
# from the annotations of get_weather, which they read as objects.)
import asyncio
import importlib.util
import json
import os
import sys
import traceback
from typing import Literal

URL, MODEL = sys.argv[1].rstrip("/"), sys.argv[2]
BASE = URL + "/v1"
KEY = os.environ.get("PDD_API_KEY") or "none"   # the bearer key, when the API asks for one
# Room for a whole forced call or structured answer (the tiny tokenizer spends ~30
# tokens on a call's name): a cut one is the model's fault, not the framework's.
CALL_TOKENS = 160


def weather_model():
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Oslo"]
        sky: Literal["sunny", "rainy"]
    return Weather


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}


def langchain_checks():
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=MODEL, base_url=BASE, api_key=KEY, temperature=0, max_tokens=CALL_TOKENS, max_retries=0)
    yield "invoke: text", isinstance(llm.invoke("Say hi").content, str)
    Weather = weather_model()
    for method in ("function_calling", "json_schema"):
        out = llm.with_structured_output(Weather, method=method).invoke("The weather in Paris?")
        yield f"with_structured_output(method={method!r})", isinstance(out, Weather)

    msg = llm.bind_tools([tool(get_weather)], tool_choice="get_weather").invoke("Weather in Paris?")
    yield "bind_tools, a named tool_choice", len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_weather"


def litellm_checks():
    import litellm
    kw = {"model": f"hosted_vllm/{MODEL}", "api_base": BASE, "api_key": KEY, "max_tokens": CALL_TOKENS,
          "temperature": 0}
    out = litellm.completion(messages=[{"role": "user", "content": "Say hi"}], **kw)
    yield "completion: text", isinstance(out.choices[0].message.content, str)
    for stream in (False, True):
        resp = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                  stream=stream, **kw)
        if stream:
            args = "".join(c.choices[0].delta.tool_calls[0].function.arguments or ""
                           for c in resp if c.choices and c.choices[0].delta.tool_calls)
        else:
            args = resp.choices[0].message.tool_calls[0].function.arguments
        yield f"a named tool call{', streamed' if stream else ''}: its arguments parse", \
            json.loads(args)["city"] in ("Paris", "Oslo")


def instructor_checks():
    import instructor
    import openai
    Weather = weather_model()
    for mode in ("TOOLS", "JSON_SCHEMA"):   # (Mode.JSON asks for any object: random weights never close one)
        client = instructor.from_openai(openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0),
                                        mode=getattr(instructor.Mode, mode))
        out = client.chat.completions.create(model=MODEL, response_model=Weather, max_tokens=CALL_TOKENS, max_retries=0,
                                             messages=[{"role": "user", "content": "The weather in Paris?"}])
        yield f"response_model, Mode.{mode}", isinstance(out, Weather)


def pydantic_ai_checks():
    from pydantic_ai import Agent
    from pydantic_ai.providers.openai import OpenAIProvider
    try:
        from pydantic_ai.models.openai import OpenAIChatModel as ChatModel
    except ImportError:   # an older pydantic-ai
        from pydantic_ai.models.openai import OpenAIModel as ChatModel
    model = ChatModel(MODEL, provider=OpenAIProvider(base_url=BASE, api_key=KEY))
    settings = {"max_tokens": CALL_TOKENS, "temperature": 0}
    text = Agent(model, model_settings=settings).run_sync("Say hi").output
    yield "Agent: text", isinstance(text, str)
    Weather = weather_model()
    out = Agent(model, output_type=Weather, model_settings=settings).run_sync("The weather in Paris?").output
    yield "Agent(output_type=...): a parsed output", isinstance(out, Weather)


def openai_agents_checks():
    import openai
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner
    from agents import set_tracing_disabled
    set_tracing_disabled(True)   # it would send traces to OpenAI
    settings = ModelSettings(max_tokens=CALL_TOKENS, temperature=0)
    Weather = weather_model()

    async def run(kind):   # a client per event loop (asyncio.run makes a new one)
        client = openai.AsyncOpenAI(base_url=BASE, api_key=KEY, max_retries=0)
        model = kind(model=MODEL, openai_client=client)
        # A structured output: free text from random weights never ends, and an agent takes a
        # response cut by max_tokens for the model's fault.
        agent = Agent(name="brief", instructions="Answer briefly.", model=model, model_settings=settings,
                      output_type=Weather)
        return (await Runner.run(agent, "The weather in Paris?")).final_output
    for name, kind in (("Responses API", OpenAIResponsesModel), ("chat completions", OpenAIChatCompletionsModel)):
        yield f"Runner.run over the {name}: a parsed output", isinstance(asyncio.run(run(kind)), Weather)


def get_weather(city: Literal["Paris", "Oslo"]) -> str:   # (a free string from random weights never ends)
    """The weather in a city."""
    return "sunny"


def llama_index_checks():
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike
    llm = OpenAILike(model=MODEL, api_base=BASE, api_key=KEY, is_chat_model=True, is_function_calling_model=True,
                     max_tokens=CALL_TOKENS, temperature=0, max_retries=0)
    text = llm.chat([ChatMessage(role="user", content="Say hi")]).message.content
    yield "OpenAILike chat: text", isinstance(text, str)
    Weather = weather_model()
    out = llm.structured_predict(Weather, PromptTemplate("The weather in {city}?"), city="Paris")
    yield "structured_predict (a function call)", isinstance(out, Weather)
    reply = llm.chat_with_tools([FunctionTool.from_defaults(fn=get_weather)], user_msg="Weather in Paris?",
                                tool_required=True)
    calls = llm.get_tool_calls_from_response(reply, error_on_no_tool_call=False)
    yield "chat_with_tools(tool_required=True)", bool(calls) and calls[0].tool_name == "get_weather"


def dspy_checks():
    import dspy
    from dspy._vendor.lm15.features import AccessPolicy
    from dspy.lm15 import ModelSupport, ProviderDefinition, register_provider
    # dspy sends response_format and tools only to a model its metadata says
    # takes them: a self-hosted one is declared, as a provider speaking vLLM's
    # chat wire (its preset's address; the LM's api_base is where it goes).
    register_provider(ProviderDefinition.chat(AccessPolicy(provider="pdd", env_keys=("PDD_API_KEY",),
                                                           base_url="http://localhost:8000/v1"), compat="vllm"),
                      supports=ModelSupport(function_calling=True, response_schema=True))
    lm = dspy.LM(f"pdd/{MODEL}", api_base=BASE, api_key=KEY, max_tokens=CALL_TOKENS, temperature=0,
                 cache=False, num_retries=0)
    yield "LM: text", isinstance(lm("Say hi")[0], str)

    class Sky(dspy.Signature):
        """The weather in a city."""
        city: str = dspy.InputField()
        sky: Literal["sunny", "rainy"] = dspy.OutputField()
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        out = dspy.Predict(Sky)(city="Paris")
    yield "Predict with JSONAdapter (a structured answer)", out.sky in ("sunny", "rainy")

    class Call(dspy.Signature):
        """Call the tool for the weather in the city."""
        city: str = dspy.InputField()
        tools: list[dspy.Tool] = dspy.InputField()
        calls: dspy.ToolCalls = dspy.OutputField()
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter(use_native_function_calling=True)):
        got = dspy.Predict(Call)(city="Paris", tools=[dspy.Tool(get_weather)],
                                 config={"tool_choice": "required"})
    yield "native function calling (tool_choice required)", \
        bool(got.calls.tool_calls) and got.calls.tool_calls[0].name == "get_weather"


FRAMEWORKS = {"langchain-openai": ("langchain_openai", langchain_checks), "litellm": ("litellm", litellm_checks),
              "instructor": ("instructor", instructor_checks), "pydantic-ai": ("pydantic_ai", pydantic_ai_checks),
              "openai-agents": ("agents", openai_agents_checks), "llama-index": ("llama_index.llms.openai_like",
                                                                                  llama_index_checks),
              "dspy": ("dspy", dspy_checks)}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:   # a dotted name whose package is missing
        return False


def main() -> int:
    failed = 0
    for name, (module, checks) in FRAMEWORKS.items():
        if not installed(module):
            print(f"{name}: not installed")
            continue
        try:
            for what, ok in checks():
                print(f"{name}: {what}: {'ok' if ok else 'FAILED'}", flush=True)
                failed += not ok
        except Exception as e:   # noqa: BLE001 -- a framework's failure is this check's result
            failed += 1
            print(f"{name}: FAILED with {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3, file=sys.stderr)
    return failed


if __name__ == "__main__":
    sys.exit(main())
