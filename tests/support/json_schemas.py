"""Ten JSON schemas of the kinds agent frameworks send (nested objects, enums, arrays, bounded numbers,
required fields), each with a prompt: what the structured-outputs tests and bench ask for.

Strings and arrays are bounded (``maxLength``, ``maxItems``) as a careful client bounds them, so a reply
finishes in a few dozen tokens on a small model; the tests still check that every finished reply validates.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 24}

SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe a fictional person as JSON.", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("weather", "Give today's weather report for Paris as JSON.", {
        "type": "object",
        "properties": {"city": NAME, "celsius": {"type": "number", "minimum": -50, "maximum": 60},
                       "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
        "required": ["city", "celsius", "sky"], "additionalProperties": False}),
    ("todo", "List three things to pack for a trip, as JSON.", {
        "type": "object",
        "properties": {"items": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["items"], "additionalProperties": False}),
    ("address", "Write a postal address as JSON.", {
        "type": "object",
        "properties": {"street": NAME, "city": NAME,
                       "geo": {"type": "object",
                               "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                              "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                               "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["street", "city", "geo"], "additionalProperties": False}),
    ("review", "Rate a movie you like, as JSON.", {
        "type": "object",
        "properties": {"title": NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "recommend": {"type": "boolean"}},
        "required": ["title", "stars", "recommend"], "additionalProperties": False}),
    ("tool_call", "Which shell command lists files? Answer as JSON.", {
        "type": "object",
        "properties": {"command": {"enum": ["ls", "pwd", "cat", "grep"]},
                       "args": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
        "required": ["command", "args"], "additionalProperties": False}),
    ("color", "Pick a color and give its RGB values as JSON.", {
        "type": "object",
        "properties": {"name": {"enum": ["red", "green", "blue", "orange"]},
                       "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                               "minItems": 3, "maxItems": 3}},
        "required": ["name", "rgb"], "additionalProperties": False}),
    ("order", "Write a small pizza order as JSON.", {
        "type": "object",
        "properties": {"size": {"enum": ["small", "medium", "large"]},
                       "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                       "customer": {"type": "object", "properties": {"name": NAME},
                                    "required": ["name"], "additionalProperties": False}},
        "required": ["size", "quantity", "customer"], "additionalProperties": False}),
    ("event", "Describe a meeting as JSON.", {
        "type": "object",
        "properties": {"topic": NAME, "minutes": {"type": "integer", "minimum": 5, "maximum": 240},
                       "remote": {"type": "boolean"},
                       "attendees": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2}},
        "required": ["topic", "minutes", "remote", "attendees"], "additionalProperties": False}),
    ("math", "What is 7 times 6? Answer as JSON.", {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 1000},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"], "additionalProperties": False}),
]

# Open schemas: unbounded arrays and strings, as most clients send them (a pydantic model's ``list[str]`` and
# ``str``). A small model loops inside them (``"tags": ["pets", "pets", ...``) until max_tokens unless the server
# closes the loop (engine/grammar/loop_closing.py): what issue 52's measurement and its tests ask for.
TEXT = {"type": "string"}
WORDS = {"type": "array", "items": TEXT}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


OPEN_SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("pet", "Describe a pet as JSON.", _object({
        "name": TEXT, "kind": {"enum": ["dog", "cat", "bird"]}, "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": WORDS})),
    ("city", "Describe a city as JSON.", _object({
        "city": TEXT, "country": TEXT, "population": {"type": "integer", "minimum": 0}, "landmarks": WORDS})),
    ("steps", "List the steps to make tea, as JSON.", _object({"steps": WORDS})),
    ("recipe", "Write a pancake recipe as JSON.", _object({
        "title": TEXT, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "ingredients": {"type": "array", "items": _object({"name": TEXT, "amount": TEXT})}})),
    ("story", "Write a very short story as JSON.", _object({"title": TEXT, "text": TEXT})),
    ("team", "Describe a small software team as JSON.", _object({
        "name": TEXT, "members": {"type": "array", "items": _object({
            "name": TEXT, "role": {"enum": ["developer", "designer", "manager", "tester"]}})}})),
    ("book", "Describe a famous book as JSON.", _object({
        "title": TEXT, "author": TEXT, "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "genres": WORDS})),
    ("todos", "Write my to-do list for today as JSON.", _object({
        "todos": {"type": "array", "items": _object({"task": TEXT, "done": {"type": "boolean"}})}})),
    ("review", "Review a movie you like, as JSON.", _object({
        "title": TEXT, "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "review": TEXT})),
    ("quiz", "Write a quiz question about geography as JSON.", _object({
        "question": TEXT, "options": WORDS, "answer": {"type": "integer", "minimum": 0, "maximum": 9}})),
]
