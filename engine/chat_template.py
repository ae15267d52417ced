"""What a chat template reads: the variables it leaves undeclared (jinja2's
`meta.find_undeclared_variables`), to accept per-request `chat_template_kwargs` only for keys
the template reads (a typo then is an error, not a silently ignored option) and `tools` only
for templates that render them. Pure Python (jinja2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta

# Set by the renderer itself (engine.processing and transformers' apply_chat_template), never
# by a request's chat_template_kwargs.
RESERVED = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "raise_exception", "strftime_now", "bos_token", "eos_token", "pad_token", "unk_token",
    "namespace", "range", "dict", "loop",
})


@dataclass(frozen=True)
class TemplateVariables:
    """The variables a template reads (empty for a model without a template)."""

    names: frozenset[str]

    @classmethod
    def of(cls, template: str | None) -> TemplateVariables:
        if not template:
            return cls(frozenset())
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        try:
            return cls(frozenset(meta.find_undeclared_variables(env.parse(template))))
        except jinja2.TemplateSyntaxError:  # transformers reports it when rendering
            return cls(frozenset())

    @property
    def options(self) -> list[str]:
        """The keys a request may set through chat_template_kwargs."""
        return sorted(self.names - RESERVED)

    @property
    def renders_tools(self) -> bool:
        return "tools" in self.names

    def check(self, kwargs: Mapping[str, Any], tools: list | None = None) -> None:
        """ValueError for a key the template does not read or the renderer sets itself, or
        for tools given to a template that renders none."""
        for key in kwargs:
            if key in RESERVED:
                raise ValueError(f"chat_template_kwargs: {key!r} is set by the server and "
                                 "cannot be passed")
            if key not in self.names:
                known = ", ".join(self.options) or "none"
                raise ValueError(f"chat_template_kwargs: this model's chat template does not "
                                 f"read {key!r} (the keys it reads: {known})")
        if tools and not self.renders_tools:
            raise ValueError("tools: this model's chat template does not render tools, so the "
                             "model cannot be told about them")
