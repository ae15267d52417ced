"""The published schema of chat messages: content parts (text, image, video and audio by URL
or data URL, OpenAI's input_audio, and the Hugging Face style `{"type": "image", "image":
...}`), messages of every role with tool calls and tool results, as pydantic models.

Extra keys on a message are kept for the chat template (templates read keys such as `name`);
a content part's `type` is checked against the known ones, so a part of an unknown type is a
400 naming the path and the types accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class URL(_Model):
    url: str = Field(description="http(s) URL or data: URL of the media item")
    detail: str | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: URL | str


class VideoURLPart(_Model):
    type: Literal["video_url"]
    video_url: URL | str


class AudioURLPart(_Model):
    type: Literal["audio_url"]
    audio_url: URL | str


class InputAudio(_Model):
    data: str = Field(description="base64-encoded audio")
    format: str = "wav"


class InputAudioPart(_Model):
    type: Literal["input_audio"]
    input_audio: InputAudio


class ImagePart(_Model):
    """Hugging Face style: the item as a URL, data URL or path under the allowed dirs."""

    type: Literal["image"]
    image: str | None = None
    url: str | None = None


class VideoPart(_Model):
    type: Literal["video"]
    video: str | None = None
    url: str | None = None


class AudioPart(_Model):
    type: Literal["audio"]
    audio: str | None = None
    url: str | None = None


ContentPart = Annotated[
    TextPart | ImageURLPart | VideoURLPart | AudioURLPart | InputAudioPart | ImagePart
    | VideoPart | AudioPart,
    Field(discriminator="type"),
]


class FunctionCall(_Model):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallItem(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message. `tool_calls` on an assistant message are calls it made; a `tool`
    message carries a call's result (`tool_call_id`). Other keys reach the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(description="system, developer, user, assistant, tool (or a role the "
                                  "model's template knows)")
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def engine_message(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
