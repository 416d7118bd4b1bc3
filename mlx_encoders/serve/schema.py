"""Request models declared once, as `TypedDict`s whose fields are `Annotated[type, "description"]`: a handler
takes one with `@accepts(Model)`, `fields(body, Model)` refuses the fields it does not declare, and `openapi`
turns every route and its model into the OpenAPI 3.1 document served at /openapi.json (and read by /docs)."""

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

from .errors import ApiError

SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
# fields several protocols share
ModelName = Annotated[str, "the served model; default: the only one able to answer"]
Truncate = Annotated[bool | None, "cut an over-long input to the model's length (default: --auto-truncate)"]
OutputType = Literal["float", "int8", "uint8", "binary", "ubinary"]


def accepts(model: type) -> Callable:
    """Mark a handler as taking a JSON body of `model` (read by `openapi`)."""

    def mark(handler: Callable) -> Callable:
        handler.request_model = model
        return handler

    return mark


@functools.cache
def declared(model: type) -> tuple[str, ...]:
    """The fields a request model declares (its type hints, evaluated once: per request they cost a parse)."""
    return tuple(get_type_hints(model))


def fields(body: dict, model: type) -> dict:
    """`body`, unless it holds a field `model` does not declare (400 naming it and the declared ones): a field this
    server does not know could change the answer a client expects, so it is refused rather than ignored."""
    known = declared(model)
    unknown = [key for key in body if key not in known]
    if unknown:
        raise ApiError(
            400, f"unknown field {unknown[0]!r}{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; "
            f"this route takes {', '.join(known)}", unknown[0], "unknown_field",
        )  # fmt: skip
    return body


def json_schema(kind: Any) -> dict:
    """The JSON Schema of a type annotation: scalars, None, list, dict, unions, Literal, TypedDict, Annotated."""
    origin, args = get_origin(kind), get_args(kind)
    if origin is Annotated:
        return {**json_schema(args[0]), "description": args[1]}
    if origin in (typing.Required, typing.NotRequired):
        return json_schema(args[0])
    if kind in SCALARS:
        return {"type": SCALARS[kind]}
    if kind is Any:
        return {}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (Union, types.UnionType):
        return {"anyOf": [json_schema(a) for a in args]}
    if origin is list:
        return {"type": "array", "items": json_schema(args[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": json_schema(args[1])}
    if is_typeddict(kind):
        hints = get_type_hints(kind, include_extras=True)
        schema = {"type": "object", "properties": {k: json_schema(v) for k, v in hints.items()}}
        schema["required"] = [k for k in hints if k in kind.__required_keys__]
        schema["additionalProperties"] = False
        return schema
    raise TypeError(f"no JSON Schema for the annotation {kind!r}")


def openapi_path(path: str) -> str:
    """A route's path as OpenAPI writes its template: `{model:path}` (Starlette's converter) as `{model}`."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


def openapi(routes: dict, title: str, version: str) -> dict:
    """OpenAPI 3.1 of `routes` (path -> Endpoint): per method the handler's docstring and, for a handler marked
    with `accepts`, its request body's schema."""
    paths = {}
    for path, route in routes.items():
        summary = (inspect.getdoc(route.handler) or path).split("\n\n")[0].replace("\n", " ")
        model = getattr(route.handler, "request_model", None)
        operations = {}
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in re.findall(r"\{(\w+)", path)
        ]
        for method in route.methods:
            operation = {"summary": summary, "responses": {"200": {"description": "the answer"}}}
            if parameters:
                operation["parameters"] = parameters
            if method == "POST":
                body = json_schema(model) if model is not None else {"type": "object"}
                operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
            operations[method.lower()] = operation
        paths[openapi_path(path)] = operations
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths}


# /docs: the schema rendered in the browser by a page that needs nothing from the network
DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>mlx-encoders serve: API</title>
<style>body{font:15px system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em}code{font-size:13px}
h2{font-size:17px;margin:1.6em 0 .3em}table{border-collapse:collapse}td{border-top:1px solid #ddd;padding:.2em .6em;
vertical-align:top}</style></head>
<body><h1>mlx-encoders serve</h1><p>Every route and its request fields, from <a href="openapi.json">openapi.json</a>.
</p><div id="routes"></div>
<script>
const text = (s) => document.createTextNode(s);
const kind = (s) => s.enum ? s.enum.map(JSON.stringify).join(" | ") : s.anyOf ? s.anyOf.map(kind).join(" | ")
  : s.type === "array" ? kind(s.items) + "[]" : s.type || "any";
fetch("openapi.json").then((r) => r.json()).then((doc) => {
  const out = document.getElementById("routes");
  for (const [path, methods] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      const h = document.createElement("h2");
      h.append(text(method.toUpperCase() + " " + path));
      const p = document.createElement("p");
      p.append(text(op.summary));
      out.append(h, p);
      const body = op.requestBody && op.requestBody.content["application/json"].schema;
      if (!body || !body.properties) continue;
      const table = document.createElement("table");
      for (const [name, field] of Object.entries(body.properties)) {
        const row = table.insertRow();
        const cell = row.insertCell();
        cell.append(text(name + ((body.required || []).includes(name) ? " (required)" : "")));
        row.insertCell().append(text(kind(field)));
        row.insertCell().append(text(field.description || ""));
      }
      out.append(table);
    }
  }
});
</script></body></html>
"""
