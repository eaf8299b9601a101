"""Five JSON schemas shared by the structured-output tests and benchmarks.

Together they cover nested objects, arrays, enums (string and integer), required and optional
fields and number ranges. Every string, array and number is bounded, so even a random-weight
model under the grammar finishes an instance in well under MAX_INSTANCE_TOKENS tokens.
"""

from __future__ import annotations

# Enough for the longest instance of any schema below with the test tokenizers.
MAX_INSTANCE_TOKENS = 160

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered"]},
    },
    "required": ["id", "customer", "items", "status"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo", "Cairo"]},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
        "humidity": {"type": "number", "minimum": 0, "maximum": 1},
        "conditions": {
            "type": "array",
            "items": {"enum": ["sun", "rain", "wind", "snow"]},
            "maxItems": 3,
        },
    },
    "required": ["city", "temperature", "conditions"],
    "additionalProperties": False,
}

EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 16},
        "priority": {"type": "integer", "enum": [1, 2, 3]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "location": {
            "type": "object",
            "properties": {
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "lon": {"type": "integer", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "priority", "location"],
    "additionalProperties": False,
}

SETTINGS = {
    "type": "object",
    "properties": {
        "enabled": {"type": "boolean"},
        "mode": {"enum": ["fast", "safe", "off"]},
        "retries": {"type": "integer", "minimum": 0, "maximum": 5},
        "limits": {
            "type": "object",
            "properties": {
                "low": {"type": "integer", "minimum": 0, "maximum": 10},
                "high": {"type": "integer", "minimum": 10, "maximum": 100},
            },
            "required": ["low", "high"],
            "additionalProperties": False,
        },
        "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    },
    "required": ["enabled", "mode", "retries", "limits", "note"],
    "additionalProperties": False,
}

SCHEMAS = {"person": PERSON, "order": ORDER, "weather": WEATHER, "event": EVENT, "settings": SETTINGS}

# A tool for the tool-calling tests: OpenAI's canonical example.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
