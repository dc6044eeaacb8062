"""Twenty JSON schemas for the structured-output tests: nested objects, arrays, enums, bounded numbers and
required fields. Strings and arrays are bounded so a sampled answer always fits the token budget."""
from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SHORT = {"type": "string", "maxLength": 30}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 120}},
                  "required": ["name", "age"]}),
    ("a city", {"type": "object", "properties": {"city": NAME, "population": {"type": "integer", "minimum": 1,
                                                                                "maximum": 40000000}},
                "required": ["city", "population"]}),
    ("a colour choice", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                         "required": ["colour"]}),
    ("a yes/no answer", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("a shopping list", {"type": "object", "properties": {"items": {"type": "array", "items": NAME, "minItems": 1,
                                                                    "maxItems": 4}},
                         "required": ["items"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                  "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {"title": SHORT, "author": {"type": "object", "properties": {
        "first": NAME, "last": NAME}, "required": ["first", "last"]}, "year": {"type": "integer", "minimum": 1400,
                                                                             "maximum": 2030}},
                "required": ["title", "author", "year"]}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60},
        "unit": {"const": "C"}}, "required": ["celsius", "unit"]}),
    ("a list of scores", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10},
                          "minItems": 2, "maxItems": 5}),
    ("a user account", {"type": "object", "properties": {
        "username": {"type": "string", "pattern": "^[a-z]{3,10}$"},
        "role": {"enum": ["admin", "editor", "viewer"]}, "active": {"type": "boolean"}},
                        "required": ["username", "role", "active"]}),
    ("a weather report", {"type": "object", "properties": {
        "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200}}, "required": ["condition", "wind_kmh"]}),
    ("an order", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}}}, "required": ["id", "lines"]}),
    ("a rectangle", {"type": "object", "properties": {
        "width": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
        "height": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000}}, "required": ["width", "height"]}),
    ("a nullable note", {"type": "object", "properties": {"note": {"anyOf": [SHORT, {"type": "null"}]}},
                         "required": ["note"]}),
    ("a date", {"type": "object", "properties": {
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "month": {"type": "integer", "minimum": 1, "maximum": 12},
        "day": {"type": "integer", "minimum": 1, "maximum": 31}}, "required": ["year", "month", "day"]}),
    ("a pet", {"type": "object", "properties": {
        "species": {"enum": ["cat", "dog", "fish"]}, "name": NAME,
        "vaccinated": {"type": "boolean"}}, "required": ["species", "name"]}),
    ("a team", {"type": "object", "properties": {
        "name": NAME, "members": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"name": NAME, "lead": {"type": "boolean"}},
            "required": ["name", "lead"]}}}, "required": ["name", "members"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                   "comment": SHORT}, "required": ["stars"]}),
    ("coordinates", {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}),
    ("a product", {"type": "object", "properties": {
        "name": NAME, "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}, "maxItems": 3,
                               "uniqueItems": False},
        "dimensions": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 500},
                                                        "h": {"type": "integer", "minimum": 1, "maximum": 500}},
                       "required": ["w", "h"]}}, "required": ["name", "tags", "dimensions"]}),
]
