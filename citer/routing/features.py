"""Router inputs beyond the SLM's last hidden state (R2R's router reads the chosen token and the logits too).

Feature sets, concatenated in this order whatever order params list them::

    hidden           (H,)     the SLM's last hidden state after the final norm (always)
    token_embedding  (H,)     the SLM's input-embedding row of its greedy token: argmax of its logits over the
                              tokenizer's ``vocab_size`` ids (padded embedding rows never win)
    logit_stats      (k + 2,) the top-k log-probabilities (descending), the entropy (nats) and the
                              top-1 minus top-2 probability margin

Every feature is a function of the hidden state and the SLM's output head and input embedding, so label sets store
only the hidden state and the engine's router interface (``hidden (B, H) -> scores (B,)``) is unchanged:
:class:`FeatureRouter` computes the features itself from references to the SLM's own modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

FEATURES: tuple[str, ...] = ("hidden", "token_embedding", "logit_stats")
HIDDEN_ONLY: tuple[str, ...] = ("hidden",)
# router.ablations: name -> the feature set of the extra router trained on the last iteration's labels.
ABLATIONS: dict[str, tuple[str, ...]] = {
    "emb": ("hidden", "token_embedding"),
    "logits": ("hidden", "logit_stats"),
    "emb_logits": FEATURES,
}
DEFAULT_LOGIT_K = 4
# Rows of hidden states turned into logits at once when building a training matrix (bounds the (rows, V) block).
_LOGIT_ELEMENTS = 1 << 25


class RouterError(ValueError):
    """A router input or checkpoint that cannot be used; the message names the file or object and the field."""


def normalize_features(features: Iterable[str]) -> tuple[str, ...]:
    """The feature names in canonical order; refuses unknown names and a set without ``hidden``."""
    given = list(features)
    unknown = sorted(set(given) - set(FEATURES))
    if unknown:
        raise RouterError(
            f"router: field features has unknown names {unknown}; expected some of {list(FEATURES)}"
        )
    if "hidden" not in given:
        raise RouterError(f"router: field features={given} must contain 'hidden'")
    return tuple(f for f in FEATURES if f in given)


def needs_slm(features: Iterable[str]) -> bool:
    """True when the features read the SLM's head or embedding (anything beyond ``hidden``)."""
    return normalize_features(features) != HIDDEN_ONLY


def input_dim(hidden_size: int, features: Iterable[str], k: int = DEFAULT_LOGIT_K) -> int:
    """Width D of :func:`router_inputs` for an SLM of hidden size ``hidden_size``."""
    feats = normalize_features(features)
    d = hidden_size
    if "token_embedding" in feats:
        d += hidden_size
    if "logit_stats" in feats:
        d += k + 2
    return d


def head_vocab(head: nn.Module, vocab_size: int | None) -> int:
    """The ids the features look at: the tokenizer's ``vocab_size``, else the head's full width."""
    width = int(head.weight.shape[0])
    vocab = width if vocab_size is None else int(vocab_size)
    if not 2 <= vocab <= width:
        raise RouterError(f"router: field vocab_size={vocab} outside [2, {width}] (the SLM head's rows)")
    return vocab


@torch.no_grad()
def router_inputs(
    hidden: torch.Tensor,
    features: Sequence[str],
    head: nn.Module | None,
    embedding: nn.Module | None,
    vocab_size: int | None,
    k: int = DEFAULT_LOGIT_K,
) -> torch.Tensor:
    """``hidden (B, H)`` -> ``(B, D)`` float32 on ``hidden``'s device, D = :func:`input_dim` (H, features, k).

    ``head`` is the SLM's output embedding (``get_output_embeddings()``), ``embedding`` its input embedding
    (``get_input_embeddings()``); both may be None for ``["hidden"]``.
    """
    feats = normalize_features(features)
    if feats == HIDDEN_ONLY:
        return hidden.float()
    if head is None or embedding is None:
        raise RouterError(f"router: features {list(feats)} need the SLM's output head and input embedding")
    w = head.weight
    vocab = head_vocab(head, vocab_size)
    if "logit_stats" in feats and not 1 <= k <= vocab:
        raise RouterError(f"router: field logit_k={k} outside [1, {vocab}]")
    logits = head(hidden.to(device=w.device, dtype=w.dtype)).float()[:, :vocab]  # (B, V)
    parts = [hidden.float().to(logits.device)]
    if "token_embedding" in feats:
        token = logits.argmax(dim=-1)  # (B,) the SLM's greedy token
        e = embedding.weight
        parts.append(embedding(token.to(e.device)).float().to(logits.device))  # (B, H)
    if "logit_stats" in feats:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V), finite for finite logits
        top = logp.topk(max(k, 2), dim=-1).values  # (B, max(k, 2)) descending
        entropy = -(logp.exp() * logp).sum(dim=-1, keepdim=True)  # (B, 1)
        margin = (top[:, :1].exp() - top[:, 1:2].exp()).clamp_min(0.0)  # (B, 1)
        parts += [top[:, :k], entropy, margin]
    return torch.cat(parts, dim=-1).to(hidden.device)


def feature_matrix(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    features: Sequence[str],
    head: nn.Module | None,
    embedding: nn.Module | None,
    vocab_size: int | None,
    k: int = DEFAULT_LOGIT_K,
) -> torch.Tensor:
    """Training inputs ``(len(rows), D)`` float32 on the CPU for ``hidden[rows]`` (any dtype, e.g. a label set's
    float16 store), computed in chunks so no (N, V) logits or float32 copy of ``hidden`` is ever held."""
    h = int(hidden.shape[1])
    d = input_dim(h, features, k)
    out = torch.empty((len(rows), d), dtype=torch.float32)
    vocab = head_vocab(head, vocab_size) if head is not None else 1
    step = max(1, min(4096, _LOGIT_ELEMENTS // vocab))
    device = head.weight.device if head is not None else torch.device("cpu")
    for s in range(0, len(rows), step):
        chunk = hidden[rows[s : s + step]].to(device)
        out[s : s + len(chunk)] = router_inputs(chunk, features, head, embedding, vocab_size, k).cpu()
    return out


def param_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and floating buffers (BatchNorm's running statistics): what a call reads."""
    tensors = [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]
    return int(sum(t.numel() * t.element_size() for t in tensors))


class FeatureRouter(nn.Module):
    """An MLP router on :func:`router_inputs`, called like any router: ``forward(hidden (B, H)) -> scores (B,)``.

    Holds references to the SLM's head and input embedding (the same tensors, not copies, and not registered as
    submodules: ``state_dict``, ``.to()`` and ``parameters()`` see the MLP only).
    """

    def __init__(
        self,
        mlp: nn.Module,
        head: nn.Module,
        embedding: nn.Module,
        features: Sequence[str],
        logit_k: int = DEFAULT_LOGIT_K,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        self.features = normalize_features(features)
        self.logit_k = int(logit_k)
        self.vocab_size = head_vocab(head, vocab_size)
        h = int(mlp.hidden_size)
        if int(head.weight.shape[1]) != h or int(embedding.weight.shape[1]) != h:
            raise RouterError(
                f"router: the MLP reads hidden size {h}, the SLM head/embedding have "
                f"{int(head.weight.shape[1])}/{int(embedding.weight.shape[1])}"
            )
        want = input_dim(h, self.features, self.logit_k)
        if int(mlp.input_dim) != want:
            raise RouterError(
                f"router: field input_dim={mlp.input_dim} but features {list(self.features)} give {want}"
            )
        self.mlp = mlp
        self._slm_parts = (head, embedding)  # a tuple: not registered, so never saved, moved or trained

    @property
    def hidden_size(self) -> int:
        return int(self.mlp.hidden_size)

    @property
    def dropout(self) -> float:
        return float(self.mlp.dropout)

    @property
    def input_dim(self) -> int:
        return int(self.mlp.input_dim)

    @property
    def head(self) -> nn.Module:
        return self._slm_parts[0]

    @property
    def embedding(self) -> nn.Module:
        return self._slm_parts[1]

    @property
    def weight_bytes(self) -> int:
        """Bytes read per call beyond the SLM's own weights: the MLP, plus one embedding row (H x element size) with
        ``token_embedding``. The logits count as the SLM step's own (a fused engine reuses the step's logits)."""
        extra = 0
        if "token_embedding" in self.features:
            e = self.embedding.weight
            extra = int(e.shape[1]) * e.element_size()
        return int(self.mlp.weight_bytes) + extra

    def inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) -> (B, D) float32: the MLP's input."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise RouterError(
                f"router input: field hidden has shape {tuple(hidden.shape)}, expected (B, {self.hidden_size})"
            )
        return router_inputs(hidden, self.features, self.head, self.embedding, self.vocab_size, self.logit_k)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) -> (B,) float32 logits on the MLP's device."""
        return self.mlp.logits(self.inputs(hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(self.training and torch.is_grad_enabled()):
            return torch.sigmoid(self.logits(hidden)).to(hidden.device)

    def describe(self) -> dict[str, Any]:
        """What ``router.json`` records about the inputs."""
        return {"features": list(self.features), "logit_k": self.logit_k, "vocab_size": self.vocab_size}


def slm_parts(slm: Any) -> tuple[nn.Module, nn.Module]:
    """The SLM's output head and input embedding (the modules themselves: their weights are shared)."""
    return slm.get_output_embeddings(), slm.get_input_embeddings()
