"""Gemma 4's assistant drafter (`Gemma4AssistantForCausalLM`): a small Gemma 4 decoder that
drafts tokens for its Gemma 4 target from the target's own state, as transformers'
Gemma4AssistantForCausalLM and its multi-token candidate generator define it.

It has no keys or values of its own: every layer reads the target's cache, a sliding layer
that of the target's last sliding layer computing keys (its "store" layer), a global layer the
global one's. To draft after the token x_q at position q, with h the target's final hidden
state at q - 1 (after its final norm, the row whose logits chose x_q):

    e = pre_projection(concat(target_embed(x_q), h))     (2 x the target's width -> its own)
    s = norm(layers(e))    one query at position q attending the target's keys at 0 .. q - 1
                           (a sliding layer the window's last keys, q - W .. q - 1)
    logits = lm_head(s)    (or, with `use_ordered_embeddings`, only the tokens of the top
                            centroids scored; every other token at their minimum - 1)
    h' = post_projection(s)                              (back to the target's width)

The next draft feeds the draft just made and h' at the same position q: the target's keys do
not grow while drafting. A prompt's or a verification's drafted tokens never enter the
target's cache before the target computes them, so the drafter reads only computed keys.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.gemma4.text import Gemma4Decoder, store_layers
from models.kernels.linear import Linear, float32_logits
from models.layers.attention_metadata import AttentionMetadata

ARCHITECTURE = "Gemma4AssistantForCausalLM"
ORDERING = "masked_embedding.token_ordering"


class AssistantError(ValueError):
    """An assistant checkpoint that cannot draft for this target; the message says why."""


def check_assistant(config) -> None:
    """The reference's own validation (Gemma4AssistantConfig.validate_architecture): every
    layer reads shared keys and values; no per-layer inputs, experts or double-wide MLPs."""
    text = config.get_text_config()
    wrong = [f"{name}={getattr(text, name)!r}" for name, ok in (
        ("hidden_size_per_layer_input", not text.hidden_size_per_layer_input),
        ("vocab_size_per_layer_input", not text.vocab_size_per_layer_input),
        ("enable_moe_block", not text.enable_moe_block),
        ("use_double_wide_mlp", not text.use_double_wide_mlp),
        ("num_kv_shared_layers", text.num_kv_shared_layers == text.num_hidden_layers),
    ) if not ok]
    if wrong:
        raise AssistantError(f"{ARCHITECTURE} checkpoint with {', '.join(wrong)}: its reference "
                             "class refuses these (every layer reads the target's keys and "
                             "values; no per-layer inputs, experts or double-wide MLPs)")


def check_target(config, target_text, target_width: int, target_vocab: int) -> dict[str, int]:
    """AssistantError unless the assistant (`config`) fits the target (its text config, hidden
    size and vocabulary): the width its projections take, one vocabulary, and for every layer
    type the target's store layer of that type with the assistant layer's KV heads, head size
    and window. Returns layer type -> the target layer whose keys and values it reads."""
    text = config.get_text_config()
    if config.backbone_hidden_size != target_width:
        raise AssistantError(f"the assistant was made for a target of width "
                             f"backbone_hidden_size={config.backbone_hidden_size}; this target's "
                             f"hidden_size is {target_width}")
    if text.vocab_size != target_vocab:
        raise AssistantError(f"the assistant's vocabulary has {text.vocab_size} tokens, the "
                             f"target's {target_vocab}: it drafts for another model")
    stores = store_layers(target_text)
    for i, kind in enumerate(text.layer_types):
        if kind not in stores:
            raise AssistantError(f"assistant layer {i} ({kind}) reads the target's {kind} keys, "
                                 f"and the target has no {kind} layer")
        mine, theirs = text.per_layer_config[i], target_text.per_layer_config[stores[kind]]
        if (mine.num_key_value_heads, mine.head_dim) != (theirs.num_key_value_heads,
                                                          theirs.head_dim):
            raise AssistantError(
                f"assistant layer {i} ({kind}) has {mine.num_key_value_heads} KV heads of "
                f"{mine.head_dim}; the target layer {stores[kind]} it reads has "
                f"{theirs.num_key_value_heads} of {theirs.head_dim}")
    if "sliding_attention" in text.layer_types and text.sliding_window != \
            target_text.sliding_window:
        raise AssistantError(f"the assistant's sliding_window={text.sliding_window} differs "
                             f"from the target's {target_text.sliding_window}")
    return {kind: stores[kind] for kind in dict.fromkeys(text.layer_types)}


class Gemma4Assistant(Gemma4Decoder):
    """Gemma 4's assistant drafter (see the module docstring). Its embedding table is its LM
    head (tied); its inputs are the target's embeddings and hidden states."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        check_assistant(hf_config)
        text = hf_config.get_text_config()
        super().__init__(text, self.tied_head(hf_config)[0], max_positions, device,
                         target_kv=True)
        width, hidden = hf_config.backbone_hidden_size, text.hidden_size
        self.layer_types = tuple(text.layer_types)
        self.pre_projection = Linear(2 * width, hidden, bias=False)
        self.post_projection = Linear(hidden, width, bias=False)
        self.ordered = bool(hf_config.use_ordered_embeddings)
        self.centroids: Linear | None = None
        if self.ordered:
            if text.vocab_size % hf_config.num_centroids:
                raise AssistantError(f"num_centroids={hf_config.num_centroids} does not divide "
                                     f"the vocabulary ({text.vocab_size} tokens)")
            self.centroids = Linear(hidden, hf_config.num_centroids, bias=False)
            self.top_centroids = hf_config.centroid_intermediate_top_k
            # [V]: the token ids, grouped by centroid (set by the loader from the checkpoint)
            self.register_buffer("token_ordering", torch.zeros(text.vocab_size,
                                                              dtype=torch.int64),
                                 persistent=False)

    def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [B, Ht] (the target's embeddings of each request's last token), hidden
        [B, Ht] (the target's final hidden state before it, or the last draft's h'),
        positions [B] (each last token's) -> (logits [B, V] float32, h' [B, Ht])."""
        x = self.pre_projection(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        rotary = [self.rotary_cos_sin(r, positions, x.dtype) for r in self.rotaries]
        for layer in self.layers:
            x = layer(x, rotary, meta)
        x = self.norm(x)
        return self._logits(x), self.post_projection(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ordered:
            return float32_logits(self.lm_head, x)
        # The top centroids' tokens scored against their rows of the head; every other token
        # at the row's lowest score - 1 (the reference takes the lowest over its batch, which
        # in generation is this one request).
        assert self.centroids is not None
        top = self.centroids(x).topk(self.top_centroids, dim=-1).indices  # [B, K]
        groups = self.token_ordering.view(self.centroids.out_features, -1)  # [C, V / C]
        picked = groups[top].flatten(1)  # [B, K * V / C]
        head = self.lm_head.weight
        # one product per request: a batched matmul in bfloat16 takes a slow path on the CPU
        scores = torch.stack([F.linear(x[i], head[picked[i]]) for i in range(x.shape[0])])
        scores = scores.float()  # [B, K * V / C]
        out = (scores.amin(dim=-1, keepdim=True) - 1.0).expand(-1, self.cfg.vocab_size)
        return out.clone().scatter_(1, picked, scores)

    def ordering_is_a_permutation(self) -> bool:
        """Whether the token ordering holds every token id once (a checkpoint without one
        leaves it zero)."""
        ids = self.token_ordering.sort().values
        return bool(torch.equal(ids, torch.arange(ids.numel(), device=ids.device)))

    def bind_target(self, target_layers: list, stores: dict[str, int]) -> None:
        """Each layer's attention reads the cache of the target layer its type names."""
        for layer, kind in zip(self.layers, self.layer_types, strict=True):
            layer.self_attn.kv_cache = target_layers[stores[kind]].self_attn.kv_cache

    def checkpoint_map(self) -> Callable:
        """transformers' names: model.* (its decoder), pre_projection, post_projection,
        masked_embedding.centroids; the head tied to model.embed_tokens. The token ordering
        (an integer buffer) is read by the loader, not mapped."""
        base = self.weight_map(prefix="model.", lm_head="lm_head.")

        def mapping(name: str):
            if name.startswith(("pre_projection.", "post_projection.")):
                return name, None
            if name == "masked_embedding.centroids.weight":
                return ("centroids.weight", None) if self.ordered else None
            if name == ORDERING:
                return None
            return base(name)

        return mapping

    # Linears a quantized engine leaves in the model dtype: the ordered scoring reads the
    # head's rows, and the centroids choose among the tokens.
    exact_linears = ("lm_head", "centroids")
