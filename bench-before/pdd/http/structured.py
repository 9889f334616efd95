"""The request fields that constrain or shape the output: OpenAI's
`response_format` (json_object, json_schema), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`,
and tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, and the
`tool_calls` of assistant messages in the history). Each is checked here with
a 400 naming the field; a schema or grammar that does not compile is refused
here too (pdd.grammar.check), before any worker sees it.
"""
from __future__ import annotations

import json
import re

import orjson

from pdd.api import InvalidRequest, StructuredOutput
from pdd.http.tools import TOOL_CHOICES, ToolFormat, forced_grammar
from pdd.http.validate import Fields, bad, wrong_type

# vLLM's extras and the kind each gives.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# vLLM's newer `structured_outputs` object: its keys and their kinds.
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check(so: StructuredOutput | None, param: str | None) -> None:
    """A 400 naming `param` when the spec does not compile. Compiling a large
    schema takes long (0.15 s for 300 KB, mostly without the GIL): the app runs
    this off its event loop."""
    if so is None:
        return
    from pdd import grammar
    try:
        grammar.check(so)
    except InvalidRequest as e:
        raise bad(param, f"'{param}': {str(e).split(': ', 1)[-1]}") from None


def _shaped(so: StructuredOutput, param: str) -> StructuredOutput:
    try:
        so.validate()
    except InvalidRequest as e:
        raise bad(param, f"'{param}': {str(e).split(': ', 1)[-1]}") from None
    return so


def structured_output(f: Fields) -> tuple[StructuredOutput | None, str | None]:
    """The one constraint the request sets and the field it came from (None,
    None for free text). Its shape is checked here, its compilation by `check`."""
    found = []
    fmt = f.mapping("response_format")
    if fmt is not None:
        so = _response_format(Fields(fmt, prefix="response_format."))
        if so is not None:
            found.append(("response_format", so))
    for name, kind in GUIDED.items():
        value = f.obj.get(name)
        if value is not None and value != "" and value != []:
            found.append((name, StructuredOutput(kind, _spec(name, kind, value))))
    so = f.mapping("structured_outputs")
    if so:
        for key, kind in STRUCTURED_KEYS.items():
            value = so.get(key)
            if value is not None and value is not False:
                param = f"structured_outputs.{key}"
                spec = "" if kind == "json_object" else _spec(param, kind, value)
                found.append((param, StructuredOutput(kind, spec)))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad(found[1][0], "only one of " + ", ".join(f"'{p}'" for p, _ in found) + " may be set")
    param, so = found[0]
    return _shaped(so, param), param


def _response_format(f: Fields) -> StructuredOutput | None:
    kind = f.string("type")
    if kind is None:
        raise bad(f.param("type"), f"'{f.param('type')}' is required")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise bad(f.param("type"), f"'{f.param('type')}' must be one of text, json_object, json_schema; "
                                   f"got {kind!r}")
    spec = f.mapping("json_schema")
    if spec is None:
        raise bad(f.param("json_schema"), f"'{f.param('json_schema')}' is required with type json_schema")
    sf = Fields(spec, prefix=f.param("json_schema."))
    if sf.string("name") is None:
        raise bad(sf.param("name"), f"'{sf.param('name')}' is required")
    sf.boolean("strict")   # strict or not: held to the schema, its objects closed (pdd.closed_schema)
    schema = sf.mapping("schema")
    if schema is None:   # OpenAI allows none: any JSON object
        return StructuredOutput("json_object")
    return StructuredOutput("json_schema", _schema_text(sf.param("schema"), schema))


def _schema_text(param: str, schema: dict) -> str:
    """The schema as the text a StructuredOutput carries."""
    try:
        return json.dumps(schema)
    except RecursionError:   # the body parser allows deeper nesting than the encoder
        raise bad(param, f"'{param}': the schema is nested too deep") from None


def _spec(param: str, kind: str, value) -> str:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                raise bad(param, f"'{param}': the schema is nested too deep") from None
            except ValueError as e:
                raise bad(param, f"'{param}': not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise wrong_type(param, "a JSON schema object", value)
        return _schema_text(param, value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(param, f"'{param}' must be a non-empty array of non-empty strings")
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise wrong_type(param, "a non-empty string", value)
    return value


# ---------------------------------------------------------------- tools

def tools(f: Fields) -> tuple[list[dict] | None, object, bool]:
    """(tools, tool_choice, parallel_tool_calls), checked. tool_choice: "none",
    "auto", "required" or {"type": "function", "function": {"name": ...}} (a
    function of `tools`); without tools only "none" and "auto" (both: text)."""
    value = f.array("tools")
    listed = [_tool(t, f"tools[{i}]") for i, t in enumerate(value)] if value else None
    if listed:
        names = [t["function"]["name"] for t in listed]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise bad("tools", f"'tools': the function name '{dup}' is given more than once")
    choice = f.obj.get("tool_choice")
    if choice is None:
        choice = "auto" if listed else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad("tool_choice", f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or a named "
                                     f"function, got {choice!r}")
        if choice == "required" and not listed:
            raise bad("tool_choice", "'tool_choice' \"required\" needs 'tools'")
    elif isinstance(choice, dict):
        cf = Fields(choice, prefix="tool_choice.")
        if cf.string("type", "function") != "function":
            raise bad(cf.param("type"), f"'{cf.param('type')}' must be \"function\"")
        fn = cf.mapping("function")
        name = Fields(fn, prefix="tool_choice.function.").string("name") if fn is not None else None
        if name is None:
            raise bad("tool_choice.function.name", "'tool_choice.function.name' is required")
        if not listed or name not in [t["function"]["name"] for t in listed]:
            raise bad("tool_choice", f"'tool_choice' names the function '{name}', which is not in 'tools'")
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise wrong_type("tool_choice", "a string or an object", choice)
    parallel = f.boolean("parallel_tool_calls", True)
    return listed, choice, parallel


def _function_fields(obj, param: str) -> tuple[Fields, Fields]:
    """The fields of `obj` and of its "function", once `obj` is checked to be {"type": "function", "function": {...}}
    (a tool, or a call in an assistant's history)."""
    if not isinstance(obj, dict):
        raise wrong_type(param, "an object", obj)
    of = Fields(obj, prefix=param + ".")
    if of.string("type", "function") != "function":
        raise bad(of.param("type"), f"'{of.param('type')}' must be \"function\"")
    fn = of.mapping("function")
    if fn is None:
        raise bad(of.param("function"), f"'{of.param('function')}' is required")
    return of, Fields(fn, prefix=param + ".function.")


def _tool(t, param: str) -> dict:
    _, ff = _function_fields(t, param)
    name = ff.string("name")
    if name is None or not FUNCTION_NAME.fullmatch(name):
        raise bad(ff.param("name"), f"'{ff.param('name')}' must be 1 to 64 letters, digits, '_', '.' or '-'")
    out = {"name": name}
    description = ff.string("description")
    if description is not None:
        out["description"] = description
    params = ff.mapping("parameters")
    if params is not None:
        out["parameters"] = params
    strict = ff.boolean("strict")
    if strict is not None:
        out["strict"] = strict
    return {"type": "function", "function": out}


def tool_grammar(fmt: ToolFormat, listed: list[dict], choice, parallel: bool) -> StructuredOutput:
    """The grammar that forces a call ("required" or a named function); `check`
    refuses it naming 'tools' when a function's parameters are no valid schema."""
    return _shaped(forced_grammar(fmt, listed, choice, parallel), "tools")


def history_tool_calls(value, param: str) -> list[dict]:
    """An assistant message's tool_calls, as chat templates take them: the
    arguments as an object when they are a JSON object (as transformers'
    templates expect), else the string as given."""
    if not isinstance(value, list):
        raise wrong_type(param, "an array", value)
    out = []
    for i, call in enumerate(value):
        p = f"{param}[{i}]"
        cf, ff = _function_fields(call, p)
        name, arguments = ff.string("name"), ff.string("arguments")
        if name is None or arguments is None:
            missing = "name" if name is None else "arguments"
            raise bad(ff.param(missing), f"'{ff.param(missing)}' is required")
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            parsed = None
        entry = {"type": "function", "function": {"name": name,
                                                  "arguments": parsed if isinstance(parsed, dict) else arguments}}
        call_id = cf.string("id")
        if call_id is not None:
            entry["id"] = call_id
        out.append(entry)
    return out
