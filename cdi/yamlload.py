"""The one YAML loader of this project: safe (plain data only) and strict about repeated keys.

Plain YAML loading keeps the last of two equal keys without a word; the Go CDI loader's strict
parse rejects the file instead, and so does every reader here (CDI specs, the sharing plan,
simulated layouts, example claims), so a typo'd copy-paste is an error rather than a silent
override. YAML merge keys (``<<``) are not repeats.
"""

from __future__ import annotations

import io
import json
from collections.abc import Hashable
from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a repeated mapping key, naming it and where it is."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable):  # construct_mapping reports unhashable keys itself
                if key in seen:
                    shown = json.dumps(key) if isinstance(key, str) else key
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {shown}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str | None = None) -> Any:
    """One YAML document as plain data; yaml.YAMLError (with the position) for bad or repeated-key input.

    ``source`` names the text in error positions (a file's path), where PyYAML would say "<unicode string>".
    """
    stream: str | io.StringIO = text
    if source is not None:
        stream = io.StringIO(text)
        stream.name = source  # what PyYAML's reader shows for a stream: its name attribute
    return yaml.load(stream, Loader=StrictLoader)  # StrictLoader is a SafeLoader: plain data only


def load_yaml_documents(text: str) -> list[Any]:
    """Every document of a multi-document YAML stream, as :func:`load_yaml` reads one."""
    return list(yaml.load_all(text, Loader=StrictLoader))  # StrictLoader is a SafeLoader: plain data only
