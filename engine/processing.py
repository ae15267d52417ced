"""Prompt -> token ids (+ media spans): chat template, tokenization, placeholder expansion.

Runs in the caller's thread (LLM) or a worker thread (AsyncLLM), never in the engine loop.
A prompt is a string, a list of token ids, or a dict
`{"prompt" | "prompt_token_ids": ..., "multi_modal_data": {...}, "mm_processor_kwargs": {...}}`.
Media is decoded before `process` is called (engine.media); the model's multimodal processor
turns the decoded items into encoder inputs and expands each placeholder into the exact number
of tokens its encoder emits.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.chat import MODALITIES, parse_messages
from engine.chat_template import TemplateVariables
from engine.media.limits import MediaLimits
from engine.reasoning import ThinkingFormat
from engine.tools import detect as detect_tool_format
from models.interfaces import MultimodalProcessor, ProcessedPrompt, PromptPlan

PromptType = str | list[int] | dict


@dataclass
class ParsedPrompt:
    """A prompt split into its parts, before media is decoded."""

    text: str | None
    token_ids: list[int] | None
    mm_data: dict[str, list[Any]]
    mm_kwargs: dict[str, Any]
    add_special_tokens: bool = True
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage so far
    # Chat prompts: the rendered text of the conversation up to each later message (those
    # that are prefixes of `text`), to find where messages start.
    message_prefixes: list[str] = field(default_factory=list)
    # Thinking models' chats: whether the prompt leaves the reply inside its thinking block
    # (None: not a chat, or a model that does not think).
    thinking: bool | None = None


@dataclass(frozen=True)
class EncoderBudget:
    """The largest media item the engine can ever schedule, in embeddings, and why."""

    max_embeds: int
    setting: str  # the option that sets the bound, named in errors


class InputProcessor:
    """Tokenizes prompts and, for multimodal models, delegates media to the model's processor."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        mm_processor: MultimodalProcessor | None = None,
        media_limits: MediaLimits | None = None,
        encoder_budget: EncoderBudget | None = None,
        message_starts: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # Whether chat prompts record where their messages start (hybrid models snapshot their
        # state there; see engine/state_cache.py).
        self.message_starts = message_starts
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.mm_processor = mm_processor
        self.media_limits = media_limits or MediaLimits()
        self.encoder_budget = encoder_budget
        if mm_processor is not None:  # the decoders, read in while the engine finishes starting
            threading.Thread(target=importlib.import_module, args=("engine.media.loader",),
                             name="media-decoders-import", daemon=True).start()
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        self.template_variables = TemplateVariables.of(template)
        self.thinking = ThinkingFormat.of_template(template)
        # Gemma 4's <|channel> is a special token: its replies are decoded with such tokens.
        self.thinking_keeps_special = self.thinking is not None and self.thinking.uses_any(
            {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
             if t.special})
        self.tool_parser = detect_tool_format(template)  # how the model writes tool calls

    @property
    def modalities(self) -> tuple[str, ...]:
        return () if self.mm_processor is None else tuple(self.mm_processor.modalities)

    def parse(self, prompt: PromptType) -> ParsedPrompt:
        if isinstance(prompt, str):
            return ParsedPrompt(prompt, None, {}, {})
        if isinstance(prompt, list):
            return ParsedPrompt(None, self._check_ids(prompt), {}, {})
        if not isinstance(prompt, dict):
            kind = type(prompt).__name__
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {kind}")
        unknown = set(prompt) - {
            "prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs",
            "add_special_tokens",
        }
        if unknown:
            raise ValueError(f"unknown prompt field(s): {', '.join(sorted(unknown))}")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if (text is None) == (ids is None):
            raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
        mm_data = self._check_mm_data(prompt.get("multi_modal_data") or {})
        return ParsedPrompt(
            text=text,
            token_ids=None if ids is None else self._check_ids(ids),
            mm_data=mm_data,
            mm_kwargs=self._check_mm_kwargs(prompt.get("mm_processor_kwargs")),
            add_special_tokens=bool(prompt.get("add_special_tokens", True)),
        )

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> ParsedPrompt:
        """Apply the model's chat template (with the generation prompt) to OpenAI messages.

        tools: OpenAI tool definitions, rendered by the template (ValueError if it renders
            none). chat_template_kwargs (and any other keyword but `mm_processor_kwargs`):
            variables the template reads, such as Qwen3's `enable_thinking`; a key it does
            not read is a ValueError naming the keys it does."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a prompt")
        mm_kwargs = self._check_mm_kwargs(template_kwargs.pop("mm_processor_kwargs", None))
        template_kwargs.update(chat_template_kwargs or {})
        self.template_variables.check(template_kwargs, tools)
        if tools:
            template_kwargs["tools"] = tools
        rendered, media = parse_messages(messages)
        # Before rendering: a text-only template given a media part fails on its list.
        mm_data = self._check_mm_data(media)
        text = self.tokenizer.apply_chat_template(
            rendered, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        parsed = ParsedPrompt(text, None, mm_data, mm_kwargs, False)
        if self.thinking is not None:
            parsed.thinking = self.thinking.opened_by(text)
        if self.message_starts:
            for i in range(1, len(rendered)):
                head = self.tokenizer.apply_chat_template(
                    rendered[:i], tokenize=False, add_generation_prompt=False, **template_kwargs)
                if text.startswith(head):
                    parsed.message_prefixes.append(head)
        return parsed

    def load_media_sync(self, parsed: ParsedPrompt) -> dict[str, list[Any]]:
        """Decode the prompt's media in this thread (items of one prompt in parallel)."""
        if not parsed.mm_data:
            return {}
        from engine.media.loader import load_request_media_sync  # the decoders: on first use

        t0 = time.perf_counter()
        media = load_request_media_sync(
            parsed.mm_data, limits=self.media_limits, **self._loader_kwargs(parsed)
        )
        parsed.stages["media_load"] = time.perf_counter() - t0
        return media

    async def load_media(self, parsed: ParsedPrompt) -> dict[str, list[Any]]:
        """Decode the prompt's media concurrently in worker threads, off the event loop."""
        if not parsed.mm_data:
            return {}
        from engine.media.loader import load_request_media  # the decoders: on first use

        t0 = time.perf_counter()
        media = await load_request_media(
            parsed.mm_data, limits=self.media_limits, **self._loader_kwargs(parsed)
        )
        parsed.stages["media_load"] = time.perf_counter() - t0
        return media

    def _loader_kwargs(self, parsed: ParsedPrompt) -> dict[str, Any]:
        return self.mm_processor.loader_kwargs(parsed.mm_kwargs)

    def process(self, parsed: ParsedPrompt, media: dict[str, list[Any]]) -> ProcessedPrompt:
        """Tokenize and (for media) expand placeholders; `media` holds decoded items."""
        t0 = time.perf_counter()
        ids = parsed.token_ids
        if ids is None:
            text = parsed.text
            if self.mm_processor is not None:
                text = self.mm_processor.expand_text(text, media, parsed.mm_kwargs)
            ids = self.tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens)
        if self.mm_processor is not None:
            plan = self.mm_processor.plan(ids, media, parsed.mm_kwargs)
            if plan is not None:
                self._check_plan(plan)
            out = self.mm_processor.process(ids, media, parsed.mm_kwargs)
            out.text = parsed.text
        else:
            out = ProcessedPrompt(parsed.text, list(ids))
        out.message_starts = self._message_starts(parsed, ids, out)
        out.stages.setdefault("preprocess", time.perf_counter() - t0)
        out.stages.update(parsed.stages)
        self._check_plan(PromptPlan(
            len(out.token_ids),
            [(f.modality, f.encoder_size) for f in out.mm_features],
        ))
        return out

    def _message_starts(self, parsed: ParsedPrompt, ids: list[int],
                        out: ProcessedPrompt) -> tuple[int, ...]:
        """Token offsets of the chat's message starts: each earlier part of the conversation
        whose tokens begin the prompt's, as long as no media placeholder comes before it (the
        offsets of the processed prompt move where placeholders expand)."""
        first_media = min((f.placeholder.offset for f in out.mm_features), default=len(ids))
        starts = []
        for head in parsed.message_prefixes:
            head_ids = self.tokenizer.encode(head, add_special_tokens=parsed.add_special_tokens)
            n = len(head_ids)
            if 0 < n <= first_media and ids[:n] == head_ids and out.token_ids[:n] == head_ids:
                starts.append(n)
        return tuple(starts)

    def _check_plan(self, plan: PromptPlan) -> None:
        """Refuse a prompt that could never run: empty, too long, or with an item larger than
        the encoder budget (such an item could never be scheduled, and the request would wait
        forever)."""
        if not plan.num_tokens:
            raise ValueError("the prompt is empty")
        if plan.num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {plan.num_tokens} tokens, but max_model_len is "
                f"{self.max_model_len} (prompt and output must fit); shorten the prompt or "
                "use fewer, smaller or shorter media items (mm_processor_kwargs max_pixels / fps)"
            )
        budget = self.encoder_budget
        for modality, n in plan.item_embeds:
            if budget is not None and n > budget.max_embeds:
                raise ValueError(
                    f"{modality} needs {n} embeddings, more than the "
                    f"encoder budget of {budget.max_embeds} ({budget.setting}); use a smaller "
                    "or shorter item (mm_processor_kwargs max_pixels / fps) or raise the option"
                )

    def _check_mm_kwargs(self, mm_kwargs: Any) -> dict[str, Any]:
        if not mm_kwargs:
            return {}
        if not isinstance(mm_kwargs, dict):
            raise ValueError(
                "mm_processor_kwargs must be a dict of option names to values, got "
                f"{type(mm_kwargs).__name__}"
            )
        if self.mm_processor is None:
            raise ValueError("this model has no media processor, so it takes no "
                             "mm_processor_kwargs")
        return dict(mm_kwargs)

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return list(ids)

    def _check_mm_data(self, mm_data: dict) -> dict[str, list[Any]]:
        if not isinstance(mm_data, dict):
            raise ValueError("multi_modal_data must be a dict like {'image': [...]}")
        out = {}
        for modality, items in mm_data.items():
            if modality not in MODALITIES:
                raise ValueError(f"unknown modality {modality!r} (known: {', '.join(MODALITIES)})")
            if modality not in self.modalities:
                accepted = ", ".join(self.modalities) or "text only"
                raise ValueError(f"this model does not accept {modality} inputs ({accepted})")
            items = items if isinstance(items, (list, tuple)) else [items]
            if items:
                out[modality] = list(items)
        return out
