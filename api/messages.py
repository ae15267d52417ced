"""The published schema of chat messages: content parts (text, image, video and audio by URL
or data URL, OpenAI's input_audio, and the Hugging Face style `{"type": "image", "image":
...}`), messages of every role with tool calls and tool results, as pydantic models.

Extra keys on a message are kept for the chat template (templates read keys such as `name`).
Every union here is discriminated, so that a bad body is refused for its real problem: the
content by its JSON kind (a string or a list of parts), a part by its `type` (a part of an
unknown type, or without one, is a 400 naming its index and the types accepted), a media URL
by its kind (an object with `url`, or the URL as a string). The tags of these unions (written
`<...>`) appear in pydantic's error locations; api.errors leaves them out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

# The tags of the shape-discriminated unions below (left out of error paths).
STRING, LIST, OBJECT = "<string>", "<list>", "<object>"


def _shape(value: Any) -> str | None:
    """The JSON kind of a value, as the tag of a shape-discriminated union (None: no branch
    takes it, and pydantic names the kinds expected)."""
    if isinstance(value, str):
        return STRING
    if isinstance(value, list):
        return LIST
    if isinstance(value, (dict, BaseModel)):
        return OBJECT
    return None


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class URL(_Model):
    url: str = Field(description="http(s) URL or data: URL of the media item")
    detail: str | None = None


# A media item: {"url": ...} or the URL itself.
MediaURL = Annotated[
    Annotated[URL, Tag(OBJECT)] | Annotated[str, Tag(STRING)],
    Discriminator(_shape, custom_error_type="media_url_type",
                  custom_error_message="Input should be an object with a string 'url', or "
                                       "the URL as a string"),
]


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: MediaURL


class VideoURLPart(_Model):
    type: Literal["video_url"]
    video_url: MediaURL


class AudioURLPart(_Model):
    type: Literal["audio_url"]
    audio_url: MediaURL


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


# A message's content: its text, or a list of parts.
Content = Annotated[
    Annotated[str, Tag(STRING)] | Annotated[list[ContentPart], Tag(LIST)],
    Discriminator(_shape, custom_error_type="content_type",
                  custom_error_message="Input should be a string or a list of content parts"),
]


class ChatMessage(BaseModel):
    """One message. `tool_calls` on an assistant message are calls it made; a `tool`
    message carries a call's result (`tool_call_id`). Other keys reach the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(description="system, developer, user, assistant, tool (or a role the "
                                  "model's template knows)")
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def engine_message(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


# The modality each media part carries.
PART_MODALITY = {"image_url": "image", "image": "image", "video_url": "video", "video": "video",
                 "audio_url": "audio", "audio": "audio", "input_audio": "audio"}


def refuse_unaccepted_media(messages: list[ChatMessage], accepted: tuple[str, ...],
                            model: str) -> None:
    """ValueError (a 400) for the first media part of a modality `model` does not take, naming
    the modality, the model, what it takes and where the part is."""
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            modality = PART_MODALITY.get(part.type)
            if modality is not None and modality not in accepted:
                takes = " and ".join(("text", *accepted))
                raise ValueError(
                    f"messages.{i}.content.{j}: model {model!r} does not accept {modality} "
                    f"inputs (it takes {takes}); remove the {part.type} part or choose a "
                    "model that takes it")
