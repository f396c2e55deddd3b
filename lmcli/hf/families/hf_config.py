"""A Hugging Face ``config.json`` as the family adapters read it.

Every value an adapter takes from a config goes through ``HFConfig``: ``require`` for a field the
family cannot do without (one line naming it when absent), ``get`` for one with a default,
``section`` for a nested table (``rope_scaling``, ``rope_parameters``). This is the one place
where each field's type and range is to be checked before use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcli.errors import LmcliError


class HFConfig:
    """The fields of one ``config.json`` (or of a table inside it); ``where`` names the file."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when the config does not name it."""
        return self.data.get(key, default)

    def require(self, key: str) -> Any:
        """The value of ``key``; one line naming it when the config lacks it."""
        if key not in self.data:
            raise LmcliError(f"{self.where} has no {key}")
        return self.data[key]

    def section(self, key: str) -> HFConfig:
        """The table ``key`` (empty when absent or null), read the same way."""
        return HFConfig(dict(self.data.get(key) or {}), self.where)

    def named(self) -> set[str]:
        """The keys whose value is not null."""
        return {k for k, v in self.data.items() if v is not None}

    def __bool__(self) -> bool:
        return bool(self.data)
